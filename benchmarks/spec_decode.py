"""Speculative decoding: output tokens/s with and without it, greedy, on the 56M built-in target.

    python benchmarks/spec_decode.py [--batch-sizes 1 8] [--max-tokens 128] [--k 4]

Workloads (fixed seed, greedy, ignore_eos; every speculative run is checked token-identical to the
plain one):
  (a) ngram: prompts that hold the model's own greedy continuation of a random prefix (fed back as the
      prompt, as a "repeat this" request would), drafted by n-gram prompt lookup
  (b) draft = target: the 56M model drafts for itself; every draft is accepted, so this is the ceiling of
      the mechanism (k + 1 tokens per target forward) minus the cost of drafting with a full-size model
  (c) small draft: pagedserve-tiny (4M) drafts for the 56M target. With random weights the two models
      agree only by chance, so this shows what a draft that is cheap but rarely right costs.
Batch size 1 runs the requests one at a time (max_num_seqs=1), the latency regime speculation targets;
larger batches run together. Time includes each batch's prefill; prompts are short next to outputs.

Timing: torch runs on --threads threads (default 1) and tokens/s divide by the process's CPU time, so
that other work on a shared machine does not skew the comparison (wall time is printed alongside)."""

from __future__ import annotations

import argparse
import random
import time

from engine import LLM, SamplingParams

TARGET = "pagedserve-56m"
SMALL_DRAFT = "pagedserve-tiny"


THREADS = 1


def make_llm(batch_size: int, spec: dict | None) -> LLM:
    return LLM(TARGET, dtype="float32", max_model_len=1024, kv_cache_memory_gb=1.0, max_num_seqs=batch_size,
               speculative_config=spec, num_threads=THREADS)


def prompts_for(workload: str, n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    prefixes = [[1] + [rng.randrange(3, 32000) for _ in range(31)] for _ in range(n)]
    if workload != "ngram":
        return prefixes
    # The model's own continuation, fed back: the output goes on repeating what the prompt holds.
    llm = make_llm(n, None)
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    continuations = [o.outputs[0].token_ids for o in llm.generate(prefixes, params, use_tqdm=False)]
    return [p + c for p, c in zip(prefixes, continuations)]


def run(llm: LLM, prompts: list[list[int]], max_tokens: int) -> tuple[list[list[int]], float, float]:
    """Output tokens, CPU seconds and wall seconds."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)  # warm-up
    cpu, wall = time.process_time(), time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs], time.process_time() - cpu, time.perf_counter() - wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--requests-at-1", type=int, default=2, help="requests run one by one at batch size 1")
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    args = parser.parse_args()
    global THREADS
    THREADS = args.threads
    specs = {
        "ngram": {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_min": 2, "prompt_lookup_max": 4},
        "draft=target": {"method": "draft_model", "model": TARGET, "num_speculative_tokens": args.k},
        "small draft": {"method": "draft_model", "model": SMALL_DRAFT, "num_speculative_tokens": args.k},
    }
    rows = []
    for batch_size in args.batch_sizes:
        n = args.requests_at_1 if batch_size == 1 else batch_size
        for name, spec in specs.items():
            prompts = prompts_for("ngram" if name == "ngram" else "random", n, seed=batch_size)
            plain_tokens, plain_s, plain_wall = run(make_llm(batch_size, None), prompts, args.max_tokens)
            llm = make_llm(batch_size, spec)
            spec_tokens, spec_s, spec_wall = run(llm, prompts, args.max_tokens)
            stats = llm.llm_engine.get_stats()
            num_tokens = n * args.max_tokens
            rows.append((
                name, batch_size, num_tokens / plain_s, num_tokens / spec_s, plain_s / spec_s, plain_wall / spec_wall,
                stats.spec_decode_acceptance_rate, stats.spec_decode_mean_acceptance_length,
                spec_tokens == plain_tokens,
            ))
            print(f"done: {name} at batch {batch_size}", flush=True)
    print(f"\n{TARGET} float32, greedy, {args.max_tokens} output tokens per request, k={args.k}, "
          f"{args.threads} thread(s); tok/s per CPU second\n")
    print("| workload | batch | plain tok/s | spec tok/s | speedup | (wall) | acceptance | tokens/verify | identical |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, bs, plain, spec, speedup, wall, rate, length, same in rows:
        print(f"| {name} | {bs} | {plain:.0f} | {spec:.0f} | {speedup:.2f}x | {wall:.2f}x | {rate:.0%} | {length:.2f} "
              f"| {same} |")


if __name__ == "__main__":
    main()
