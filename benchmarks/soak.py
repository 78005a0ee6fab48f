"""Soak: thousands of mixed requests against two engine replicas, then every replica must be idle with
its KV pool free, and its memory no larger than after warm-up.

    python benchmarks/soak.py [--requests 2000] [--concurrency 16] [--port 8201] [--seed 0]

Starts Ray and the app (built-in pagedserve-tiny, two engine replicas), then sends a seeded mix over
/v1/completions, /v1/chat/completions and /v1/messages: streamed and not, n of 1 to 3, prompts sharing a
few long prefixes, outputs ending by length (ignore_eos), by a stop token or by a stop string (forced
with logit_bias after min_tokens, so their token counts are exact), JSON-schema structured outputs;
10% of the clients disconnect mid-stream and 5% are cancelled while they wait. Every request must
complete with its exact token count and finish reason, or get a clear error (429/503 with the error
object). The first quarter is warm-up, after which the engine replicas' resident memory (replica process
and engine-core child) is measured; at the end it may have grown by at most 10%. Prints requests by
kind (completed, errors, disconnected, cancelled, failed), errors by type, each replica's final KV
usage and running/waiting counts, memory warm-up -> end, and every failure; exits 1 if an invariant fails.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections import Counter

import httpx

if __package__ in (None, ""):  # run as a script: make `benchmarks.*` importable
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import live_app
from benchmarks.soak_requests import Outcome, Spec, make_specs, run_spec

MAX_RSS_GROWTH = 0.10
# The engine process's resident memory climbs for its first ~2,000 requests and then levels off (native
# memory: the Python heap stays flat), so warm-up is a quarter of the run, not a token few requests.
WARMUP_FRACTION = 0.25
ENGINE = {"max_model_len": 512, "num_kv_blocks": 1024, "num_threads": 1}


async def run_all(base_url: str, specs: list[Spec], concurrency: int) -> list[Outcome]:
    limits = httpx.Limits(max_connections=concurrency * 2, max_keepalive_connections=concurrency)
    semaphore = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(base_url=base_url, limits=limits, timeout=300) as client:

        async def one(spec: Spec) -> Outcome:
            async with semaphore:
                return await run_spec(client, spec)

        return await asyncio.gather(*(one(spec) for spec in specs))


def wait_idle(app: str, timeout_s: float = 60.0) -> list[live_app.EngineLoad]:
    deadline = time.monotonic() + timeout_s
    while True:
        loads = live_app.engine_loads(app)
        if all(load.idle for load in loads) or time.monotonic() > deadline:
            return loads
        time.sleep(0.5)


class SoakReport:
    def __init__(self, outcomes: list[Outcome], loads: list[live_app.EngineLoad], rss_warm: dict[str, int],
                 rss_end: dict[str, int], restarts: list[str], max_rss_growth: float | None) -> None:
        self.outcomes, self.loads, self.restarts = outcomes, loads, restarts
        self.rss_warm, self.rss_end, self.max_rss_growth = rss_warm, rss_end, max_rss_growth

    @property
    def failures(self) -> list[Outcome]:
        return [o for o in self.outcomes if o.result == "failed"]

    def rss_growth(self) -> dict[str, float]:
        return {r: self.rss_end[r] / self.rss_warm[r] - 1 for r in self.rss_warm if r in self.rss_end}

    @property
    def problems(self) -> list[str]:
        problems = [f"{o.spec.label}: {o.detail}" for o in self.failures]
        problems += [f"replica {load.replica_id} not idle: {load}" for load in self.loads if not load.idle]
        problems += self.restarts
        if self.max_rss_growth is not None:
            problems += [f"replica {r} memory grew {g:+.1%}" for r, g in self.rss_growth().items()
                         if g > self.max_rss_growth]
        return problems

    def table(self) -> str:
        columns = ["requests", "completed", "errors", "disconnected", "cancelled", "failed"]
        rows: dict[str, Counter] = {}
        for o in self.outcomes:
            row = rows.setdefault(o.spec.kind_label, Counter())
            row["requests"] += 1
            row[o.result] += 1
        lines = [f"{'kind':<28}" + "".join(f"{c:>13}" for c in columns)]
        for kind, row in sorted(rows.items()) + [("total", sum(rows.values(), Counter()))]:
            lines.append(f"{kind:<28}" + "".join(f"{row[c]:>13}" for c in columns))
        errors = Counter(o.detail for o in self.outcomes if o.result == "errors")
        lines.append("\nerrors by type: " + (", ".join(f"{k}: {v}" for k, v in errors.most_common()) or "none"))
        endings = Counter(o.spec.ending for o in self.outcomes if o.result == "completed")
        lines.append("completed by ending: " + ", ".join(f"{k}: {v}" for k, v in sorted(endings.items())))
        lines.append(f"\n{'replica':<12}{'KV usage':>10}{'running':>9}{'waiting':>9}{'in flight':>11}"
                     f"{'RSS warm-up -> end (MiB)':>30}")
        growth = self.rss_growth()
        for load in self.loads:
            r = load.replica_id
            rss = (f"{self.rss_warm[r] / 2**20:.0f} -> {self.rss_end[r] / 2**20:.0f} ({growth[r]:+.1%})"
                   if r in growth else "n/a")
            lines.append(f"{r:<12}{load.kv_cache_usage:>10.3f}{load.num_running:>9}{load.num_waiting:>9}"
                         f"{load.num_in_flight:>11}{rss:>30}")
        return "\n".join(lines)


def soak(base_url: str, requests: int, concurrency: int, seed: int = 0, app: str = live_app.APP,
         max_rss_growth: float | None = MAX_RSS_GROWTH) -> SoakReport:
    """The whole soak against a live app: warm-up, memory, the rest, then the end state."""
    stop_text = httpx.post(base_url + "/detokenize", json={"tokens": [Spec.STOP_TOKEN]}, timeout=30).json()["prompt"]
    model = httpx.get(base_url + "/v1/models", timeout=30).json()["data"][0]["id"]
    specs = make_specs(requests, seed, stop_text, model)
    before = live_app.replicas(app)
    warmup = max(1, int(requests * WARMUP_FRACTION))
    outcomes = asyncio.run(run_all(base_url, specs[:warmup], concurrency))
    wait_idle(app)
    rss_warm = live_app.engine_rss(app)
    outcomes += asyncio.run(run_all(base_url, specs[warmup:], concurrency))
    loads = wait_idle(app)
    return SoakReport(outcomes, loads, rss_warm, live_app.engine_rss(app),
                      live_app.restarts(before, live_app.replicas(app)), max_rss_growth)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--port", type=int, default=8201)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    base_url = live_app.start(args.port, ENGINE)
    try:
        start = time.perf_counter()
        report = soak(base_url, args.requests, args.concurrency, args.seed)
        elapsed = time.perf_counter() - start
    finally:
        live_app.stop()
    print(report.table())
    print(f"\n{len(report.outcomes)} requests in {elapsed:.0f} s; replica restarts: {report.restarts or 'none'}")
    for problem in report.problems:
        print(f"FAIL {problem}")
    sys.exit(1 if report.problems else 0)


if __name__ == "__main__":
    main()
