"""The step-time model of a simulated replica, fitted to the real engine on this machine.

A simulated replica is only as honest as its clock. Rather than invent costs, we time real
`engine.LLMEngine.step()` calls of the benchmark model (pagedserve-56m, float32, CPU, one torch thread:
what one engine replica gets when replicas share this machine's cores) at controlled mixes of prefill
tokens and decoding requests, and least-squares fit

    t = alpha + beta x prefill_tokens + gamma x decode_batch
          + delta_prefill x prefill_attention_pairs + delta_decode x decode_context_tokens

The first three terms are the α-β model of WVA and llm-d's BLIS simulator. The last two are there because
the measurements need them: on this CPU backend attention is a large share of a step, and it grows with
context, not with tokens. A 1024-token prompt costs about twice per token what a 256-token one does; a
short question after a long *cached* prefix still pays attention over that prefix, which is exactly the
case prefix caching produces; and a decode step at 1024 tokens of context costs twice one at 256.
prefill_attention_pairs = sum over prefill chunks of n x (c + (n + 1) / 2) (n new tokens after c computed
ones); decode_context_tokens = sum of the decoding requests' lengths. The fit minimises relative error
(most simulated steps are short decode steps). The plain three-term fit is printed too, with its errors.

The coefficients are cached in step_cost.json next to this file so that the benchmark never needs the
model; `--refit` measures again (about two minutes on one core).

    python -m benchmarks.cluster_sim.fit [--refit]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

CACHE_PATH = Path(__file__).with_name("step_cost.json")
MODEL = "pagedserve-56m"
DECODE_BATCHES = (0, 1, 8, 16, 32, 64)
PREFILL_SIZES = (0, 64, 256, 512, 1024)
DECODE_CONTEXT = 256  # prompt length of the decoding requests
CACHED_PREFIXES = (512, 1024)  # prefill after a cached prefix: these lengths...
PREFILL_AFTER_PREFIX = (64, 256)  # ...then this many new tokens (at decode batches 0 and 16)
LONG_CONTEXT = 1024  # a last batch of 16 decoders at this context


@dataclass(frozen=True)
class StepCostModel:
    alpha: float  # seconds per step
    beta: float  # seconds per prefill token
    gamma: float  # seconds per decoding request in the batch
    delta_prefill: float = 0.0  # seconds per prefill attention (query, key) pair
    delta_decode: float = 0.0  # seconds per token of a decoding request's context
    source: str = "default"

    def step_time(self, prefill_tokens: int, decode_batch: int, prefill_pairs: float = 0.0,
                  decode_context: float = 0.0) -> float:
        return (self.alpha + self.beta * prefill_tokens + self.gamma * decode_batch
                + self.delta_prefill * prefill_pairs + self.delta_decode * decode_context)


# Issue 15's GPU-shaped model: an 8B model on one GPU, where a step is weight-bound and attention is cheap
# next to the matrices at these lengths, so only the three alpha-beta terms. Not fitted: stated.
GPU_8B = StepCostModel(alpha=5e-3, beta=1e-4, gamma=1e-4,
                       source="GPU-shaped 8B (issue 15): 5 ms + 0.1 ms/prefill token + 0.1 ms/decoding request")


def prefill_pairs(new_tokens: int, computed: int) -> float:
    return new_tokens * (computed + (new_tokens + 1) / 2)


def describe(m: StepCostModel) -> str:
    return (f"alpha = {m.alpha * 1e3:.3f} ms, beta = {m.beta * 1e3:.4f} ms/prefill token, gamma = "
            f"{m.gamma * 1e3:.4f} ms/decoding request, delta_prefill = {m.delta_prefill * 1e6:.4f} us/pair, "
            f"delta_decode = {m.delta_decode * 1e6:.4f} us/context token")


def load_cost_model(path: Path = CACHE_PATH) -> StepCostModel:
    data = json.loads(path.read_text())
    return StepCostModel(data["alpha"], data["beta"], data["gamma"], data.get("delta_prefill", 0.0),
                         data.get("delta_decode", 0.0), data.get("source", str(path)))


Sample = tuple[int, int, float, float, float]  # prefill tokens, decode batch, prefill pairs, decode context, s


def measure(repeats: int = 3, seed: int = 0) -> list[Sample]:
    """Real engine steps, each scheduled whole (the token budget exceeds every mix)."""
    from engine import SamplingParams
    from engine.config import EngineConfig
    from engine.frontend.llm_engine import LLMEngine

    engine = LLMEngine(EngineConfig(
        model=MODEL, dtype="float32", device="cpu", num_threads=1, max_model_len=4096,
        num_kv_blocks=3072, max_num_seqs=256, max_num_batched_tokens=4096,
    ))
    sched = engine.core.scheduler
    rng = random.Random(seed)
    tokens = lambda n: [rng.randrange(3, 32000) for _ in range(n)]  # noqa: E731
    forever = SamplingParams(temperature=0, max_tokens=3000, ignore_eos=True, detokenize=False)
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, detokenize=False)
    samples: list[Sample] = []

    def settle() -> None:  # prefill every decoder, so that timed steps see only decodes plus the probe
        while sched.num_waiting or any(r.num_computed_tokens < r.num_tokens - 1 for r in sched.running):
            engine.step()

    def timed(prefix: list[int], new: int) -> None:
        times, contexts = [], []
        for _ in range(repeats):
            contexts.append(sum(r.num_tokens for r in sched.running))
            if new:
                engine.add_request(prefix + tokens(new), one)  # prefilled and finished by this one step
            start = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - start)
        samples.append((new, sched.num_running, prefill_pairs(new, len(prefix)), statistics.median(contexts),
                        statistics.median(times)))
        print(f"  prefill {new:5d} after {len(prefix):4d} cached + decode {sched.num_running:3d}: "
              f"{samples[-1][-1] * 1e3:8.1f} ms", file=sys.stderr, flush=True)

    for _ in range(4):  # warm-up: the first steps pay for lazy initialisation
        engine.add_request(tokens(64), one)
        engine.step()
    running: list[str] = []
    for batch in DECODE_BATCHES:
        while len(running) < batch:
            running.append(engine.add_request(tokens(DECODE_CONTEXT), forever))
        settle()
        for prefill in PREFILL_SIZES:
            if batch or prefill:
                timed([], prefill)
        if batch in (0, 16):
            for cached in CACHED_PREFIXES:
                prefix = tokens(cached)
                engine.add_request(prefix + [5], one)  # computes and caches the prefix
                engine.step()
                for new in PREFILL_AFTER_PREFIX:
                    timed(prefix, new)
    engine.abort_request(running)
    running = [engine.add_request(tokens(LONG_CONTEXT), forever) for _ in range(16)]
    settle()
    timed([], 0)
    timed([], 256)
    engine.abort_request(running)
    return samples


def fit(samples: list[Sample], with_attention: bool = True) -> StepCostModel:
    """Least squares on relative error: each sample's row and target divided by its measured time."""
    import numpy as np

    rows = [[1.0, p, b] + ([a, c] if with_attention else []) for p, b, a, c, _ in samples]
    t = np.array([s[-1] for s in samples])
    coef = np.linalg.lstsq(np.array(rows) / t[:, None], np.ones_like(t), rcond=None)[0]
    terms = "3-term" if not with_attention else "5-term"
    return StepCostModel(*map(float, coef), source=f"{MODEL} float32 CPU 1 thread, {terms} fit")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--refit", action="store_true", help="measure the engine again (else print the cache)")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    if not args.refit and CACHE_PATH.exists():
        data = json.loads(CACHE_PATH.read_text())
        samples = [tuple(s) for s in data["samples"]]
    else:
        samples = measure(args.repeats)
    model, linear = fit(samples), fit(samples, with_attention=False)
    print("| prefill tokens | decode batch | prefill attention pairs | decode context | measured ms | fitted ms "
          "| 3-term fit ms |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for p, b, a, c, s in samples:
        print(f"| {p} | {b} | {a:,.0f} | {c:,.0f} | {s * 1e3:.1f} | {model.step_time(p, b, a, c) * 1e3:.1f} "
              f"| {linear.step_time(p, b) * 1e3:.1f} |")
    for m in (model, linear):
        err = [abs(m.step_time(p, b, a, c) - s) / s for p, b, a, c, s in samples]
        print(f"\n{m.source}: {describe(m)}; mean |error| {statistics.mean(err):.0%}, max {max(err):.0%}")
    if args.refit or not CACHE_PATH.exists():
        CACHE_PATH.write_text(json.dumps({**asdict(model), "samples": samples}, indent=1) + "\n")
        print(f"\ncached in {CACHE_PATH}")


if __name__ == "__main__":
    main()
