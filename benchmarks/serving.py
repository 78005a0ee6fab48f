"""Online serving: the Ray Serve app (one engine replica, over HTTP with SSE; reached through Ray's proxy
actor, then through HAProxy with direct ingress) against the same engine in-process (AsyncLLM), on one
open-loop workload.

    python benchmarks/serving.py [--num-requests 200] [--rate 4] [--model pagedserve-56m]

Workload (fixed seed): Poisson arrivals at --rate requests/s; prompt and output lengths drawn from
lognormal fits shaped like ShareGPT conversations (long-tailed; medians ~120 prompt / ~100 output
tokens, scaled to this CPU), random token prompts, ignore_eos so every request produces its drawn length.
Metrics per system (benchmarks/stream_client.py, the client every serving benchmark shares): output
throughput, TTFT (arrival to first token), ITL (per token: the gap before a streamed event, shared by the
tokens it carries), TPOT ((e2e - TTFT) / (tokens - 1)), p50 and p99; then the Serve/in-process ratios."""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import subprocess
import sys
from pathlib import Path

import httpx
import numpy as np

if __package__ in (None, ""):  # run as a script: make `benchmarks.*` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.stream_client import Result, http_client, run_open_loop, send_openai, summarize
from engine import AsyncLLM, EngineConfig, SamplingParams
from serve_app.app_args import AppArgs

# Both systems: two torch threads (Ray would otherwise give a num_cpus=0 replica OMP_NUM_THREADS=1).
ENGINE = {"max_model_len": 2048, "kv_cache_memory_gb": 2.0, "max_num_seqs": 128, "num_threads": 2}


def workload(n: int, rate: float, seed: int) -> list[tuple[float, list[int], int]]:
    rng = random.Random(seed)
    nrng = np.random.default_rng(seed)
    prompt_lens = np.clip(nrng.lognormal(np.log(120), 0.8, n), 8, 1024).astype(int)
    output_lens = np.clip(nrng.lognormal(np.log(100), 0.7, n), 8, 512).astype(int)
    t, out = 0.0, []
    for p, o in zip(prompt_lens, output_lens):
        t += rng.expovariate(rate)
        out.append((t, [1] + [rng.randrange(3, 32000) for _ in range(int(p) - 1)], int(o)))
    return out


async def send_inprocess(llm: AsyncLLM, prompt, max_tokens) -> Result:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    result = Result()
    async for out in llm.generate(prompt, params):
        result.event(len(out.outputs[0].token_ids))
    return result.done()


async def bench_inprocess(args, requests) -> dict:
    llm = AsyncLLM(EngineConfig(model=args.model, **ENGINE))
    try:
        await send_inprocess(llm, requests[0][1], 8)  # warm-up
        results, duration = await run_open_loop(requests, lambda p, m: send_inprocess(llm, p, m))
    finally:
        llm.shutdown()
    return summarize("in-process AsyncLLM", results, duration)


def bench_serve(args, requests, tracing: dict | None = None, name: str = "Ray Serve app, 1 replica, HTTP",
                haproxy: bool = False) -> dict:
    import os

    import ray
    from ray import serve

    from serve_app.app import build_app
    from serve_app.serve_env import HAPROXY_INGRESS_ENV, SERVE_ENV

    saved_env = {k: os.environ.get(k) for k in SERVE_ENV}
    os.environ.update(SERVE_ENV if haproxy else {**SERVE_ENV, **{k: "0" for k in HAPROXY_INGRESS_ENV}})
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": args.port})
    app_args = AppArgs(model=args.model, num_replicas=1, engine=ENGINE,
                       tracing=tracing or {})
    serve.run(build_app(app_args), name="bench", route_prefix="/")
    url = f"http://127.0.0.1:{args.port}"

    async def go():
        async with http_client() as client:
            await send_openai(client, url, args.model, requests[0][1], 8)  # warm-up
            return await run_open_loop(requests, lambda p, m: send_openai(client, url, args.model, p, m))

    try:
        cpu_before = serving_cpu_seconds()
        results, duration = asyncio.run(go())
        cpu_after = serving_cpu_seconds()
    finally:
        serve.shutdown()
        ray.shutdown()
        for k, v in saved_env.items():
            if v is None:
                del os.environ[k]
            else:
                os.environ[k] = v
    cpu = {role: (cpu_after[role] - cpu_before.get(role, 0.0)) / len(results) * 1e3 for role in cpu_after}
    return {**summarize(name, results, duration), "cpu_ms_per_request": sum(cpu.values()), "cpu_ms_by_role": cpu}


_ROLES = {"ProxyActor": "proxy", "haproxy": "proxy", "OpenAIIngress": "ingress", "LLMServer": "replica"}


def serving_cpu_seconds() -> dict[str, float]:
    """CPU time used so far by the app's processes, by role: the HTTP proxy, the ingress, the engine
    replica's actor and its engine-core process. On a saturated machine throughput is noisy; the CPU
    each request costs is the steadier measure, and the roles say where a difference lands."""
    import psutil

    total: dict[str, float] = {}
    for p in psutil.process_iter(["cmdline"]):
        cmdline = " ".join(p.info["cmdline"] or ())
        role = next((r for key, r in _ROLES.items() if key in cmdline), None)
        if role is None or ("ServeReplica:bench" not in cmdline and role != "proxy"):
            continue
        try:
            for q in [p, *p.children(recursive=True)]:
                t = q.cpu_times()
                key = role if q is p else "engine core"
                total[key] = total.get(key, 0.0) + t.user + t.system
        except psutil.Error:
            pass
    return total


def compare_tracing(args, requests) -> None:
    """Off and on alternate, `--rounds` times each, in ABBA order (off-on, on-off, ...), so that drift in
    the machine's load, and whatever a run leaves behind for the next, hits both alike. The receiver is
    a process of its own, as a collector would be."""
    receiver = subprocess.Popen([sys.executable, "-m", "benchmarks.otlp_receiver"], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True, cwd=Path(__file__).resolve().parents[1])
    endpoint = receiver.stdout.readline().strip()
    otlp = {"exporter": "otlp", "protocol": "http/protobuf", "endpoint": endpoint}
    off, on = [], []
    try:
        for i in range(args.rounds):
            runs = [(off, f"tracing off, round {i + 1}", None),
                    (on, f"tracing on (OTLP/HTTP to a local receiver), round {i + 1}", otlp)]
            for results, name, tracing in runs[:: 1 if i % 2 == 0 else -1]:
                results.append(bench_serve(args, requests, name=name, tracing=tracing))
        num_spans = int(httpx.get(endpoint).text)
    finally:
        receiver.stdin.close()
        receiver.wait(timeout=10)
    roles = sorted({role for r in off + on for role in r["cpu_ms_by_role"]})
    print()
    print("| Serve app | output tok/s | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | TPOT mean ms | app CPU ms / request |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in (r for pair in zip(off, on) for r in pair):
        print(f"| {r['system']} | {r['throughput']:.0f} | {r['ttft_p50']:.1f} | {r['ttft_p99']:.1f} | "
              f"{r['itl_p50']:.1f} | {r['tpot_mean']:.1f} | {r['cpu_ms_per_request']:.0f} |")
    print()
    print(f"spans received: {num_spans} ({len(on)} x {len(requests) + 1} traced requests)")
    rounds = ", ".join(f"{b['throughput'] / a['throughput']:.3f}" for a, b in zip(off, on))
    total = sum(r["tokens"] for r in on) / sum(r["duration"] for r in on)
    total /= sum(r["tokens"] for r in off) / sum(r["duration"] for r in off)
    print(f"output throughput, tracing on / off: {total:.3f} over all rounds (per round: {rounds}; target >= 0.97)")
    cpu_on, cpu_off = (statistics.fmean(r["cpu_ms_per_request"] for r in rs) for rs in (on, off))
    print(f"app CPU per request, tracing on / off: {cpu_on:.1f} / {cpu_off:.1f} ms ({cpu_on / cpu_off:.3f})")
    for role in roles:
        role_on, role_off = (statistics.fmean(r["cpu_ms_by_role"].get(role, 0.0) for r in rs) for rs in (on, off))
        print(f"  {role}: {role_on:.1f} / {role_off:.1f} ms ({role_on - role_off:+.1f})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="pagedserve-56m")
    ap.add_argument("--num-requests", type=int, default=200)
    ap.add_argument("--rate", type=float, default=4.0, help="Poisson arrival rate, requests/s")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--rounds", type=int, default=2, help="--compare-tracing: off/on pairs to run")
    ap.add_argument("--compare-tracing", action="store_true",
                    help="instead: the Serve app with tracing off, then exporting OTLP/HTTP to a local receiver")
    args = ap.parse_args()
    requests = workload(args.num_requests, args.rate, args.seed)
    print(f"{len(requests)} requests at {args.rate}/s, {sum(len(p) for _, p, _ in requests)} prompt tokens, "
          f"{sum(m for *_, m in requests)} output tokens, model {args.model}", flush=True)
    if args.compare_tracing:
        compare_tracing(args, requests)
        return
    local = asyncio.run(bench_inprocess(args, requests))
    print(f"  in-process done: {local['throughput']:.0f} tok/s", flush=True)
    served = [bench_serve(args, requests, name="Ray Serve app, 1 replica, HTTP via Ray's proxy actor"),
              bench_serve(args, requests, name="Ray Serve app, 1 replica, HTTP via HAProxy (direct ingress)",
                          haproxy=True)]
    rows = [*served, local]
    print()
    print("| system | output tok/s | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms | TPOT mean ms | "
          "events/request |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['system']} | {r['throughput']:.0f} | {r['ttft_p50']:.1f} | {r['ttft_p99']:.1f} | "
              f"{r['itl_p50']:.1f} | {r['itl_p99']:.1f} | {r['tpot_mean']:.1f} | {r['events_per_request']:.1f} |")
    print()
    for r in served:
        print(f"{r['system']}: output throughput / in-process {r['throughput'] / local['throughput']:.3f} "
              f"(target >= 0.90); TTFT p50 added {r['ttft_p50'] - local['ttft_p50']:+.1f} ms (target <= +10 ms; "
              f"Ray Serve LLM users report ~+50 ms); app CPU {r['cpu_ms_per_request']:.0f} ms / request")


if __name__ == "__main__":
    main()
