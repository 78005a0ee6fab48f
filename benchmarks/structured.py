"""Structured outputs: what constraining half of the requests costs the engine.

    python benchmarks/structured.py [--model pagedserve-56m] [--num-requests 64] [--rounds 3]

Workload (fixed seed): random token prompts of uniform length in [32, 256], sampled at temperature 1.
  none         every request unconstrained, max_tokens uniform in [32, 128], ignore_eos
  50% json     the same, but every other request constrained to a JSON schema (nested object, enums,
               bounded strings, integers and arrays), which ends it when the JSON completes (max_tokens 400)
Output tokens/s of each run (the constrained requests end where their JSON does, so the runs differ in
tokens; tokens/s compares them), their ratio, and the structured-output work per engine step: filling
and applying the token bitmask of the constrained rows, and advancing their matchers. Grammars are
compiled once before the timed runs (the compile cache's steady state). The two runs alternate for
--rounds rounds and each reports its best round, so that a noisy neighbour on a shared machine weighs
on both alike."""

from __future__ import annotations

import argparse
import random
import time

from engine import LLM, SamplingParams
from engine.sampling_params import StructuredOutputsParams

SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 99999},
        "status": {"enum": ["open", "closed", "pending"]},
        "title": {"type": "string", "maxLength": 24},
        "owner": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                                   "admin": {"type": "boolean"}}, "required": ["name", "admin"]},
        "labels": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 4},
    },
    "required": ["id", "status", "title", "owner", "labels"],
}


def workload(n: int, seed: int) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [([1] + [rng.randrange(3, 32000) for _ in range(rng.randint(32, 256) - 1)], rng.randint(32, 128))
            for _ in range(n)]


class _Timer:
    """Accumulates the wall time of a bound method (the manager's per-step work)."""

    def __init__(self, obj, name: str) -> None:
        self.total, self.calls, self._fn = 0.0, 0, getattr(obj, name)
        setattr(obj, name, self)

    def __call__(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return self._fn(*args, **kwargs)
        finally:
            self.total += time.perf_counter() - start
            self.calls += 1


def run(llm: LLM, reqs, constrained_every: int | None) -> dict:
    so = StructuredOutputsParams(json=SCHEMA)
    params = [
        SamplingParams(temperature=1.0, max_tokens=400, structured_outputs=so)
        if constrained_every and i % constrained_every == 0 else
        SamplingParams(temperature=1.0, max_tokens=m, ignore_eos=True)
        for i, (_, m) in enumerate(reqs)
    ]
    manager = llm.llm_engine.core.structured_output
    fill, advance = _Timer(manager, "apply_bitmask"), _Timer(manager, "advance")
    steps_before = llm.llm_engine.core._num_steps
    start = time.perf_counter()
    outs = llm.generate([p for p, _ in reqs], params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    del manager.apply_bitmask, manager.advance  # back to the class's methods
    constrained = [o for o, p in zip(outs, params) if p.structured_outputs is not None]
    return {
        "tokens": sum(len(o.outputs[0].token_ids) for o in outs),
        "elapsed": elapsed,
        "steps": llm.llm_engine.core._num_steps - steps_before,
        "constrained": len(constrained),
        "stopped": sum(o.outputs[0].finish_reason == "stop" for o in constrained),
        "mask_s": fill.total,
        "advance_s": advance.total,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="pagedserve-56m")
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    llm = LLM(args.model, dtype="float32", max_model_len=1024, max_num_seqs=256)
    reqs = workload(args.num_requests, args.seed)
    run(llm, reqs[:8], constrained_every=2)  # warm-up, and the schema's compile
    results: dict[str, dict] = {}
    for _ in range(args.rounds):
        for name, every in (("none", None), ("50% json", 2)):
            r = run(llm, reqs, every)
            if name not in results or r["tokens"] / r["elapsed"] > results[name]["tokens"] / results[name]["elapsed"]:
                results[name] = r
    print(f"\n{args.model}, {args.num_requests} requests, best of {args.rounds} rounds\n")
    print(f"{'run':<10} {'out tokens':>10} {'seconds':>8} {'tokens/s':>9} {'steps':>6} "
          f"{'JSON stop':>10} {'mask ms/step':>13} {'advance ms/step':>16}")
    for name, r in results.items():
        steps = max(r["steps"], 1)
        print(f"{name:<10} {r['tokens']:>10} {r['elapsed']:>8.2f} {r['tokens'] / r['elapsed']:>9.0f} {r['steps']:>6} "
              f"{r['stopped']:>4}/{r['constrained']:<5} {1e3 * r['mask_s'] / steps:>13.3f} "
              f"{1e3 * r['advance_s'] / steps:>16.3f}")
    base, mixed = (r["tokens"] / r["elapsed"] for r in results.values())
    print(f"\nthroughput ratio (50% json / none): {mixed / base:.2f}")


if __name__ == "__main__":
    main()
