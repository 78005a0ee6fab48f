"""Soak: thousands of mixed requests against two engine replicas, then every replica must be idle with
its KV pool free, and its memory no larger than after warm-up.

    python benchmarks/soak.py [--requests 2000] [--concurrency 16] [--port 8201] [--seed 0]

Starts Ray and the app (built-in pagedserve-tiny, two engine replicas), then sends a seeded mix over
/v1/completions, /v1/chat/completions and /v1/messages: streamed and not, n of 1 to 3, prompts sharing a
few long prefixes, outputs ending by length (ignore_eos), by a stop token or by a stop string (forced
with logit_bias after min_tokens, so their token counts are exact), JSON-schema structured outputs;
10% of the clients disconnect mid-stream and 5% are cancelled while they wait. Every request must
complete with its exact token count and finish reason, or get a clear error (429/503 with the error
object). The resident memory of every replica process (the ingress, each engine replica and its
engine-core child; Ray's HTTP proxy too) is sampled every 1,000 requests while the run goes on, at the
same concurrency throughout. The first quarter is warm-up: after it each process may grow by at most
10%, and over the last 10,000 requests (the last half of a shorter run) the least-squares slope of its
memory must stay below 0.5% of its warm-up value per 1,000 requests. Prints requests by kind
(completed, errors, disconnected, cancelled, failed), errors by type, each replica's final KV usage and
running/waiting counts, the memory series (MiB) with growth and slope per process, and every failure;
exits 1 if an invariant fails.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from collections import Counter
from collections.abc import Callable

import httpx

if __package__ in (None, ""):  # run as a script: make `benchmarks.*` importable
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import live_app
from benchmarks.soak_requests import Outcome, Spec, make_specs, run_spec

MAX_RSS_GROWTH = 0.10
MAX_RSS_SLOPE = 0.005  # of the warm-up value, per 1,000 requests
SAMPLE_EVERY = 1000
SLOPE_WINDOW = 10_000  # the slope is fitted over the last this many requests (the last half of shorter runs)
# The engine process's resident memory climbs for its first ~2,000 requests and then levels off (native
# memory: the Python heap stays flat), so warm-up is a quarter of the run, not a token few requests.
WARMUP_FRACTION = 0.25
ENGINE = {"max_model_len": 512, "num_kv_blocks": 1024, "num_threads": 1}


async def run_all(base_url: str, specs: list[Spec], concurrency: int,
                  on_done: Callable[[int], None] = lambda done: None) -> list[Outcome]:
    """Every spec, `concurrency` at a time; `on_done(number finished so far)` after each."""
    limits = httpx.Limits(max_connections=concurrency * 2, max_keepalive_connections=concurrency)
    semaphore = asyncio.Semaphore(concurrency)
    done = 0
    async with httpx.AsyncClient(base_url=base_url, limits=limits, timeout=300) as client:

        async def one(spec: Spec) -> Outcome:
            nonlocal done
            async with semaphore:
                outcome = await run_spec(client, spec)
            done += 1
            on_done(done)
            return outcome

        return await asyncio.gather(*(one(spec) for spec in specs))


class RssSeries:
    """Resident memory per process, sampled at request counts (`at`): bytes by process name."""

    def __init__(self, processes: list[live_app.ServeProcess], at: list[int], warmup: int) -> None:
        self.processes, self.at, self.warmup = processes, sorted(set(at)), warmup
        self.samples: dict[int, dict[str, int]] = {}

    def on_done(self, done: int) -> None:
        if done in self.at:  # psutil reads /proc: ~1 ms for all processes, on the client's loop
            self.samples[done] = live_app.process_rss(self.processes)

    @property
    def names(self) -> list[str]:
        return [p.name for p in self.processes]

    def growth(self) -> dict[str, float]:
        """Each process's memory at the end over its memory at the end of warm-up."""
        warm, end = self.samples.get(self.warmup, {}), self.samples.get(max(self.samples, default=0), {})
        return {n: end[n] / warm[n] - 1 for n in self.names if n in warm and n in end}

    def slope(self) -> dict[str, float]:
        """Least-squares slope of each process's memory over the last SLOPE_WINDOW requests (the last half
        of a shorter run), as a fraction of its warm-up value per 1,000 requests."""
        end = max(self.samples, default=0)
        start = max(self.warmup, end - SLOPE_WINDOW, end // 2)
        slopes = {}
        for n in self.names:
            points = [(k / 1000, v[n]) for k, v in sorted(self.samples.items()) if k >= start and n in v]
            warm = self.samples.get(self.warmup, {}).get(n)
            if len(points) >= 3 and warm:
                mx = sum(x for x, _ in points) / len(points)
                my = sum(y for _, y in points) / len(points)
                slope = sum((x - mx) * (y - my) for x, y in points) / sum((x - mx) ** 2 for x, _ in points)
                slopes[n] = slope / warm
        return slopes

    def table(self) -> str:
        names = self.names
        width = max(14, *(len(n) + 2 for n in names))
        lines = [f"{'requests':>9}" + "".join(f"{n:>{width}}" for n in names)]
        for k, v in sorted(self.samples.items()):
            mark = "*" if k == self.warmup else " "
            lines.append(f"{k:>8}{mark}" + "".join(f"{v[n] / 2**20:>{width}.1f}" if n in v else f"{'-':>{width}}"
                                                  for n in names))
        growth, slope = self.growth(), self.slope()
        lines.append(f"{'growth':>9}" + "".join(f"{growth[n]:>+{width}.1%}" if n in growth else f"{'n/a':>{width}}"
                                                for n in names))
        lines.append(f"{'slope':>9}" + "".join(f"{slope[n] * 100:>+{width - 1}.2f}%" if n in slope
                                               else f"{'n/a':>{width}}" for n in names))
        lines.append(f"(MiB; * = end of warm-up; growth = end over warm-up; slope = least squares over the last "
                     f"{SLOPE_WINDOW:,} requests or the last half, % of warm-up per 1,000 requests)")
        return "\n".join(lines)


def wait_idle(app: str, timeout_s: float = 60.0) -> list[live_app.EngineLoad]:
    deadline = time.monotonic() + timeout_s
    while True:
        loads = live_app.engine_loads(app)
        if all(load.idle for load in loads) or time.monotonic() > deadline:
            return loads
        time.sleep(0.5)


class SoakReport:
    def __init__(self, outcomes: list[Outcome], loads: list[live_app.EngineLoad], rss: RssSeries,
                 restarts: list[str], max_rss_growth: float | None, max_rss_slope: float | None) -> None:
        self.outcomes, self.loads, self.restarts = outcomes, loads, restarts
        self.rss, self.max_rss_growth, self.max_rss_slope = rss, max_rss_growth, max_rss_slope

    @property
    def failures(self) -> list[Outcome]:
        return [o for o in self.outcomes if o.result == "failed"]

    @property
    def problems(self) -> list[str]:
        problems = [f"{o.spec.label}: {o.detail}" for o in self.failures]
        problems += [f"replica {load.replica_id} not idle: {load}" for load in self.loads if not load.idle]
        problems += self.restarts
        if self.max_rss_growth is not None:
            problems += [f"{n} memory grew {g:+.1%} after warm-up (at most {self.max_rss_growth:.0%})"
                         for n, g in self.rss.growth().items() if g > self.max_rss_growth]
        if self.max_rss_slope is not None:
            problems += [f"{n} memory still grows {g:+.2%} of its warm-up value per 1,000 requests (below "
                         f"{self.max_rss_slope:.1%})" for n, g in self.rss.slope().items() if g >= self.max_rss_slope]
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
        lines.append(f"\n{'replica':<12}{'KV usage':>10}{'running':>9}{'waiting':>9}{'in flight':>11}")
        for load in self.loads:
            lines.append(f"{load.replica_id:<12}{load.kv_cache_usage:>10.3f}{load.num_running:>9}"
                         f"{load.num_waiting:>9}{load.num_in_flight:>11}")
        lines.append("\nresident memory\n" + self.rss.table())
        return "\n".join(lines)


def soak(base_url: str, requests: int, concurrency: int, seed: int = 0, app: str = live_app.APP,
         max_rss_growth: float | None = MAX_RSS_GROWTH, max_rss_slope: float | None = MAX_RSS_SLOPE,
         sample_every: int = SAMPLE_EVERY) -> SoakReport:
    """The whole soak against a live app, memory sampled as it goes (every `sample_every` requests
    finished, and at the end of warm-up), then the end state once every replica is idle."""
    stop_text = httpx.post(base_url + "/detokenize", json={"tokens": [Spec.STOP_TOKEN]}, timeout=30).json()["prompt"]
    model = httpx.get(base_url + "/v1/models", timeout=30).json()["data"][0]["id"]
    specs = make_specs(requests, seed, stop_text, model)
    before = live_app.replicas(app)
    warmup = max(1, int(requests * WARMUP_FRACTION))
    rss = RssSeries(live_app.serve_processes(app), [*range(sample_every, requests + 1, sample_every), warmup], warmup)
    outcomes = asyncio.run(run_all(base_url, specs, concurrency, rss.on_done))
    loads = wait_idle(app)
    rss.samples[requests] = live_app.process_rss(rss.processes)  # idle: nothing in flight any more
    return SoakReport(outcomes, loads, rss, live_app.restarts(before, live_app.replicas(app)), max_rss_growth,
                      max_rss_slope)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--port", type=int, default=8201)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sample-every", type=int, default=SAMPLE_EVERY, help="requests between memory samples")
    args = parser.parse_args()
    load_before = os.getloadavg()
    base_url = live_app.start(args.port, ENGINE)
    try:
        start = time.perf_counter()
        report = soak(base_url, args.requests, args.concurrency, args.seed, sample_every=args.sample_every)
        elapsed = time.perf_counter() - start
    finally:
        live_app.stop()
    print(report.table())
    print(f"\n{len(report.outcomes)} requests in {elapsed:.0f} s; replica restarts: {report.restarts or 'none'}; "
          f"load average (1, 5, 15 min) before {' '.join(f'{x:.2f}' for x in load_before)}, "
          f"after {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    for problem in report.problems:
        print(f"FAIL {problem}")
    sys.exit(1 if report.problems else 0)


if __name__ == "__main__":
    main()
