"""Auto-tuning the app for the machine it runs on, under a latency SLO.

    python benchmarks/auto_tune.py --ttft-p99-ms 400 --itl-p99-ms 150 [--config configs/bench-56m.yaml]
                                   [--rates 2 4 6 8] [--duration 20] [--out tuned-args.yaml]

Each candidate is the --config app with some args changed, served as `make run` serves it (`serve run`,
HAProxy; benchmarks/serve_process.py) and driven by the open-loop client every serving benchmark shares
(benchmarks/stream_client.py; prompts of 32-256 random tokens, 16-128 output tokens). Its score is the
highest request rate of --rates, tried upwards until one misses, at which TTFT p99 and ITL p99 (per token)
both meet the SLO; ties go to the higher output tokens/s there. A candidate meeting the SLO at no rate
scores 0.

The search is coordinate descent: dimensions in turn, each trying its values with the best of the
earlier ones fixed:
0. ingress: the engine replicas serve HTTP themselves or behind an ingress deployment (`direct_streaming`);
1. layout: engine replicas on this host x torch threads each (`num_replicas`, `engine.num_threads`), the
   combinations that fit its cores, each with its choices of `engine.small_step_threads`;
2. `engine.max_num_seqs`;  3. `engine.max_num_batched_tokens`;
4. the app's stream settings (`stream_*` fields of AppArgs: when streams coalesce tokens).
Prints every trial as it ends, then the table, and writes the best candidate's `args:` section (engine
and app fields) to --out, ready to paste into a config file."""

from __future__ import annotations

import argparse
import asyncio
import copy
import os
import sys
import time
from pathlib import Path

import yaml

if __package__ in (None, ""):  # run as a script: make `benchmarks.*` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import serve_process
from benchmarks.stream_client import http_client, run_open_loop, send_openai, summarize, uniform_workload

ROOT = Path(__file__).resolve().parents[1]


def layouts(cores: int) -> list[dict]:
    """Replicas x threads that fit `cores` (more would oversubscribe: OpenMP threads spin on each other),
    and with several threads, each smaller thread count for small steps (`engine.small_step_threads`)."""
    return [{"num_replicas": r, "engine": {"num_threads": t, "small_step_threads": small}}
            for r in range(1, cores + 1) for t in range(1, cores + 1) if r * t <= cores
            for small in [None, *range(1, t)]]


def dimensions(cores: int) -> list[tuple[str, list[dict]]]:
    return [
        ("ingress", [{"direct_streaming": d} for d in (True, False)]),
        ("layout", layouts(cores)),
        ("max_num_seqs", [{"engine": {"max_num_seqs": n}} for n in (32, 64, 128)]),
        ("max_num_batched_tokens", [{"engine": {"max_num_batched_tokens": n}} for n in (512, 1024, 2048)]),
        ("stream", STREAM_SETTINGS),
    ]


# The app's stream settings worth trying (AppArgs' stream_* fields; serve_app/llm_server.py says what each does).
STREAM_SETTINGS = [{"stream_coalesce_cpu_utilization": u, "stream_coalesce_interval_s": s}
                   for u, s in ((0.95, 0.25), (0.95, 0.1), (0.9, 0.25), (None, 0.25))]


def merge(args: dict, change: dict) -> dict:
    out = copy.deepcopy(args)
    for k, v in change.items():
        out[k] = {**out.get(k, {}), **v} if isinstance(v, dict) else v
    return out


def describe(change: dict) -> str:
    flat = {**{k: v for k, v in change.items() if k != "engine"}, **change.get("engine", {})}
    return ", ".join(f"{k}={v}" for k, v in flat.items())


def trial(config: dict, args: dict, rates: list[float], duration: float, port: int, slo: tuple[float, float],
          seed: int) -> dict:
    """Serve `args` and climb the rates until the SLO breaks; returns the trial's row."""
    ttft_slo, itl_slo = slo
    model = args["model"]
    runs = []
    if args.get("num_replicas", 1) > 1 and not args.get("direct_streaming"):
        args["router"] = "prefix"  # the product's router once there is a choice to make (HAProxy's if direct)
    app_config = copy.deepcopy(config)
    app_config["applications"][0]["args"] = args
    with serve_process.serve_run(app_config, port) as app:
        for rate in rates:
            requests = uniform_workload(max(30, int(rate * duration)), rate, seed)

            async def go(requests):
                async with http_client() as client:
                    await asyncio.gather(*(send_openai(client, app.url, model, p, 8) for _, p, _ in requests[:4]))
                    return await run_open_loop(requests, lambda p, m: send_openai(client, app.url, model, p, m))

            results, wall = asyncio.run(go(requests))
            s = summarize(f"{rate:g}/s", results, wall)
            s["rate"], s["ok"] = rate, s["ttft_p99"] <= ttft_slo and s["itl_p99"] <= itl_slo
            runs.append(s)
            if not s["ok"]:
                break
    passing = [r for r in runs if r["ok"]]
    best = passing[-1] if passing else None
    return {"runs": runs, "rate": best["rate"] if best else 0.0, "throughput": best["throughput"] if best else 0.0,
            "best": best, "last": runs[-1]}


def score(row: dict) -> tuple[float, float]:
    return row["rate"], row["throughput"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ttft-p99-ms", type=float, required=True, help="SLO: TTFT p99")
    ap.add_argument("--itl-p99-ms", type=float, required=True, help="SLO: inter-token latency p99, per token")
    ap.add_argument("--config", default=str(ROOT / "configs" / "bench-56m.yaml"))
    ap.add_argument("--rates", type=float, nargs="+", default=[2, 4, 6, 8], help="request rates to climb, per second")
    ap.add_argument("--duration", type=float, default=20, help="seconds of arrivals per rate")
    ap.add_argument("--cores", type=int, default=len(os.sched_getaffinity(0)), help="cores for engine replicas")
    ap.add_argument("--port", type=int, default=8570)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, help="write the best args: section here")
    ap.add_argument("--only", nargs="+", choices=[name for name, _ in dimensions(1)],
                    help="search these dimensions only (the others keep --config's values)")
    opts = ap.parse_args()

    config = serve_process.load_config(opts.config)
    best_args = copy.deepcopy(config["applications"][0]["args"])
    slo = (opts.ttft_p99_ms, opts.itl_p99_ms)
    print(f"SLO: TTFT p99 <= {slo[0]:g} ms, ITL p99 <= {slo[1]:g} ms; rates {opts.rates} req/s, {opts.duration:g} s "
          f"each; {opts.cores} cores; base {Path(opts.config).name}", flush=True)
    rows: list[dict] = []
    started = time.monotonic()
    try:
        for name, values in dimensions(opts.cores):
            if opts.only and name not in opts.only:
                continue
            results = []
            for change in values:
                args = merge(best_args, change)
                row = {"dimension": name, "change": describe(change), "args": args,
                       **trial(config, args, opts.rates, opts.duration, opts.port, slo, opts.seed)}
                rows.append(row)
                results.append(row)
                last = row["last"]
                print(f"  [{name}] {row['change']}: max rate {row['rate']:g}/s ({row['throughput']:.0f} tok/s); at "
                      f"{last['rate']:g}/s TTFT p99 {last['ttft_p99']:.0f} ms, ITL p99 {last['itl_p99']:.0f} ms",
                      flush=True)
            best_args = max(results, key=score)["args"]
    except KeyboardInterrupt:  # a long sweep stopped early still reports what it measured
        print(f"\nstopped after {len(rows)} trials", flush=True)
        if not rows:
            return
    best = max(rows, key=score)

    print()
    print("| dimension | setting | max rate within SLO (req/s) | output tok/s there | TTFT p99 ms there | "
          "ITL p99 ms there | tokens / SSE event there |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for r in rows:
        b = r["best"]
        cells = (f"{b['throughput']:.0f} | {b['ttft_p99']:.0f} | {b['itl_p99']:.0f} | {b['tokens_per_event']:.2f}"
                 if b else "- | - | - | -")
        mark = " **best**" if r is best else ""
        print(f"| {r['dimension']} | {r['change']}{mark} | {r['rate']:g} | {cells} |")
    print(f"\n{len(rows)} trials in {(time.monotonic() - started) / 60:.1f} min")
    section = yaml.safe_dump({"args": best["args"]}, sort_keys=False)
    print(f"\nbest ({best['rate']:g} req/s within the SLO, {best['throughput']:.0f} output tok/s):\n\n{section}")
    if opts.out:
        opts.out.write_text(f"# benchmarks/auto_tune.py --ttft-p99-ms {slo[0]:g} --itl-p99-ms {slo[1]:g}: "
                            f"{best['rate']:g} req/s within the SLO on this machine\n{section}")
        print(f"written to {opts.out}")


if __name__ == "__main__":
    main()
