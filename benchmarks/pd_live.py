"""Disaggregated prefill/decode on the live app (issue 15): 2 colocated engine replicas against 1 prefill +
1 decode replica of the built-in model, the same requests to both: short chat requests streaming while
1,500-token prompts arrive. Does moving the long prefills off the replica that streams protect the streams'
inter-token latency? Target: ITL p99 of the short streams under P/D <= 0.5x colocated.

    python benchmarks/pd_live.py [--duration 240] [--rounds 1] [--seed 0] [--model pagedserve-56m]
    python benchmarks/pd_live.py --smoke          # ~30 s of load per arm: checks that it runs, measures nothing

Each arm is the app as `make run` serves it (benchmarks/serve_process.py: `serve run` in its own process,
HTTP through HAProxy), loaded open loop by benchmarks/stream_client.py; `--rounds N` alternates the arms N
times (a fresh app each time) and pools each arm's requests.

- Model: pagedserve-56m. A 256-token chunk there costs ~10x a decode step of 8 requests (one thread: ~250 vs
  ~30 ms measured on a loaded machine; step_cost.json's fit, quiet: ~100-120 vs ~14 ms), so a 1,500-token
  prompt stretches six steps of every stream on its replica to prefill steps. On pagedserve-tiny the same
  chunk costs 15-30 ms against a 5 ms decode step: a stall of a few tens of ms, lost in the HTTP path's own
  per-token noise.
- Load: 2 short requests/s (prompts 32-64 tokens, answers 64-128) and 0.5 long ones/s (1,500-token prompts,
  16-token answers), Poisson, seeded. ITL p99 is over every short-stream token gap, so a long prefill shows
  in it only when the gaps it stretches exceed 1% of them: at 0.25 long prompts/s the simulator puts the
  colocated p99 at ~21 ms (the stalls fall under the 99th percentile), at 0.5/s at ~143 ms.
- Engines: one torch thread each (2 replicas on 2 cores), chunked prefill at 256 tokens in every replica
  (the prefill replica too: as in the issue; it has no streams to protect, a larger budget would only
  shorten the long prompts' TTFT a little), 2,048 KV blocks each.
- Colocated: `router: prefix` (the app's default; these prompts share nothing, so it routes by load and KV
  usage). P/D: the prefill pool is routed by the same prefix router (P/D requires it), the decode pool by
  load; min_uncached_prompt_tokens 512 sends every 1,500-token prompt to the prefill replica and keeps every
  chat prompt on the decode replica.
- Streams are never coalesced on CPU load (stream_coalesce_cpu_utilization: None) in either arm: on this
  shared machine the load comes and goes with other people's work, and resting streams would blur the
  very gaps measured here. Every engine step's token leaves at once.
- Transfers: the decode replica's own counters (LLMServer.pd_stats: bytes and seconds from the fetch to the
  KV staged on the decode side), read through a DeploymentHandle from a driver that joins the app's Ray
  cluster (its GCS port fixed through RAY_GCS_SERVER_PORT, token auth off: RAY_AUTH_MODE=disabled, in both
  arms), as differences around the measured window (the warm-up's transfers left out).

Simulator check: the same requests (the workload is benchmarks/cluster_sim's chat_and_long, seeded) on the
cluster simulator (cluster_sim/pd.py) with the CPU step model fitted to this engine (step_cost.json:
pagedserve-56m, one thread) and the same replicas, chunk and threshold; the KV "link" is taken as 10 Gbit/s
plus 5 ms per transfer, as simulate_pd.py assumes for the object store on one host. Printed next to the
measurement, with measured/predicted. The simulator gives every replica a core of its own and charges
nothing for HTTP, the ingress, the replica actors or Ray: on 2 shared cores expect measured > predicted."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.cluster_sim.fit import load_cost_model
from benchmarks.cluster_sim.pd import PDConfig, simulate_pd, summarize_pd
from benchmarks.cluster_sim.replica import ReplicaConfig
from benchmarks.cluster_sim.workloads import (
    ChatAndLongShape,
    SimRequest,
    Workload,
    chat_and_long,
)
from benchmarks.serve_process import serve_run
from benchmarks.stream_client import (
    HTTPError,
    Result,
    http_client,
    run_open_loop,
    send_openai,
    summarize,
)
from engine.models.builtin import BUILTIN_MODELS
from serve_app.disaggregation.policy import KVLink, kv_bytes_per_token

APP = "pagedserve"
SHAPE = ChatAndLongShape(chat_prompt=(32, 64), chat_output=(64, 128), long_prompt=1500, long_output=16)
CHUNK = 256
NUM_KV_BLOCKS = 2048
MIN_UNCACHED_PROMPT_TOKENS = 512
FITTED_MODEL = "pagedserve-56m"  # what step_cost.json was fitted to
SIM_LINK = KVLink(10.0, 0.005)  # simulate_pd.py's assumption for Ray's object store on one host
ARMS = ("colocated", "P/D")


def app_config(model: str, arm: str, pd_args: dict | None = None) -> dict:
    engine = {"max_model_len": 2048, "num_kv_blocks": NUM_KV_BLOCKS, "num_threads": 1, "enable_chunked_prefill": True,
              "max_num_batched_tokens": CHUNK}
    args = {"model": model, "router": "prefix", "engine": engine, "stream_coalesce_cpu_utilization": None}
    if arm == "colocated":
        args["num_replicas"] = 2
        engines = ["LLMServer"]
    else:
        args["disaggregation"] = {"min_uncached_prompt_tokens": MIN_UNCACHED_PROMPT_TOKENS,
                                  "prefill": {"num_replicas": 1}, "decode": {"num_replicas": 1}, **(pd_args or {})}
        engines = ["PrefillServer", "DecodeServer"]
    return {"proxy_location": "HeadOnly",
            "applications": [{"name": APP, "route_prefix": "/", "import_path": "serve_app.app:build_app", "args": args,
                              "deployments": [{"name": d, "ray_actor_options": {"num_cpus": 0}}
                                              for d in (*engines, "OpenAIIngress")]}]}


# --- the live arms ----------------------------------------------------------------------------------------

@dataclass
class ArmRun:
    short: list[Result]
    long: list[Result]
    duration: float
    failed: list[str]  # the errors of requests that got no answer
    pd: dict[str, float]  # pd_stats over the measured window (P/D only)


def pd_stats(gcs_port: int) -> dict[str, float]:
    """The decode pool's disaggregation counters, summed over its replicas."""
    import ray
    from ray import serve
    from ray.serve.exceptions import DeploymentUnavailableError

    os.environ["RAY_AUTH_MODE"] = "disabled"  # as the app's Ray runs (run_arm)
    ray.init(address=f"127.0.0.1:{gcs_port}", log_to_driver=False, configure_logging=False)
    try:
        handle = serve.get_deployment_handle("DecodeServer", app_name=APP)
        deadline = time.monotonic() + 60
        while True:  # a new driver's handle learns the replicas from the controller a moment later
            try:
                replies = handle.broadcast("pd_stats").results()
                break
            except DeploymentUnavailableError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)
        totals: dict[str, float] = {}
        for stats in replies:
            for key, value in stats.items():
                totals[key] = totals.get(key, 0) + value
        return totals
    finally:
        ray.shutdown()


async def warm_up(url: str, model: str, timeout_s: float = 600) -> None:
    """Until the app answers completions: /health turns 200 before HAProxy's routes are all in place (a 404
    for a moment) and before the engine replicas have started. Also moves lazy initialisation (and P/D's
    first transfer) out of the measured window; in pairs, so that the router spreads them over both
    colocated replicas."""
    deadline = time.monotonic() + timeout_s
    async with http_client() as client:
        for prompt_len, max_tokens in ((48, 4), (SHAPE.long_prompt, 2)):
            while True:
                try:
                    await asyncio.gather(*(send_openai(client, url, model, [5 + i] * prompt_len, max_tokens)
                                           for i in (0, 1)))
                    break
                except HTTPError:
                    if time.monotonic() > deadline:
                        raise
                    await asyncio.sleep(1.0)


async def load(url: str, model: str, workload: list[SimRequest]) -> tuple[list[Result | None], float, list[str]]:
    failed: list[str] = []
    async with http_client() as client:

        async def send(prompt: list[int], max_tokens: int) -> Result | None:
            try:
                return await send_openai(client, url, model, prompt, max_tokens)
            except HTTPError as e:
                failed.append(f"{type(e).__name__}: {e}")
                return None

        requests = [(r.arrival, r.prompt, len(r.output)) for r in workload]
        results, duration = await run_open_loop(requests, send)
    return results, duration, failed


def run_arm(arm: str, model: str, workload: list[SimRequest], port: int, log: Path | None,
            pd_args: dict | None = None) -> ArmRun:
    gcs_port = port + 3000
    # The app's Ray is ours alone and lives for one arm: its GCS at a port we know, and without token auth
    # (a new local Ray turns it on by default) so that pd_stats' driver joins it as is, token-less.
    env = {"RAY_GCS_SERVER_PORT": str(gcs_port), "RAY_AUTH_MODE": "disabled"}
    with serve_run(app_config(model, arm, pd_args), port, log=log, env=env) as app:
        asyncio.run(warm_up(app.url, model))
        before = pd_stats(gcs_port) if arm == "P/D" else {}
        results, duration, failed = asyncio.run(load(app.url, model, workload))
        after = pd_stats(gcs_port) if arm == "P/D" else {}
    groups: dict[str, list[Result]] = {"chat": [], "long": []}
    for sim, result in zip(workload, results):
        if result is not None:
            groups[sim.group].append(result)
    return ArmRun(groups["chat"], groups["long"], duration, failed,
                  {k: v - before.get(k, 0) for k, v in after.items()})


# --- the simulator's prediction ---------------------------------------------------------------------------

def simulated(model: str, workload: Workload, duration: float) -> dict[str, dict[str, float]]:
    spec = BUILTIN_MODELS[model]
    kv_per_token = kv_bytes_per_token(spec["num_hidden_layers"], spec["num_key_value_heads"], spec["head_dim"], 4)
    replica = ReplicaConfig(num_kv_blocks=NUM_KV_BLOCKS, max_num_batched_tokens=CHUNK)
    out = {}
    for arm, mode, split in (("colocated", "colocated", (0, 2)), ("P/D", "selective", (1, 1))):
        config = PDConfig(mode, *split, MIN_UNCACHED_PROMPT_TOKENS, replica, replica, SIM_LINK, kv_per_token,
                          prefill_router="prefix_approx")
        outcome = simulate_pd(workload, load_cost_model(), config)
        chat = summarize_pd(outcome, duration, group="chat")
        long = summarize_pd(outcome, duration, group="long")
        moved = [t for t in outcome.traces if t.kv_ready is not None]
        tokens = sum(len(t.token_times) for t in outcome.traces)
        out[arm] = {"short_itl_p50": chat.itl_p50, "short_itl_p99": chat.itl_p99, "short_ttft_p50": chat.ttft_p50,
                    "short_ttft_p99": chat.ttft_p99, "long_ttft_p50": long.ttft_p50, "long_ttft_p99": long.ttft_p99,
                    "throughput": tokens / outcome.end_time if outcome.end_time else math.nan,
                    "remote": float(len(moved)),
                    "bytes_per_transfer": (sum(t.transfer_tokens for t in moved) * kv_per_token / len(moved)
                                           if moved else math.nan),
                    "s_per_transfer": (sum(t.kv_ready - t.prefill_done for t in moved) / len(moved)
                                       if moved else math.nan)}
    return out


# --- the table --------------------------------------------------------------------------------------------

def measured(runs: list[ArmRun]) -> dict[str, float]:
    """An arm's figures over its rounds pooled: latencies in seconds."""
    duration = sum(r.duration for r in runs)
    short = summarize("short", [x for r in runs for x in r.short], duration)
    long = summarize("long", [x for r in runs for x in r.long], duration)
    pd: dict[str, float] = {}
    for r in runs:
        for k, v in r.pd.items():
            pd[k] = pd.get(k, 0) + v
    transfers = pd.get("transfers", 0)
    tokens = sum(x.tokens for r in runs for x in r.short + r.long)
    return {"short_itl_p50": short["itl_p50"] / 1e3, "short_itl_p99": short["itl_p99"] / 1e3,
            "short_ttft_p50": short["ttft_p50"] / 1e3, "short_ttft_p99": short["ttft_p99"] / 1e3,
            "long_ttft_p50": long["ttft_p50"] / 1e3, "long_ttft_p99": long["ttft_p99"] / 1e3,
            "throughput": tokens / duration, "failed": float(sum(len(r.failed) for r in runs)),
            "remote": pd.get("remote", math.nan), "local": sum(v for k, v in pd.items() if k.startswith("local_")),
            "fallbacks": pd.get("local_fallback", 0),
            "bytes_per_transfer": pd["transfer_bytes"] / transfers if transfers else math.nan,
            "s_per_transfer": pd["transfer_seconds"] / transfers if transfers else math.nan}


def _ms(x: float) -> str:
    return "-" if x is None or math.isnan(x) else f"{x * 1e3:,.0f}"


def _pair(row: dict, key: str) -> str:
    return f"{_ms(row[f'{key}_p50'])} / {_ms(row[f'{key}_p99'])}"


def _ratio(a: float, b: float) -> str:
    return "-" if math.isnan(a) or math.isnan(b) or not b else f"{a / b:.2f}x"


def _mb(x: float) -> str:
    return "-" if math.isnan(x) else f"{x / 2**20:.2f}"


HEADER = ("| | short ITL p50 / p99 ms | short TTFT p50 / p99 ms | long TTFT p50 / p99 ms | output tok/s "
          "| remote prefills | MiB / transfer | ms / transfer |\n|---|---:|---:|---:|---:|---:|---:|---:|")


def row(label: str, r: dict) -> str:
    remote = "-" if math.isnan(r["remote"]) else f"{r['remote']:.0f}"
    return (f"| {label} | {_pair(r, 'short_itl')} | {_pair(r, 'short_ttft')} | {_pair(r, 'long_ttft')} "
            f"| {r['throughput']:.1f} | {remote} | {_mb(r['bytes_per_transfer'])} | {_ms(r['s_per_transfer'])} |")


def ratio_row(label: str, a: dict, b: dict) -> str:
    cells = [f"{_ratio(a[f'{k}_p50'], b[f'{k}_p50'])} / {_ratio(a[f'{k}_p99'], b[f'{k}_p99'])}"
             for k in ("short_itl", "short_ttft", "long_ttft")]
    cells += [_ratio(a[k], b[k]) for k in ("throughput", "remote", "bytes_per_transfer", "s_per_transfer")]
    return f"| {label} | " + " | ".join(cells) + " |"


def report(args, workload: Workload, live: dict[str, list[ArmRun]], sim: dict | None) -> None:
    m = {arm: measured(runs) for arm, runs in live.items()}
    n_chat = sum(r.group == "chat" for r in workload.requests)
    print(f"## P/D live: {args.model}, 2 colocated replicas vs 1 prefill + 1 decode"
          + (" (SMOKE: a short run on a shared machine; noise, not a measurement)" if args.smoke else "") + "\n")
    print(f"Workload (seed {args.seed}, {args.duration:g} s of Poisson arrivals, x{args.rounds} rounds per arm, "
          f"alternating): {n_chat} short requests ({args.chat_rate:g}/s, prompts {SHAPE.chat_prompt} tok, answers "
          f"{SHAPE.chat_output} tok) and {len(workload.requests) - n_chat} long ones ({args.long_rate:g}/s, "
          f"{SHAPE.long_prompt}-token prompts, {SHAPE.long_output}-token answers), streamed, greedy, ignore_eos. "
          f"Engines: one thread, {CHUNK}-token chunked prefill, {NUM_KV_BLOCKS} KV blocks; colocated router: prefix; "
          f"P/D min_uncached_prompt_tokens {MIN_UNCACHED_PROMPT_TOKENS}"
          f"{', ' + json.dumps(args.pd_args) if args.pd_args else ''}. "
          f"Transfers: means over the measured window "
          f"(decode replica's pd_stats).\n")
    print(HEADER)
    for arm in ARMS:
        print(row(arm, m[arm]))
    print(ratio_row("P/D / colocated", m["P/D"], m["colocated"]))
    ratio = m["P/D"]["short_itl_p99"] / m["colocated"]["short_itl_p99"]
    verdict = "met" if ratio <= 0.5 else "NOT met"
    print(f"\nShort-stream ITL p99, P/D / colocated: {ratio:.2f}x (target <= 0.5x: {verdict}).")
    pd = m["P/D"]
    print(f"Failed requests: colocated {m['colocated']['failed']:.0f}, P/D {pd['failed']:.0f}; P/D prefills on the "
          f"decode replica {pd['local']:.0f} (of which fallbacks after a failed transfer {pd['fallbacks']:.0f}).")
    for arm in ARMS:
        errors = sorted({e for r in live[arm] for e in r.failed})
        if errors:
            print(f"{arm} errors: " + "; ".join(errors[:5]))
    if sim is None:
        print(f"\nSimulator check skipped: the CPU step model (cluster_sim/step_cost.json) is fitted to "
              f"{FITTED_MODEL}, not {args.model}.")
        return
    print(f"\n### Simulator check (cluster_sim/pd.py, CPU step model of {FITTED_MODEL}, one thread; link "
          f"{SIM_LINK.bandwidth_gbit_s:g} Gbit/s + {SIM_LINK.latency_s * 1e3:g} ms)\n")
    print(HEADER)
    for arm in ARMS:
        print(row(f"{arm} predicted", sim[arm]))
        print(ratio_row(f"{arm} measured / predicted", m[arm], sim[arm]))
    print(f"\nPredicted short-stream ITL p99, P/D / colocated: "
          f"{_ratio(sim['P/D']['short_itl_p99'], sim['colocated']['short_itl_p99'])}.")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration", type=float, default=240.0, help="seconds of arrivals per arm and round")
    parser.add_argument("--rounds", type=int, default=1, help="times each arm runs, alternating (a fresh app each)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", default="pagedserve-56m", choices=sorted(BUILTIN_MODELS))
    parser.add_argument("--chat-rate", type=float, default=2.0, help="short requests per second")
    parser.add_argument("--long-rate", type=float, default=0.5, help="1,500-token prompts per second")
    parser.add_argument("--port", type=int, default=8350)
    parser.add_argument("--log-dir", type=Path, help="keep each app's `serve run` output here")
    parser.add_argument("--smoke", action="store_true", help="30 s of arrivals per arm, one round")
    parser.add_argument("--pd-args", type=json.loads, default={},
                        help='more `disaggregation:` fields for the P/D arm, as JSON, e.g. '
                             '\'{"transfer_timeout_s": 120}\'')
    args = parser.parse_args()
    if args.smoke:
        args.duration, args.rounds = 30.0, 1
    workload = chat_and_long(args.seed, args.chat_rate, args.long_rate, args.duration, SHAPE)
    live: dict[str, list[ArmRun]] = {arm: [] for arm in ARMS}
    for i in range(args.rounds):
        for arm in ARMS:
            start = time.perf_counter()
            log = args.log_dir / f"{arm.replace('/', '')}-{i}.log" if args.log_dir else None
            if log:
                log.parent.mkdir(parents=True, exist_ok=True)
            live[arm].append(run_arm(arm, args.model, workload.requests, args.port, log, args.pd_args))
            print(f"[{arm} round {i + 1}: {time.perf_counter() - start:.0f} s]", file=sys.stderr, flush=True)
    sim = simulated(args.model, workload, args.duration) if args.model == FITTED_MODEL else None
    report(args, workload, live, sim)


if __name__ == "__main__":
    main()
