"""Cluster simulation benchmark: routers and autoscalers on simulated pagedserve replicas.

    python benchmarks/simulate.py [--quick] [--jobs N] [--only routing,shapes,autoscaling] > out.md

Markdown tables go to stdout (the last full run: benchmarks/results/simulate.md), one progress line per
run to stderr. Simulated results are deterministic (seeded), so CPU contention only slows a run: the full
set of 31 runs takes a minute or two on one core. --quick simulates about a third of the time; it is a
smoke test, since the autoscalers' delays do not shrink with it.

  (a) routing on the multi-tenant shape at ~70% KV pressure (and at half that load), a fixed fleet, every
      router: hit rate against the oracle and against one infinite cache, TTFT p50/p99, TPOT, SLO
      attainment, load imbalance, preemptions, and whether the issue's routing targets are met;
  (b) the same for the multi-turn chat and Zipf shapes;
  (c) autoscaling on the bursty shape: ours against Ray's default policy (same router): SLO attainment,
      TTFT, replica-seconds, scale events, dropped streams, the fleet size over time, and the targets.
The replicas are the engine's own scheduler and block pool with a step time fitted to the real engine on
this machine (benchmarks/cluster_sim/fit.py, cached in step_cost.json). Workload rates are set from that
fitted model, as a fraction of what the fleet could serve if every prefix hit the cache, so the load
follows the machine instead of being tuned per router. See benchmarks/cluster_sim/ for the method."""

from __future__ import annotations

import argparse
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.cluster_sim.autoscalers import Fixed, Ours, RayDefault  # noqa: E402
from benchmarks.cluster_sim.fit import StepCostModel, describe, load_cost_model, prefill_pairs  # noqa: E402
from benchmarks.cluster_sim.metrics import RunResult, Slo, live_history_blocks, summarize  # noqa: E402
from benchmarks.cluster_sim.replica import ReplicaConfig  # noqa: E402
from benchmarks.cluster_sim.routers import ROUTERS, make_router  # noqa: E402
from benchmarks.cluster_sim.sim import SimConfig, simulate  # noqa: E402
from benchmarks.cluster_sim.workloads import (  # noqa: E402
    ChatShape,
    TenantShape,
    Workload,
    bursty,
    multi_tenant,
    multi_turn,
    zipf,
    zipf_weights,
)

SLO = Slo(ttft_s=2.0, tpot_s=0.25)
REPLICA = ReplicaConfig()  # 1024 blocks of 16 tokens: the 56M model's KV in configs/default.yaml's 0.25 GiB
DECODE_BATCH = 16  # the decode batch assumed when converting a request into replica-seconds of work
SEED = 0


def request_cost(cost: StepCostModel, cached: float, uncached: float, output: float) -> float:
    """Replica-seconds one request takes: its prefill after `cached` tokens, and its share of
    DECODE_BATCH-wide decode steps."""
    context = cached + uncached + output / 2
    prefill = cost.beta * uncached + cost.delta_prefill * prefill_pairs(round(uncached), round(cached))
    return prefill + output * (cost.gamma + cost.delta_decode * context + cost.alpha / DECODE_BATCH)


def tenant_request_cost(cost: StepCostModel, shape: TenantShape, hit: bool) -> float:
    prefix = sum(shape.prefix_len) / 2
    question = sum(shape.question_len) / 2
    output = sum(shape.output_len) / 2
    return request_cost(cost, prefix, question, output) if hit else request_cost(cost, 0, prefix + question, output)


@dataclass
class Scenario:
    """One run: a workload (built in the worker: cheap, deterministic) on a fleet with a router and an
    autoscaler."""

    key: str
    workload: str  # multi_tenant | multi_turn | zipf | bursty
    workload_args: dict
    router: str
    autoscaler: str = "fixed"
    autoscaler_args: dict = field(default_factory=dict)
    sim: SimConfig = field(default_factory=SimConfig)


def build_workload(s: Scenario) -> Workload:
    return {"multi_tenant": multi_tenant, "multi_turn": multi_turn, "zipf": zipf, "bursty": bursty}[s.workload](
        **s.workload_args)


def run_scenario(s: Scenario) -> tuple[str, RunResult, dict]:
    cost = load_cost_model()
    workload = build_workload(s)
    autoscaler = {"fixed": lambda: Fixed(), "ray_default": lambda: RayDefault(**s.autoscaler_args),
                  "ours": lambda: Ours(**s.autoscaler_args)}[s.autoscaler]()
    outcome = simulate(workload, make_router(s.router, seed=SEED), cost, s.sim, autoscaler)
    result = summarize(outcome, workload.name, s.router, s.autoscaler, SLO)
    extra = {
        "description": workload.description,
        "working_set_blocks": workload.working_set_blocks or live_history_blocks(outcome),
        "timeline": outcome.replica_timeline,
        "reasons": dict(outcome.router_reasons),
    }
    return s.key, result, extra


# --- the scenarios ------------------------------------------------------------------------------------

def scenarios(cost: StepCostModel, quick: bool) -> tuple[list[Scenario], dict]:
    scale = 0.35 if quick else 1.0
    notes: dict[str, str] = {}
    out: list[Scenario] = []
    shape = TenantShape()
    hit, miss = tenant_request_cost(cost, shape, True), tenant_request_cost(cost, shape, False)

    # (a) multi-tenant, 6 replicas, tenants' prefixes = 70% of the fleet's KV blocks, at two loads.
    n = 6
    blocks = n * REPLICA.num_kv_blocks
    for tag, load, duration in (("mt", 0.5, 240), ("mt_light", 0.25, 480)):
        rate = round(load * n / hit, 1)  # offered load: a fraction of what the fleet serves when every prefix hits
        notes[tag] = (
            f"{n} replicas x {REPLICA.num_kv_blocks} blocks; {rate:g} req/s = {load:.0%} of the fleet's all-hit "
            f"capacity ({n / hit:.1f} req/s), {rate * miss / n:.0%} of its no-hit capacity ({n / miss:.1f} req/s)")
        for router in ROUTERS:
            out.append(Scenario(f"{tag}/{router}", "multi_tenant",
                                dict(seed=SEED, rate=rate, duration_s=duration * scale, cluster_blocks=blocks,
                                     kv_pressure=0.7),
                                router, sim=SimConfig(replica=REPLICA, initial_replicas=n)))

    # (b1) multi-turn chat, 6 replicas.
    chat = ChatShape()
    session_rate = 0.5
    for router in ROUTERS:
        out.append(Scenario(f"chat/{router}", "multi_turn",
                            dict(seed=SEED, session_rate=session_rate, duration_s=600 * scale, shape=chat),
                            router, sim=SimConfig(replica=REPLICA, initial_replicas=n)))
    notes["chat"] = f"{n} replicas x {REPLICA.num_kv_blocks} blocks"

    # (b2) Zipf documents, 8 replicas: the hottest document alone needs more than one replica.
    nz, alpha, docs = 8, 1.2, 200
    p1 = zipf_weights(docs, alpha)[0]
    zrate = round(1.5 / (p1 * hit), 1)  # the hottest document: 1.5 replicas of work even when it always hits
    notes["zipf"] = (f"{nz} replicas x {REPLICA.num_kv_blocks} blocks; {zrate:g} req/s: the hottest document alone is "
                     f"{zrate * p1 * hit:.1f} replicas of work at full cache hits, the whole stream "
                     f"{zrate * hit / nz:.0%} of the fleet's all-hit capacity")
    for router in ROUTERS:
        out.append(Scenario(f"zipf/{router}", "zipf",
                            dict(seed=SEED, rate=zrate, duration_s=180 * scale, num_docs=docs, alpha=alpha),
                            router, sim=SimConfig(replica=REPLICA, initial_replicas=nz)))

    # (c) bursty, autoscaled, prefix_precise router.
    base = round(0.6 / hit, 1)  # about 0.6 of one replica at full hits
    phases = [(90, base), (60, 4 * base), (90, base), (60, 0.0), (60, 5 * base), (120, base)]
    phases = [(d * scale, r) for d, r in phases]
    bounds = dict(min_replicas=1, max_replicas=8)
    auto_sim = SimConfig(replica=REPLICA, initial_replicas=2, cold_start_s=15.0)
    notes["auto"] = (f"router prefix_precise; replicas {bounds['min_replicas']}..{bounds['max_replicas']}, "
                     f"initial 2, cold start {auto_sim.cold_start_s:g} s, drain on; base rate {base:g} req/s "
                     f"(~0.6 replica of all-hit work), bursts 4x and 5x. ray_default@T: Ray Serve's default policy, "
                     f"target_ongoing_requests T, its default delays (metrics 10 s, look-back 30 s, upscale 30 s, "
                     f"downscale 600 s); ours: autoscale/policy.py under the app's settings; ours_nodrain: the same "
                     f"with replicas stopped at once (what drain saves); ray_down60@2: not a default, Ray's policy "
                     f"with a 60 s downscale delay (what the long delay buys)")
    wl = dict(seed=SEED, phases=phases, num_tenants=24)
    out.append(Scenario("auto/ours", "bursty", wl, "prefix_precise", "ours", bounds, auto_sim))
    for target in (2, 4, 8, 16):
        out.append(Scenario(f"auto/ray_default@{target}", "bursty", wl, "prefix_precise", "ray_default",
                            dict(bounds, target_ongoing_requests=target), auto_sim))
    out.append(Scenario("auto/ours_nodrain", "bursty", wl, "prefix_precise", "ours", bounds,
                        replace(auto_sim, drain=False)))
    # Not Ray's default: its downscale delay cut to 60 s, to show what that delay buys.
    out.append(Scenario("auto/ray_down60@2", "bursty", wl, "prefix_precise", "ray_default",
                        dict(bounds, target_ongoing_requests=2, downscale_delay_s=60), auto_sim))
    return out, notes


# --- tables -------------------------------------------------------------------------------------------

ROUTING_SECTIONS = (  # key prefix, title, fleet size, whether the routing targets apply
    ("mt", "(a) Routing, multi-tenant shared system prompts, ~70% KV pressure", 6, True),
    ("mt_light", "(a') The same at half the load (pow2 not saturated)", 6, True),
    ("chat", "(b) Routing, multi-turn chat", 6, False),
    ("zipf", "(b) Routing, Zipf document popularity", 8, False),
)


def _ms(x: float) -> str:
    return f"{x * 1e3:,.0f}"


def _rows(results: dict, prefix: str) -> dict[str, tuple[RunResult, dict]]:
    return {k.split("/", 1)[1]: v for k, v in results.items() if k.split("/", 1)[0] == prefix}


def routing_table(results: dict, prefix: str, title: str, fleet: int, note: str, targets: bool) -> list[str]:
    rows = _rows(results, prefix)
    if not rows:
        return []
    any_extra = next(iter(rows.values()))[1]
    cap = fleet * REPLICA.num_kv_blocks
    if prefix == "chat":  # measured per run; quote the pow2 run's (routing barely changes session lifetimes)
        ws = rows.get("pow2", next(iter(rows.values())))[1]["working_set_blocks"]
        ws_note = f"live chat histories, time-averaged: {ws:,.0f} blocks = {ws / cap:.0%} of the fleet's KV"
    else:
        ws = any_extra["working_set_blocks"]
        ws_note = f"the prefixes: {ws:,.0f} blocks = {ws / cap:.0%} of the fleet's KV"
    oracle, pow2 = rows.get("oracle"), rows.get("pow2")
    bound = rows.get("pow2", next(iter(rows.values())))[0].hit_bound  # chat: arrivals differ a little per run
    under = all(r.hit_tokens <= r.bound_hits for r, _ in rows.values())
    lines = [f"### {title}", "", f"Workload: {any_extra['description']}.", f"Fleet: {note}; {ws_note}.",
             f"Upper bound on the hit rate (one infinite cache that never evicts): {bound:.1%}; every router "
             f"under its run's bound: {'yes' if under else 'NO'}.", "",
             "| router | hit rate | vs oracle (pts) | TTFT p50 ms | TTFT p99 ms | p99 / pow2 | TPOT p50 ms "
             "| SLO % | imbalance | busy % | preemptions | finished | wall s |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, (r, _) in rows.items():
        vs_oracle = f"{(r.hit_rate - oracle[0].hit_rate) * 100:+.1f}" if oracle else "-"
        vs_pow2 = f"{r.ttft_p99 / pow2[0].ttft_p99:.2f}x" if pow2 else "-"
        lines.append(
            f"| {name} | {r.hit_rate:.1%} | {vs_oracle} | {_ms(r.ttft_p50)} | {_ms(r.ttft_p99)} | {vs_pow2} "
            f"| {_ms(r.tpot_p50)} | {r.slo_attainment:.1%} | {r.imbalance:.2f} | {r.busy_fraction:.0%} "
            f"| {r.preemptions} | {r.finished}/{r.requests + r.abandoned} | {r.wall_s:.1f} |")
    lines.append("")
    p = rows.get("prefix_precise")
    if p and oracle and pow2:
        o, pw = oracle[0], pow2[0]
        p = p[0]
        gap, ratio = (p.hit_rate - o.hit_rate) * 100, p.ttft_p99 / pw.ttft_p99
        verdict = lambda ok: (" - target met" if ok else " - TARGET MISSED") if targets else ""  # noqa: E731
        same = (p.hit_tokens, p.prompt_tokens) == (p.pool_hits, p.pool_queries)
        lines += [
            f"- prefix_precise hit rate vs oracle: {gap:+.1f} points (target: within 5){verdict(gap >= -5)}",
            f"- prefix_precise TTFT p99 vs pow2: {ratio:.2f}x (target: <= 0.3x){verdict(ratio <= 0.3)}; "
            f"the oracle's: {o.ttft_p99 / pw.ttft_p99:.2f}x",
            f"- hit-rate accounting (prefix_precise): the requests' own hits {p.hit_tokens:,} / {p.prompt_tokens:,} "
            f"tokens, the block pools' counters {p.pool_hits:,} / {p.pool_queries:,}: "
            f"{'equal' if same else 'DIFFERENT'}",
            "",
        ]
    return lines


def autoscaling_table(results: dict, note: str) -> list[str]:
    rows = _rows(results, "auto")
    if not rows:
        return []
    first = next(iter(rows.values()))
    lines = ["### (c) Autoscaling on the bursty shape", "", f"Workload: {first[1]['description']}.",
             f"Setup: {note}.", "",
             "| autoscaler | SLO % | TTFT p50 ms | TTFT p99 ms | replica-s | ours / this | scale ups / downs "
             "| dropped streams | peak replicas | hit rate | busy % | routable replicas every 30 s |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    ours = rows.get("ours")
    for name, (r, extra) in rows.items():
        timeline = extra["timeline"]
        peak = max((n for _, n, _ in timeline), default=0)
        samples = " ".join(str(n) for t, n, _ in timeline if round(t) % 30 == 0)
        ratio = f"{ours[0].replica_seconds / r.replica_seconds:.2f}x" if ours else "-"
        lines.append(
            f"| {name} | {r.slo_attainment:.1%} | {_ms(r.ttft_p50)} | {_ms(r.ttft_p99)} | {r.replica_seconds:,.0f} "
            f"| {ratio} | {r.scale_ups} / {r.scale_downs} | {r.dropped} | {peak} | {r.hit_rate:.1%} "
            f"| {r.busy_fraction:.0%} | {samples} |")
    lines.append("")
    if ours:
        o = ours[0]
        for name, (r, _) in rows.items():
            if name.startswith("ray_default"):
                ok = (o.slo_attainment >= r.slo_attainment and o.replica_seconds <= 0.8 * r.replica_seconds
                      and o.dropped == 0)
                lines.append(
                    f"- ours vs {name}: SLO {o.slo_attainment:.1%} vs {r.slo_attainment:.1%}, replica-seconds "
                    f"{o.replica_seconds / r.replica_seconds:.2f}x, dropped streams {o.dropped} "
                    f"(target: SLO >=, <= 0.8x, 0) - {'target met' if ok else 'TARGET MISSED'}")
        lines.append("")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="about a third of the simulated time")
    parser.add_argument("--jobs", type=int, default=1, help="runs in parallel (processes)")
    parser.add_argument("--only", default="routing,shapes,autoscaling")
    args = parser.parse_args()
    parts = set(args.only.split(","))
    cost = load_cost_model()
    all_scenarios, notes = scenarios(cost, args.quick)
    wanted = {"routing": ("mt", "mt_light"), "shapes": ("chat", "zipf"), "autoscaling": ("auto",)}
    chosen = [s for s in all_scenarios if any(s.key.split("/", 1)[0] in wanted[part] for part in parts)]
    start = time.perf_counter()
    results: dict[str, tuple[RunResult, dict]] = {}
    done = (ProcessPoolExecutor(args.jobs).map(run_scenario, chosen) if args.jobs > 1
            else map(run_scenario, chosen))
    for key, result, extra in done:
        results[key] = (result, extra)
        print(f"[{time.perf_counter() - start:6.1f}s] {key}: {result.requests} requests, simulated "
              f"{result.duration_s:.0f} s in {result.wall_s:.1f} s", file=sys.stderr, flush=True)

    print("## Cluster simulation\n")
    print(f"Step-time model ({cost.source}): {describe(cost)}.\n")
    print(f"Replica: the engine's Scheduler, KVCacheManager and BlockPool; {REPLICA.num_kv_blocks} KV blocks of "
          f"{REPLICA.block_size} tokens, token budget {REPLICA.max_num_batched_tokens} per step, at most "
          f"{REPLICA.max_num_seqs} running; when blocks run out the latest running request is preempted and "
          f"recomputed, and a step that preempted admits nothing new. Routing stats every 1 s. SLO: TTFT <= "
          f"{SLO.ttft_s:g} s and TPOT <= {SLO.tpot_s:g} s; a dropped or unfinished request misses it. Imbalance: "
          f"time-averaged max/mean of in-flight requests over routable replicas.\n")
    for prefix, title, fleet, targets in ROUTING_SECTIONS:
        if prefix in notes:
            print("\n".join(routing_table(results, prefix, title, fleet, notes[prefix], targets)))
    print("\n".join(autoscaling_table(results, notes["auto"])))
    print(f"_{len(chosen)} runs in {time.perf_counter() - start:.0f} s wall._")


if __name__ == "__main__":
    main()
