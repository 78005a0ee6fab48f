"""Where the app's CPU goes outside the engine, process by process: Ray's daemons and Serve's actors beside
our ingress, replica and HAProxy, idle and under load, for Ray settings given side by side.

    python -m benchmarks.ray_background [--config configs/bench-56m.yaml] [--idle-s 20] [--requests 120]
                                        [--rate 4] [--variant NAME KEY=VALUE ...]

Each variant is `make run`'s environment (serve_app/serve_env.py) plus its variables; the first, "make run",
adds none. Per variant: `serve run` of --config, a warm-up, --idle-s seconds with no request (CPU in cores
per process kind), then --requests streamed requests at --rate per second (benchmarks/stream_client.py: CPU
ms per request per process kind, and the TTFT p50 / p99 and tokens per SSE event, so that a quieter
setting that slows the app shows). The CPU of a process that does a fixed amount of work per tick hardly
depends on what else runs, so these figures hold on a busy host better than throughput does.

A benchmark, never run in CI."""

from __future__ import annotations

import argparse
import asyncio
import time
from pathlib import Path

from benchmarks import serve_process
from benchmarks.stream_client import http_client, run_open_loop, send_openai, summarize, uniform_workload

ROOT = Path(__file__).resolve().parents[1]

# Ray's processes by command line (ours are serve_process.role's: haproxy, ingress, replica, engine core).
RAY_KINDS = (("IngressRouter", "ingress router"), ("ServeController", "serve controller"),
             ("ProxyActor", "proxy actor"), ("gcs_server", "gcs"), ("raylet", "raylet"),
             ("DashboardAgent", "dashboard agent"), ("dashboard/agent.py", "dashboard agent"),
             ("dashboard.py", "dashboard"), ("runtime_env/agent", "runtime env agent"), ("log_monitor", "log monitor"),
             ("monitor.py", "monitor"))


def ray_kind(p) -> str:
    line = " ".join(p.cmdline())
    return next((kind for key, kind in RAY_KINDS if key in line), "other ray")


def _diff(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: v - before.get(k, 0.0) for k, v in after.items()}


def measure(name: str, config: dict, env: dict[str, str], args) -> dict:
    model = config["applications"][0]["args"]["model"]
    with serve_process.serve_run(config, args.port, env=env) as app:
        send = lambda c, p, m: send_openai(c, app.url, model, p, m)  # noqa: E731

        async def warm_up():
            async with http_client(True) as client:
                await asyncio.gather(*(send(client, [1, 5, 6, 7], 8) for _ in range(4)))

        asyncio.run(warm_up())
        time.sleep(args.settle_s)  # the deploy's own churn (controller, health checks) dies down
        before = app.cpu_seconds(ray_kind)
        time.sleep(args.idle_s)
        idle = {k: v / args.idle_s for k, v in _diff(app.cpu_seconds(ray_kind), before).items()}

        requests = uniform_workload(args.requests, args.rate, args.seed)

        async def load():
            async with http_client(True) as client:
                return await run_open_loop(requests, lambda p, m: send(client, p, m))

        before = app.cpu_seconds(ray_kind)
        results, duration = asyncio.run(load())
        used = _diff(app.cpu_seconds(ray_kind), before)
    row = summarize(name, results, duration)
    row["idle_cores"] = idle
    row["ms_per_request"] = {k: v / len(requests) * 1e3 for k, v in used.items()}
    print(f"  {name}: idle {sum(v for k, v in idle.items() if k != 'engine core'):.3f} cores outside the engine; "
          f"{args.rate:g} req/s: TTFT p50/p99 {row['ttft_p50']:.0f}/{row['ttft_p99']:.0f} ms, "
          f"{row['tokens_per_event']:.2f} tokens/event", flush=True)
    return row


def report(rows: list[dict]) -> None:
    kinds = sorted({k for r in rows for k in (*r["idle_cores"], *r["ms_per_request"])},
                   key=lambda k: -max(r["ms_per_request"].get(k, 0.0) for r in rows))
    names = [r["system"] for r in rows]
    for title, key, fmt in (("idle: CPU in cores (per-mille of one core)", "idle_cores", lambda v: f"{v * 1e3:.1f}"),
                            ("under load: CPU ms per request", "ms_per_request", lambda v: f"{v:.1f}")):
        print(f"\n{title}\n")
        print("| process | " + " | ".join(names) + " |")
        print("|---|" + "---:|" * len(names))
        for kind in kinds:
            print(f"| {kind} | " + " | ".join(fmt(r[key].get(kind, 0.0)) for r in rows) + " |")
        outside = [sum(v for k, v in r[key].items() if k != "engine core") for r in rows]
        print("| **all but the engine core** | " + " | ".join(f"**{fmt(v)}**" for v in outside) + " |")
    print("\n| variant | TTFT p50 ms | TTFT p99 ms | tokens / SSE event | output tok/s |")
    print("|---|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['system']} | {r['ttft_p50']:.1f} | {r['ttft_p99']:.1f} | {r['tokens_per_event']:.2f} | "
              f"{r['throughput']:.0f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=str(ROOT / "configs" / "bench-56m.yaml"))
    ap.add_argument("--idle-s", type=float, default=20.0)
    ap.add_argument("--settle-s", type=float, default=10.0)
    ap.add_argument("--requests", type=int, default=120)
    ap.add_argument("--rate", type=float, default=4.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--port", type=int, default=8300)
    ap.add_argument("--variant", nargs="+", action="append", default=[], metavar="NAME KEY=VALUE",
                    help="a variant's name and its variables, beside `make run`'s environment")
    args = ap.parse_args()
    config = serve_process.load_config(args.config)
    variants = [("make run", {})] + [(v[0], dict(kv.split("=", 1) for kv in v[1:])) for v in args.variant]
    rows = [measure(name, config, env, args) for name, env in variants]
    report(rows)


if __name__ == "__main__":
    main()
