"""Tensor and pipeline parallelism on this host, layout by layout (TP 1/2 x PP 1/2) on the 56M built-in
model in float32: decode step time at batch 1 and 32, the driver's share of it in collectives (all-reduces,
the logits gather, and under PP the wait for the previous stage's hidden states), the weight bytes each rank
holds, and output tokens/s on benchmarks/throughput.py's workload.

    python -m benchmarks.parallel [--num-requests 100]

On a 2-core CPU this measures what splitting costs, not a speed-up: the host's cores are shared out among
the ranks (one thread each at TP=2), and every layer adds two gloo all-reduces through the kernel's TCP
loopback. A decode step at batch B is the time in which each of B running requests gets one token (with
PP the driver keeps two half-batches in flight)."""

from __future__ import annotations

import argparse
import time

from benchmarks.throughput import MODEL, workload
from engine import LLM, SamplingParams

LAYOUTS = [(1, 1), (2, 1), (1, 2), (2, 2)]


def _busy(llm: LLM) -> float:
    groups = llm.llm_engine.core.executor.driver_worker.groups
    return 0.0 if groups is None else groups.world.busy_s + groups.tp.busy_s + groups.pp.busy_s


def decode_step(llm: LLM, batch: int, prompt_len: int = 64, rounds: int = 24) -> tuple[float, float]:
    """(ms per decode step with `batch` requests running, share of it the driver spent in collectives)."""
    engine = llm.llm_engine
    for i in range(batch):
        engine.add_request([1] + [(i * 97 + k) % 31000 + 3 for k in range(prompt_len - 1)],
                           SamplingParams(temperature=0, max_tokens=10_000, ignore_eos=True))
    while engine.core.scheduler.waiting or any(r.num_computed_tokens < r.num_prompt_tokens
                                               for r in engine.core.scheduler.running):
        engine.step()
    for _ in range(4):  # warm-up decodes
        engine.step()
    tokens, busy, start = engine.core.scheduler.num_generation_tokens, _busy(llm), time.perf_counter()
    while engine.core.scheduler.num_generation_tokens - tokens < rounds * batch:
        engine.step()
    elapsed = time.perf_counter() - start
    steps = (engine.core.scheduler.num_generation_tokens - tokens) / batch
    engine.abort_request([r.external_id for r in list(engine.core.scheduler.running)])
    while engine.has_unfinished_requests():
        engine.step()
    return elapsed / steps * 1e3, (_busy(llm) - busy) / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-requests", type=int, default=100)
    args = parser.parse_args()
    reqs = workload(args.num_requests, seed=0)
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for _, m in reqs]
    rows = []
    for tp, pp in LAYOUTS:
        llm = LLM(MODEL, dtype="float32", max_model_len=1024, kv_cache_memory_gb=1.0, max_num_seqs=256,
                  tensor_parallel_size=tp, pipeline_parallel_size=pp)
        try:
            weights = llm.llm_engine.core.executor.weight_bytes_per_rank()
            step1, comm1 = decode_step(llm, 1)
            step32, comm32 = decode_step(llm, 32)
            llm.generate([p for p, _ in reqs[:8]], params[:8], use_tqdm=False)  # warm-up
            start = time.perf_counter()
            llm.generate([p for p, _ in reqs], params, use_tqdm=False)
            tok_s = sum(m for _, m in reqs) / (time.perf_counter() - start)
        finally:
            llm.shutdown()
        rows.append((tp, pp, step1, comm1, step32, comm32, max(weights.values()) / 2**20, tok_s))
        print(f"TP={tp} PP={pp}: done", flush=True)
    base = rows[0]
    print(f"\n{args.num_requests} requests of benchmarks/throughput.py's workload; model {MODEL}, float32\n")
    print("| TP | PP | decode step, batch 1 (ms) | in collectives | decode step, batch 32 (ms) | in collectives "
          "| weights per rank (MiB) | vs TP=PP=1 | output tok/s | vs TP=PP=1 |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for tp, pp, s1, c1, s32, c32, mib, tok_s in rows:
        print(f"| {tp} | {pp} | {s1:.1f} | {c1:.0%} | {s32:.1f} | {c32:.0%} | {mib:.0f} | {mib / base[6]:.2f}x "
              f"| {tok_s:.0f} | {tok_s / base[7]:.2f}x |")


if __name__ == "__main__":
    main()
