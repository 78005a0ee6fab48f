"""Decode throughput under each way of sampling, against greedy, beside vLLM's CPU backend on the same weights.

    python -m benchmarks.sampling [--model pagedserve-56m] [--batches 1 64] [--decode-tokens 64] [--rounds 2]
                                  [--no-vllm]

Greedy decoding reads one argmax per row; sampling adds, per step and row, a softmax over the vocabulary, the
top-k / top-p masks and a draw. On CPU these are torch ops over B x 32k logits, and some of torch's are slow
there (a full sort of a 32k row took 1.2 ms, exponential noise 0.6 ms), so a step's sampling could cost as much
as the model. Each setting runs B requests of 32 random prompt tokens, ignore_eos, T + 1 output tokens: ours
stepped by hand (decode tokens/s from the step where every request has its first token, as
benchmarks/quantized.py), vLLM's from two runs, 1 and T + 1 output tokens, and their difference. The random-weight
model's distributions are flat (its most likely token: ~1.7 nats above uniform): top-p 0.95 at temperature 0.8
keeps most of the vocabulary; only at temperature 0.05 is its nucleus as small as a trained model's usually is.

A benchmark, never run in CI."""

from __future__ import annotations

import argparse

from benchmarks.quantized import decode_rate, prompts
from engine import LLM
from engine.models.builtin import materialize_builtin

SETTINGS = {
    "greedy": {},
    "temperature 0.8": {"temperature": 0.8},
    "temperature 0.8, top_k 50": {"temperature": 0.8, "top_k": 50},
    "temperature 0.8, top_p 0.95": {"temperature": 0.8, "top_p": 0.95},
    "temperature 0.05, top_p 0.95": {"temperature": 0.05, "top_p": 0.95},
}


def bench_ours(args) -> dict[tuple[str, int], float]:
    blocks = max(args.batches) * -(-(args.prompt_len + args.decode_tokens + 2) // 16) + 8
    llm = LLM(str(materialize_builtin(args.model)), dtype="float32", num_kv_blocks=blocks,
              max_num_seqs=max(args.batches), max_model_len=args.prompt_len + args.decode_tokens + 16,
              num_threads=args.threads)
    decode_rate(llm, 2, args.prompt_len, 2, {})  # warm-up
    rates: dict[tuple[str, int], float] = {}
    for batch in args.batches:
        for _ in range(args.rounds):
            for name, sampling in SETTINGS.items():  # interleaved: load changes hit every setting alike
                rate = decode_rate(llm, batch, args.prompt_len, args.decode_tokens, sampling)
                rates[name, batch] = max(rates.get((name, batch), 0.0), rate)
    return rates


def bench_vllm(args) -> dict[tuple[str, int], float]:
    from benchmarks.peers import vllm_cpu

    keys = [(name, batch) for batch in args.batches for name in SETTINGS] * args.rounds
    runs = [[(prompt, tokens, SETTINGS[name]) for prompt in prompts(batch, args.prompt_len)]
            for name, batch in keys for tokens in (1, args.decode_tokens + 1)]
    results = vllm_cpu.offline_runs(materialize_builtin(args.model), runs, max_num_seqs=max(args.batches),
                                    max_model_len=args.prompt_len + args.decode_tokens + 16)
    if results[0].error:
        print(f"vLLM CPU: {results[0].error}")
        return {}
    rates: dict[tuple[str, int], float] = {}
    for (name, batch), one, full in zip(keys, results[::2], results[1::2]):
        if full.seconds > one.seconds:
            rate = batch * args.decode_tokens / (full.seconds - one.seconds)
            rates[name, batch] = max(rates.get((name, batch), 0.0), rate)
    return rates


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="pagedserve-56m")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--no-vllm", action="store_true")
    args = ap.parse_args()
    ours = bench_ours(args)
    vllm = {} if args.no_vllm else bench_vllm(args)
    print(f"\n## {args.model}, float32: decode tokens/s by sampling ({args.prompt_len}-token prompts, "
          f"{args.decode_tokens} decoded, {args.threads} threads, best of {args.rounds})\n")
    print("| sampling | batch | pagedserve | / its greedy | vLLM CPU | / its greedy | pagedserve / vLLM |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for batch in args.batches:
        for name in SETTINGS:
            ours_rate, peer = ours[name, batch], vllm.get((name, batch))
            peer_cells = (f"{peer:.1f} | {peer / vllm['greedy', batch]:.2f}x | {ours_rate / peer:.2f}x"
                          if peer and vllm.get(("greedy", batch)) else "- | - | -")
            print(f"| {name} | {batch} | {ours_rate:.1f} | {ours_rate / ours['greedy', batch]:.2f}x | {peer_cells} |")


if __name__ == "__main__":
    main()
