"""Offline generation demo: `python -m engine --model pagedserve-tiny "Once upon a time"`."""

from __future__ import annotations

import argparse

from engine import LLM, SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("prompts", nargs="*", default=["Once upon a time", "The meaning of life is", "Paged attention"])
    ap.add_argument("--model", default="pagedserve-tiny")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--seed", type=int, default=None)
    args = ap.parse_args()
    llm = LLM(args.model, max_model_len=1024)
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed)
    for out in llm.generate(args.prompts, params):
        completion = out.outputs[0]
        print(f"--- {out.prompt!r} -> {len(completion.token_ids)} tokens ({completion.finish_reason})")
        print(completion.text)


if __name__ == "__main__":
    main()
