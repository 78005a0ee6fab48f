"""Overload: the Ray Serve app (2 engine replicas) offered 5x the load it can serve, with admission
control (a bounded waiting queue per engine, a bounded handle queue per ingress) against the same app
with both unbounded (Ray Serve's and vLLM's defaults).

    python benchmarks/overload.py [--factor 5] [--duration 30] [--model pagedserve-56m]

First the capacity: completed requests/s of a closed loop that keeps every replica's batch full. Then,
for each setting, Poisson arrivals at factor x capacity for --duration seconds of streamed completions
(random-token prompts, fixed output length). Prints per setting: requests admitted and refused
(429/503, and whether each carried Retry-After), how fast refusals come, the admitted requests' TTFT
p50/p99 and e2e p99, the replicas' peak resident memory, and whether any replica restarted."""

from __future__ import annotations

import argparse
import asyncio
import random
import threading
import time
from dataclasses import dataclass

import httpx
import numpy as np
import psutil

if __package__ in (None, ""):  # run as a script: make `benchmarks.*` importable
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import live_app

ENGINE = {"max_model_len": 1024, "num_kv_blocks": 1024, "max_num_seqs": 32, "num_threads": 1}
BOUNDED = {"engine": {**ENGINE, "max_waiting_requests": 32}, "max_queued_requests": 64}
UNBOUNDED = {"engine": ENGINE, "max_queued_requests": -1}
MAX_TOKENS = 64
APP = "overload"


@dataclass
class Outcome:
    status: int
    first_byte_s: float  # headers (a refusal) or the first token (an admitted stream)
    e2e_s: float
    retry_after: bool


async def send(client: httpx.AsyncClient, url: str, prompt: list[int]) -> Outcome:
    body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "ignore_eos": True, "stream": True}
    start = time.perf_counter()
    first = None
    try:
        async with client.stream("POST", url + "/v1/completions", json=body) as r:
            if r.status_code != 200:
                await r.aread()
                now = time.perf_counter() - start
                return Outcome(r.status_code, now, now, "retry-after" in r.headers)
            async for line in r.aiter_lines():
                if first is None and line.startswith("data: {"):
                    first = time.perf_counter() - start
    except httpx.HTTPError:
        now = time.perf_counter() - start
        return Outcome(0, now, now, False)
    return Outcome(200, first or 0.0, time.perf_counter() - start, False)


def prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[1] + [rng.randrange(3, 32000) for _ in range(rng.randrange(64, 256))] for _ in range(n)]


async def capacity(url: str, concurrency: int, n: int) -> float:
    """Completed requests/s with `concurrency` requests always in flight."""
    queue = prompts(n, seed=1)
    async with httpx.AsyncClient(timeout=300, limits=httpx.Limits(max_connections=concurrency)) as client:
        async def worker():
            while queue:
                await send(client, url, queue.pop())

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return n / (time.perf_counter() - start)


async def open_loop(url: str, rate: float, duration: float) -> list[Outcome]:
    rng = random.Random(2)
    arrivals, t = [], rng.expovariate(rate)
    while t < duration:
        arrivals.append(t)
        t += rng.expovariate(rate)
    batch = prompts(len(arrivals), seed=3)
    limits = httpx.Limits(max_connections=4000, max_keepalive_connections=4000)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        start = time.perf_counter()

        async def one(at: float, prompt: list[int]) -> Outcome:
            await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
            return await send(client, url, prompt)

        return await asyncio.gather(*(one(a, p) for a, p in zip(arrivals, batch)))


class ReplicaMemory:
    """Peak resident memory of the engine replicas (their actor processes and engine-loop children),
    sampled every half second."""

    def __init__(self) -> None:
        self.peak_mb = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.5):
            try:
                self.peak_mb = max(self.peak_mb, sum(live_app.engine_rss(APP).values()) / 2**20)
            except psutil.Error:  # a replica process went away between listing and reading it
                pass

    def stop(self) -> float:
        self._stop.set()
        self._thread.join()
        return self.peak_mb


def run_setting(args, name: str, app_args: dict, rate: float | None) -> tuple[dict, float]:
    import ray
    from ray import serve

    from serve_app.app import build_app
    from serve_app.app_args import AppArgs

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": args.port})
    serve.run(build_app(AppArgs(model=args.model, num_replicas=2, **app_args)), name=APP, route_prefix="/")
    url = f"http://127.0.0.1:{args.port}"
    try:
        asyncio.run(capacity(url, 4, 8))  # warm-up
        if rate is None:
            cap = asyncio.run(capacity(url, 2 * ENGINE["max_num_seqs"], 4 * ENGINE["max_num_seqs"]))
            rate = args.factor * cap
            print(f"capacity: {cap:.1f} requests/s; offering {rate:.1f} requests/s", flush=True)
        before = live_app.replicas(APP)
        memory = ReplicaMemory()
        start = time.perf_counter()
        outcomes = asyncio.run(open_loop(url, rate, args.duration))
        wall = time.perf_counter() - start
        peak = memory.stop()
        restarted = bool(live_app.restarts(before, live_app.replicas(APP)))
    finally:
        serve.shutdown()
        ray.shutdown()
    return summarize(name, outcomes, wall, peak, restarted), rate


def summarize(name: str, outcomes: list[Outcome], wall: float, peak_mb: float, restarted: bool) -> dict:
    ok = [o for o in outcomes if o.status == 200]
    refused = [o for o in outcomes if o.status in (429, 503)]

    def pct(values, q):
        return float(np.percentile(values, q)) * 1e3 if values else float("nan")

    return {
        "setting": name, "offered": len(outcomes), "admitted": len(ok), "refused": len(refused),
        "with_retry_after": sum(o.retry_after for o in refused),
        "other": len(outcomes) - len(ok) - len(refused),
        "refusal_p50": pct([o.first_byte_s for o in refused], 50),
        "refusal_p99": pct([o.first_byte_s for o in refused], 99),
        "ttft_p50": pct([o.first_byte_s for o in ok], 50), "ttft_p99": pct([o.first_byte_s for o in ok], 99),
        "e2e_p99": pct([o.e2e_s for o in ok], 99), "goodput": len(ok) / wall, "peak_mb": peak_mb,
        "restarted": restarted,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="pagedserve-56m")
    ap.add_argument("--factor", type=float, default=5.0, help="offered load / capacity")
    ap.add_argument("--duration", type=float, default=30.0, help="seconds of arrivals per setting")
    ap.add_argument("--port", type=int, default=8000)
    args = ap.parse_args()
    bounded, rate = run_setting(args, "admission control (ours)", BOUNDED, None)
    unbounded, _ = run_setting(args, "unbounded queues (Ray Serve / vLLM defaults)", UNBOUNDED, rate)
    print()
    print(f"{args.factor:g}x capacity: {rate:.1f} requests/s for {args.duration:g} s, {MAX_TOKENS} output tokens each, "
          f"model {args.model}, 2 replicas")
    print()
    print("| setting | offered | admitted | refused 429/503 | with Retry-After | other errors | refusal p50 / p99 ms "
          "| admitted TTFT p50 / p99 ms | admitted e2e p99 ms | goodput req/s | replicas' peak RSS MiB | restarts |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for r in (bounded, unbounded):
        print(f"| {r['setting']} | {r['offered']} | {r['admitted']} | {r['refused']} | {r['with_retry_after']} "
              f"| {r['other']} "
              f"| {r['refusal_p50']:.0f} / {r['refusal_p99']:.0f} | {r['ttft_p50']:.0f} / {r['ttft_p99']:.0f} "
              f"| {r['e2e_p99']:.0f} | {r['goodput']:.1f} | {r['peak_mb']:.0f} | {'yes' if r['restarted'] else 'no'} |")
    print()
    print(f"admitted TTFT p99, unbounded / ours: {unbounded['ttft_p99'] / bounded['ttft_p99']:.1f}x")


if __name__ == "__main__":
    main()
