"""Disaggregated prefill/decode on the cluster simulator (issue 15): colocated, always-P/D and selective P/D
at the same number of replicas.

    python benchmarks/simulate_pd.py [--quick] [--jobs N] [--only gpu,crossover,cpu,live] [--dump F] > out.md
    python benchmarks/simulate_pd.py --load F > out.md      # the tables again, from a dump, without simulating

Markdown tables go to stdout (the last full run: benchmarks/results/simulate_pd.md), one progress line per
search to stderr. Everything is seeded and simulated, so CPU contention only slows a run (the full set: about
40 minutes on two cores).

Goodput is the highest Poisson arrival rate (requests/s) at which the fleet meets both SLOs over the run:
TTFT p90 and ITL p99 (every inter-token gap of every request) within target, and every request finished.
It is found per configuration: from a start rate, steps of x1.5 until one rate passes and the next fails,
then four geometric bisections of that bracket (about 2.6% resolution). Latencies are compared at one
rate per mix, the colocated baseline's goodput rate, so that every row carries the same load.

- gpu: the GPU-shaped 8B step model (5 ms + 0.1 ms/prefill token + 0.1 ms/decoding request, 128 KiB of
  KV per token), 4 replicas, mixes 200:200, 2000:200 and 8000:500, links of 10, 100 and 400 Gbit/s; SLOs
  TTFT p90 <= 1 s, ITL p99 <= 50 ms. Colocated: chunked prefill, 512-token chunks (the baseline), and
  256-token chunks (a sensitivity row). Always-P/D at every split 1:3, 2:2, 3:1 (the best is reported).
  Selective P/D at the best always split, with min_uncached_prompt_tokens from itl_safe_prompt_tokens
  (serve_app/disaggregation/policy.py) and with 512.
- crossover: at 10 Gbit/s, prompt lengths 1000-6000 with 200-token answers: where P/D stops paying.
- cpu: the same comparison on the CPU model fitted to the engine (fit.py), scaled to what it serves.
- live: a simulated mirror of the live P/D benchmark (pd_live.py): 2 colocated replicas against 1 prefill
  + 1 decode on the CPU model, short chat streams while 1,500-token prompts arrive."""

from __future__ import annotations

import argparse
import math
import pickle
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.cluster_sim.fit import GPU_8B, StepCostModel, describe, load_cost_model  # noqa: E402
from benchmarks.cluster_sim.metrics import percentile  # noqa: E402
from benchmarks.cluster_sim.pd import PDConfig, PDResult, PDSlo, simulate_pd, summarize_pd  # noqa: E402
from benchmarks.cluster_sim.replica import ReplicaConfig  # noqa: E402
from benchmarks.cluster_sim.workloads import ChatAndLongShape, chat_and_long, io_mix  # noqa: E402
from serve_app.disaggregation.policy import KVLink, itl_safe_prompt_tokens, kv_bytes_per_token  # noqa: E402

SEED = 0
FLEET = 4
SPLITS = ((1, 3), (2, 2), (3, 1))
LINK_LATENCY_S = 0.002


@dataclass(frozen=True)
class Setup:
    """The model side of a comparison: step cost, KV size, replicas, SLOs."""

    name: str
    kv_bytes_per_token: int
    slo: PDSlo
    prefill: ReplicaConfig  # prefill pool
    decode: ReplicaConfig  # decode pool and colocated replicas; its token budget is the prefill chunk
    link_latency_s: float = LINK_LATENCY_S

    @property
    def cost(self) -> StepCostModel:
        return GPU_8B if self.name == "gpu" else load_cost_model()


# An 8B model (Llama-3.1-8B: 32 layers, 8 KV heads of 128, bf16) on an 80 GB GPU: ~48 GiB of KV left after
# weights and activations = 24,576 blocks of 16 tokens; max_num_seqs 256. The prefill pool steps up to
# 2,048 tokens (nothing to protect there but its own TTFT); decode and colocated replicas take 512-token
# chunks, the baseline.
GPU = Setup(
    "gpu", kv_bytes_per_token(32, 8, 128, 2), PDSlo(ttft_s=1.0, itl_s=0.050),
    prefill=ReplicaConfig(num_kv_blocks=24576, max_num_seqs=256, max_num_batched_tokens=2048),
    decode=ReplicaConfig(num_kv_blocks=24576, max_num_seqs=256, max_num_batched_tokens=512),
)
# The 56M benchmark model on this machine (hidden 512, 8 layers, 4 KV heads of 64, float32: 16 KiB/token),
# 1024 blocks as in simulate.py. A 512-token chunk alone takes ~270 ms here, so the CPU runs chunk at 256
# (what pd_live.py uses) and hold ITL p99 to 250 ms and TTFT p90 to 4 s. Its "link" is Ray's object store
# on one machine, taken as 10 Gbit/s and 5 ms per transfer until pd_live.py measures it.
CPU = Setup(
    "cpu", kv_bytes_per_token(8, 4, 64, 4), PDSlo(ttft_s=4.0, itl_s=0.250),
    prefill=ReplicaConfig(max_num_batched_tokens=1024),
    decode=ReplicaConfig(max_num_batched_tokens=256), link_latency_s=0.005,
)
SETUPS = {"gpu": GPU, "cpu": CPU}


def auto_threshold(setup: Setup) -> int:
    cost = setup.cost
    return itl_safe_prompt_tokens(setup.slo.itl_s, cost.alpha, cost.beta, cost.gamma, setup.decode.max_num_seqs)


@dataclass(frozen=True)
class Spec:
    """One configuration whose goodput is searched: a mix on a fleet in one mode."""

    key: str
    setup: str
    mix: tuple[int, int]
    duration_s: float
    start_rate: float
    mode: str
    split: tuple[int, int]  # (prefill, decode); colocated: (0, fleet)
    bandwidth_gbit_s: float = 100.0
    threshold: int = 0  # selective only
    chunk: int | None = None  # the decode/colocated token budget, if not the setup's

    def config(self) -> PDConfig:
        s = SETUPS[self.setup]
        decode = s.decode if self.chunk is None else replace(s.decode, max_num_batched_tokens=self.chunk)
        return PDConfig(self.mode, self.split[0], self.split[1], self.threshold, s.prefill, decode,
                        KVLink(self.bandwidth_gbit_s, s.link_latency_s), s.kv_bytes_per_token,
                        prefill_router="prefix_approx", max_time_s=self.duration_s + 60.0)


def run_once(spec: Spec, rate: float) -> PDResult:
    workload = io_mix(SEED, rate, spec.duration_s, *spec.mix)
    outcome = simulate_pd(workload, SETUPS[spec.setup].cost, spec.config())
    return summarize_pd(outcome, spec.duration_s, SETUPS[spec.setup].slo)


def passes(r: PDResult, slo: PDSlo) -> bool:
    return r.finished == r.requests and r.ttft_p90 <= slo.ttft_s and r.itl_p99 <= slo.itl_s


@dataclass
class Search:
    spec: Spec
    goodput: float  # req/s; 0 if even the lowest rate tried failed
    at_goodput: PDResult | None
    tried: list[tuple[float, bool]]
    wall_s: float


def search(spec: Spec, bisections: int = 4) -> Search:
    start = time.perf_counter()
    slo = SETUPS[spec.setup].slo
    tried: list[tuple[float, bool]] = []
    results: dict[float, PDResult] = {}

    def ok(rate: float) -> bool:
        results[rate] = run_once(spec, rate)
        tried.append((rate, passes(results[rate], slo)))
        return tried[-1][1]

    rate = spec.start_rate
    if ok(rate):
        lo, hi = rate, None
        while hi is None and len(tried) < 12:
            rate *= 1.5
            if ok(rate):
                lo = rate
            else:
                hi = rate
    else:
        lo, hi = None, rate
        while lo is None and rate > spec.start_rate / 40:
            rate /= 1.5
            if ok(rate):
                lo = rate
            else:
                hi = rate
    if lo is not None and hi is not None:
        for _ in range(bisections):
            mid = math.sqrt(lo * hi)
            if ok(mid):
                lo = mid
            else:
                hi = mid
    wall = time.perf_counter() - start
    return Search(spec, lo or 0.0, results.get(lo) if lo else None, tried, wall)


def at_rate(job: tuple[Spec, float]) -> tuple[str, float, PDResult]:
    spec, rate = job
    return spec.key, rate, run_once(spec, rate)


# --- the comparisons ------------------------------------------------------------------------------------

GPU_MIXES = {  # mix: (duration s, start rate req/s)
    (200, 200): (30.0, 40.0),
    (2000, 200): (60.0, 4.0),
    (8000, 500): (180.0, 0.5),
}
BANDWIDTHS = (10.0, 100.0, 400.0)
CROSSOVER_INPUTS = (1000, 2000, 3000, 4000, 6000)
CPU_MIXES = {(200, 200): (60.0, 2.0), (2000, 200): (120.0, 0.3)}


def mix_name(mix: tuple[int, int]) -> str:
    return f"{mix[0]}:{mix[1]}"


def gpu_specs(quick: bool) -> list[Spec]:
    out = []
    for mix, (duration, start) in GPU_MIXES.items():
        d = duration / 3 if quick else duration
        m = mix_name(mix)
        out.append(Spec(f"gpu/{m}/colocated", "gpu", mix, d, start, "colocated", (0, FLEET)))
        out.append(Spec(f"gpu/{m}/colocated256", "gpu", mix, d, start, "colocated", (0, FLEET), chunk=256))
        for bw in BANDWIDTHS:
            for split in SPLITS:
                out.append(Spec(f"gpu/{m}/always@{bw:g}/{split[0]}:{split[1]}", "gpu", mix, d, start, "always", split,
                                bw))
    return out


def selective_specs(searches: dict[str, Search], setup: str, thresholds: list[int]) -> tuple[list[Spec], dict]:
    """Selective P/D per mix, link and threshold. These mixes share no prefix, so a request's uncached prompt
    is its whole prompt and the decision is the same for every request of a mix: with the threshold at or
    below the prompt length every request is disaggregated, and the runs are always-P/D's (identical traces:
    tests/benchmarks/test_pd_sim.py), so that row reuses always-P/D's best split; above it every request is
    prefilled where it is decoded, the prefill pool idles, no KV moves (the link does not matter), and the
    best split is the one with the most decode replicas. Returns the searches to run and, for the reused
    rows, selective key -> always key."""
    best: dict[tuple, Search] = {}
    for key, s in searches.items():
        if key.startswith(f"{setup}/") and s.spec.mode == "always":
            k = (s.spec.mix, s.spec.bandwidth_gbit_s)
            if k not in best or s.goodput > best[k].goodput:
                best[k] = s
    run, same = [], {}
    for (mix, bw), s in best.items():
        for t in thresholds:
            if t <= mix[0]:
                split = s.spec.split
                same[f"{setup}/{mix_name(mix)}/selective{t}@{bw:g}/{split[0]}:{split[1]}"] = s.spec.key
            else:
                split = (1, FLEET - 1)
                spec = replace(s.spec, key=f"{setup}/{mix_name(mix)}/selective{t}@-/{split[0]}:{split[1]}",
                               mode="selective", threshold=t, split=split, bandwidth_gbit_s=100.0)
                if spec.key not in [r.key for r in run]:
                    run.append(spec)
    return run, same


def crossover_specs(quick: bool) -> list[Spec]:
    out = []
    for n in CROSSOVER_INPUTS:
        mix, d = (n, 200), (20.0 if quick else 60.0)
        start = 8000 / n
        out.append(Spec(f"x/{n}:200/colocated", "gpu", mix, d, start, "colocated", (0, FLEET)))
        out.append(Spec(f"x/{n}:200/colocated256", "gpu", mix, d, start, "colocated", (0, FLEET), chunk=256))
        for split in SPLITS:
            out.append(Spec(f"x/{n}:200/always@10/{split[0]}:{split[1]}", "gpu", mix, d, start, "always", split, 10.0))
    return out


def cpu_specs(quick: bool) -> list[Spec]:
    out = []
    for mix, (duration, start) in CPU_MIXES.items():
        d = duration / 3 if quick else duration
        m = mix_name(mix)
        out.append(Spec(f"cpu/{m}/colocated", "cpu", mix, d, start, "colocated", (0, FLEET)))
        for split in SPLITS:
            out.append(Spec(f"cpu/{m}/always@10/{split[0]}:{split[1]}", "cpu", mix, d, start, "always", split, 10.0))
    return out


# --- the pd_live mirror -----------------------------------------------------------------------------------

LIVE_SHAPE = ChatAndLongShape(chat_prompt=(64, 256), chat_output=(64, 128), long_prompt=1500, long_output=32)
LIVE_RATES = ((1.0, 0.25), (2.0, 0.25), (2.0, 0.5))  # (chat req/s, long req/s)
LIVE_DURATION_S = 300.0
LIVE_THRESHOLD = 512  # chat prompts stay on the decode replica, 1,500-token ones go to the prefill replica
LIVE_MODES = (("colocated", (0, 2)), ("always", (1, 1)), ("selective", (1, 1)))


def live_run(job: tuple[str, tuple[int, int], float, float, float]) -> tuple[tuple, dict]:
    mode, split, chat_rate, long_rate, duration = job
    workload = chat_and_long(SEED, chat_rate, long_rate, duration, LIVE_SHAPE)
    config = PDConfig(mode, split[0], split[1], LIVE_THRESHOLD, CPU.prefill, CPU.decode,
                      KVLink(10.0, CPU.link_latency_s), CPU.kv_bytes_per_token, prefill_router="prefix_approx")
    outcome = simulate_pd(workload, CPU.cost, config)
    chat = summarize_pd(outcome, duration, CPU.slo, group="chat")
    long = summarize_pd(outcome, duration, CPU.slo, group="long")
    moved = [t.kv_ready - t.prefill_done for t in outcome.traces if t.kv_ready is not None and t.sim.group == "long"]
    return (mode, chat_rate, long_rate), {"chat": chat, "long": long, "wall": outcome.wall_s, "duration": duration,
                                          "long_transfer_p50": percentile(moved, 50)}


# --- tables -----------------------------------------------------------------------------------------------

def _ms(x: float) -> str:
    return "-" if x is None or math.isnan(x) else f"{x * 1e3:,.0f}"


def _ms1(x: float) -> str:
    return "-" if x is None or math.isnan(x) else f"{x * 1e3:,.1f}"


def _lat(r: PDResult | None) -> str:
    if r is None:
        return "- | - | - | -"
    return (f"{_ms(r.ttft_p50)} / {_ms(r.ttft_p99)} | {_ms1(r.itl_p50)} / {_ms1(r.itl_p99)} | {r.attainment:.0%} "
            f"| {r.disaggregated / r.requests:.0%}")


def comparison_table(prefix: str, mix: tuple[int, int], searches: dict[str, Search],
                     ref: dict[str, tuple[float, PDResult]], setup: Setup, note: str) -> list[str]:
    m = mix_name(mix)
    rows = {k[len(prefix) + len(m) + 2:]: s for k, s in searches.items() if k.startswith(f"{prefix}/{m}/")}
    base = rows["colocated"]
    ref_rate = next(iter(ref.values()))[0] if ref else math.nan
    lines = [f"### {m} ({setup.name.upper()} model, {FLEET} replicas)", "", note, "",
             f"Latencies at {ref_rate:.3g} req/s for every row (the colocated baseline's goodput rate).", "",
             "| mode | link Gbit/s | P:D | goodput req/s | vs colocated | always-P/D goodput at 1:3 / 2:2 / 3:1 "
             "| TTFT p50 / p99 ms | ITL p50 / p99 ms | requests within both SLOs | disaggregated |",
             "|---|---:|---:|---:|---:|---|---:|---:|---:|---:|"]

    def row(label: str, bw: str, s: Search, by_split: str = "") -> str:
        split = "-" if s.spec.mode == "colocated" else f"{s.spec.split[0]}:{s.spec.split[1]}"
        vs = f"{s.goodput / base.goodput:.2f}x" if base.goodput else "-"
        r = ref.get(s.spec.key, (None, None))[1]
        return f"| {label} | {bw} | {split} | {s.goodput:.3g} | {vs} | {by_split} | {_lat(r)} |"

    lines.append(row(f"colocated, {setup.decode.max_num_batched_tokens}-token chunks (baseline)", "-", base))
    if "colocated256" in rows:
        lines.append(row("colocated, 256-token chunks (sensitivity)", "-", rows["colocated256"]))
    for bw in BANDWIDTHS:
        always = {k: s for k, s in rows.items() if k.startswith(f"always@{bw:g}/")}
        if not always:
            continue
        best = max(always.values(), key=lambda s: s.goodput)
        by_split = " / ".join(f"{always[f'always@{bw:g}/{p}:{d}'].goodput:.3g}" for p, d in SPLITS
                              if f"always@{bw:g}/{p}:{d}" in always)
        lines.append(row("always P/D (best split)", f"{bw:g}", best, by_split))
        for k, s in sorted(rows.items()):
            if k.startswith("selective") and f"@{bw:g}/" in k:
                t = int(k[len("selective"):k.index("@")])
                lines.append(row(f"selective P/D, min_uncached_prompt_tokens {t}: all disaggregated (= always)",
                                 f"{bw:g}", s))
    for k, s in sorted(rows.items()):
        if k.startswith("selective") and "@-/" in k:
            lines.append(row(f"selective P/D, min_uncached_prompt_tokens {s.spec.threshold}: none disaggregated "
                             f"(prefill replica idle)", "any", s))
    lines.append("")
    return lines


def crossover_table(searches: dict[str, Search]) -> list[str]:
    lines = ["### Where P/D stops paying at 10 Gbit/s (GPU model, 4 replicas, 200-token answers)", "",
             "Goodput in req/s. The last column is a P/D request's TTFT on an idle fleet: prefill steps on the "
             "prefill replica, the KV on the wire, the per-transfer latency, the decode replica's first step.", "",
             "| prompt tokens | colocated 512 | colocated 256 | always P/D, best split | vs colocated 512 "
             "| vs colocated 256 | idle-fleet TTFT, P/D ms |",
             "|---:|---:|---:|---:|---:|---:|---:|"]
    for n in CROSSOVER_INPUTS:
        rows = {k.split("/", 2)[2]: s for k, s in searches.items() if k.startswith(f"x/{n}:200/")}
        if not rows:
            continue
        c512, c256 = rows["colocated"], rows["colocated256"]
        best = max((s for k, s in rows.items() if k.startswith("always")), key=lambda s: s.goodput)
        steps = math.ceil(n / GPU.prefill.max_num_batched_tokens)
        prefill = steps * GPU_8B.alpha + n * GPU_8B.beta
        wire = KVLink(10.0).wire_time_s(n * GPU.kv_bytes_per_token)
        first = GPU_8B.step_time(1, 0)
        ratio = lambda a, b: f"{a / b:.2f}x" if b else ("-" if not a else "inf")  # noqa: E731
        lines.append(f"| {n} | {c512.goodput:.3g} | {c256.goodput:.3g} | {best.goodput:.3g} ({best.spec.split[0]}:"
                     f"{best.spec.split[1]}) | {ratio(best.goodput, c512.goodput)} "
                     f"| {ratio(best.goodput, c256.goodput)} | {prefill * 1e3:.0f} + {wire * 1e3:.0f} + "
                     f"{LINK_LATENCY_S * 1e3:.0f} + {first * 1e3:.0f} = "
                     f"{(prefill + wire + LINK_LATENCY_S + first) * 1e3:.0f} |")
    lines.append("")
    return lines


def live_table(results: dict) -> list[str]:
    lines = ["### pd_live mirror (CPU model): 2 colocated replicas vs 1 prefill + 1 decode", "",
             f"Chat: prompts {LIVE_SHAPE.chat_prompt} tok, answers {LIVE_SHAPE.chat_output} tok; long: "
             f"{LIVE_SHAPE.long_prompt}-token prompts, {LIVE_SHAPE.long_output}-token answers; Poisson, "
             f"{next(iter(results.values()))['duration']:g} s. Colocated and decode replicas chunk prefills at "
             f"{CPU.decode.max_num_batched_tokens} tokens, the prefill replica steps up to "
             f"{CPU.prefill.max_num_batched_tokens}; selective keeps prompts under {LIVE_THRESHOLD} uncached tokens "
             f"on the decode replica (every chat prompt) and sends the long ones to the prefill replica. KV "
             f"{CPU.kv_bytes_per_token // 1024} KiB/token over 10 Gbit/s + {CPU.link_latency_s * 1e3:g} ms.", "",
             "| chat / long req/s | mode | chat ITL p50 / p99 ms | chat TTFT p50 / p99 ms | long TTFT p50 / p99 ms "
             "| long: prefill answer to KV ready, p50 ms | wall s |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for chat_rate, long_rate in LIVE_RATES:
        for mode, _ in LIVE_MODES:
            r = results.get((mode, chat_rate, long_rate))
            if r is None:
                continue
            c, lg = r["chat"], r["long"]
            lines.append(f"| {chat_rate:g} / {long_rate:g} | {mode} | {_ms(c.itl_p50)} / {_ms(c.itl_p99)} "
                         f"| {_ms(c.ttft_p50)} / {_ms(c.ttft_p99)} | {_ms(lg.ttft_p50)} / {_ms(lg.ttft_p99)} "
                         f"| {_ms(r['long_transfer_p50'])} | {r['wall']:.1f} |")
    lines.append("")
    return lines


def _run_all(fn, jobs: list, workers: int, label) -> list:
    start = time.perf_counter()
    out = []
    with ProcessPoolExecutor(max(1, workers)) as pool:
        for result in (pool.map(fn, jobs) if workers > 1 else map(fn, jobs)):
            out.append(result)
            print(f"[{time.perf_counter() - start:6.1f}s] {label(result)}", file=sys.stderr, flush=True)
    return out


def _searched(s: Search) -> str:
    tried = " ".join(f"{r:.3g}{'+' if ok else '-'}" for r, ok in s.tried)
    return f"{s.spec.key}: goodput {s.goodput:.3g} req/s ({tried}) in {s.wall_s:.0f} s"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a third of the simulated time (a smoke test)")
    parser.add_argument("--jobs", type=int, default=2, help="searches in parallel (processes)")
    parser.add_argument("--only", default="gpu,crossover,cpu,live")
    parser.add_argument("--dump", help="also pickle the results here (for --load)")
    parser.add_argument("--load", help="print the tables of a --dump instead of simulating")
    args = parser.parse_args()
    if args.load:
        with open(args.load, "rb") as f:
            data = pickle.load(f)
    else:
        data = simulate_all(set(args.only.split(",")), args.quick, args.jobs)
        if args.dump:
            with open(args.dump, "wb") as f:
                pickle.dump(data, f)
    print_tables(**data)


def simulate_all(parts: set[str], quick: bool, jobs: int) -> dict:
    start = time.perf_counter()
    gpu_auto = auto_threshold(GPU)
    specs = ((gpu_specs(quick) if "gpu" in parts else []) + (crossover_specs(quick) if "crossover" in parts else [])
             + (cpu_specs(quick) if "cpu" in parts else []))
    searches = {s.spec.key: s for s in _run_all(search, specs, jobs, _searched)}
    selective, same = [], {}
    for setup, thresholds in (("gpu", [gpu_auto, 512]), ("cpu", [512])):
        if setup in parts:
            run, alias = selective_specs(searches, setup, thresholds)
            selective += run
            same.update(alias)
    searches.update({s.spec.key: s for s in _run_all(search, selective, jobs, _searched)})
    for key, always_key in same.items():
        searches[key] = replace(searches[always_key], spec=replace(searches[always_key].spec, key=key))
    # Every row of a mix at the colocated baseline's goodput rate.
    ref_jobs = []
    for key, s in searches.items():
        setup, m = key.split("/")[:2]
        base = searches.get(f"{setup}/{m}/colocated")
        if setup in ("gpu", "cpu") and base and base.goodput and key not in same:
            ref_jobs.append((s.spec, base.goodput))
    refs: dict[str, dict[str, tuple[float, PDResult]]] = {}
    for key, rate, r in _run_all(at_rate, ref_jobs, jobs, lambda x: f"{x[0]} at {x[1]:.3g} req/s"):
        refs.setdefault("/".join(key.split("/")[:2]), {})[key] = (rate, r)
    for key, always_key in same.items():
        group = refs.get("/".join(key.split("/")[:2]), {})
        if always_key in group:
            group[key] = group[always_key]
    live = {}
    if "live" in parts:
        live_jobs = [(mode, split, c, lg, LIVE_DURATION_S / (3 if quick else 1))
                     for c, lg in LIVE_RATES for mode, split in LIVE_MODES]
        live = dict(_run_all(live_run, live_jobs, jobs, lambda x: f"live {x[0]}"))
    runs = sum(len(s.tried) for k, s in searches.items() if k not in same) + len(ref_jobs) + len(live)
    return dict(parts=parts, quick=quick, searches=searches, refs=refs, live=live, runs=runs,
                wall_s=time.perf_counter() - start)


def print_tables(parts: set[str], quick: bool, searches: dict[str, Search], refs: dict, live: dict, runs: int,
                 wall_s: float) -> None:
    gpu_auto, cpu_auto = auto_threshold(GPU), auto_threshold(CPU)
    scale = 3 if quick else 1
    print("## Disaggregated prefill/decode (cluster simulation)\n")
    print(next(par for par in __doc__.split("\n\n") if par.startswith("Goodput is")) + "\n")
    print("Request path, transfer model and decision: benchmarks/cluster_sim/pd.py and "
          "serve_app/disaggregation/policy.py. Decode replicas are picked by load and KV usage, prefill replicas "
          "by the prefix router (PrefixRouterPolicy; these mixes share no prefix, so it runs without block "
          "summaries: nothing it could match). A transfer moves prompt tokens x KV bytes/token through the "
          "prefill replica's and the decode replica's NICs, shared max-min fairly among transfers in flight, "
          f"then a fixed {LINK_LATENCY_S * 1e3:g} ms; the decode replica recomputes the last prompt token.\n")
    if "gpu" in parts:
        print(f"### GPU model\n\nStep: {describe(GPU_8B)} ({GPU_8B.source}). KV {GPU.kv_bytes_per_token // 1024} "
              f"KiB/token (Llama-3.1-8B shape, bf16). Replicas: {GPU.decode.num_kv_blocks:,} blocks of 16 tokens, "
              f"max_num_seqs {GPU.decode.max_num_seqs}; colocated and decode replicas take "
              f"{GPU.decode.max_num_batched_tokens}-token chunks, prefill replicas up to "
              f"{GPU.prefill.max_num_batched_tokens} tokens a step. SLOs: TTFT p90 <= {GPU.slo.ttft_s:g} s, ITL p99 <= "
              f"{GPU.slo.itl_s * 1e3:g} ms. Selective thresholds: {gpu_auto} = itl_safe_prompt_tokens (the longest "
              f"prompt a decode step can take next to {GPU.decode.max_num_seqs} decoding requests within "
              f"{GPU.slo.itl_s * 1e3:g} ms, plus one), and 512. One 512-token chunk step takes "
              f"{GPU_8B.step_time(512, 0) * 1e3:.1f} ms, above the ITL target by itself; a 256-token one "
              f"{GPU_8B.step_time(256, 0) * 1e3:.1f} ms.\n")
        for mix, (duration, _) in GPU_MIXES.items():
            note = f"Poisson arrivals for {duration / scale:g} s per run; no shared prefixes."
            print("\n".join(comparison_table("gpu", mix, searches, refs.get(f"gpu/{mix_name(mix)}", {}), GPU, note)))
    if "crossover" in parts:
        print("\n".join(crossover_table(searches)))
    if "cpu" in parts:
        cpu = CPU.cost
        print(f"### CPU model\n\nStep: {describe(cpu)} ({cpu.source}). KV {CPU.kv_bytes_per_token // 1024} KiB/token; "
              f"{CPU.decode.num_kv_blocks} blocks per replica; colocated and decode replicas chunk at "
              f"{CPU.decode.max_num_batched_tokens} tokens, prefill replicas step up to "
              f"{CPU.prefill.max_num_batched_tokens}. SLOs: TTFT p90 <= {CPU.slo.ttft_s:g} s, ITL p99 <= "
              f"{CPU.slo.itl_s * 1e3:g} ms; link 10 Gbit/s + {CPU.link_latency_s * 1e3:g} ms. "
              f"itl_safe_prompt_tokens here would be {cpu_auto} (the fit's attention terms left out).\n")
        for mix, (duration, _) in CPU_MIXES.items():
            note = f"Poisson arrivals for {duration / scale:g} s per run; no shared prefixes."
            print("\n".join(comparison_table("cpu", mix, searches, refs.get(f"cpu/{mix_name(mix)}", {}), CPU, note)))
    if live:
        print("\n".join(live_table(live)))
    print(f"_{runs} runs in {wall_s:.0f} s wall._")


if __name__ == "__main__":
    main()
