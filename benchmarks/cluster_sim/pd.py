"""Disaggregated prefill/decode (P/D) on simulated replicas: a prefill pool, a decode pool, the KV moved
between them over a modelled link, and the per-request choice of path.

Modes, at a fixed number of replicas (issue 15):
- colocated: one pool; every replica prefills (chunked: at most max_num_batched_tokens per step) and
  decodes. Its replicas are the decode pool's code path with no prefill pool.
- always: every prompt is prefilled on the prefill pool.
- selective: a prompt goes to the prefill pool only if its uncached part on the chosen prefill replica, as
  the router sees it, is at least min_uncached_prompt_tokens (serve_app/disaggregation/policy.py); the
  rest are prefilled on their decode replica, inside its token budget, exactly as colocated.

The path of a request, as the app runs it (Ray Serve LLM 2.60's decode-as-orchestrator,
reference/scale_out.md B2):
1. The ingress picks a decode replica by load and KV usage (routers.LeastLoaded). The request is in flight
   there, as that replica's ongoing request, from arrival to its last token: the decode replica
   orchestrates.
2. The decode replica asks our prefix router (PrefixRouterPolicy, the app's core) for a prefill replica,
   and the decision function whether to use it. One router instance stands for the decode replicas'
   routers (each decode replica has its own in the app; with fresh reports they agree).
3. The prefill replica runs the request with max_tokens=1; the token it samples is thrown away. When that
   step ends, the answer goes back to the decode replica, which allocates blocks for the prompt (after its
   own prefix-cache hit; if the pool is short, the pull waits, in order, until steps free blocks) and
   pulls the KV: bytes = tokens x bytes per token, through the prefill replica's NIC (sending) and the
   decode replica's NIC (receiving), each full duplex at the link's bandwidth. Transfers in flight share
   the NICs max-min fairly (what TCP or RDMA flows converge to; `Fabric`), so a lone transfer takes
   bytes / bandwidth and concurrent ones slow each other without wasting a NIC's idle time. The KV is
   usable a fixed per-transfer latency after its last byte (the answer's hop and the pull's setup).
   The prefill replica's blocks are freed when its step ends (they stay in its prefix cache): its pool
   is large next to what is in transit, so holding them for the transfer would change nothing here.
4. The decode replica recomputes the last prompt token (its logits give the first token) and decodes.

Timing comes from the step-cost model (fit.py: the CPU model fitted to the engine, or the GPU-shaped 8B
one); everything else is the engine's own scheduler and block pool (replica.py)."""

from __future__ import annotations

import heapq
import itertools
import math
import time
from collections import deque
from dataclasses import dataclass, field

from serve_app.disaggregation.policy import KVLink, should_disaggregate

from .fit import StepCostModel
from .metrics import percentile
from .replica import ReplicaConfig, SimReplica
from .routers import LeastLoaded, ReplicaReport, Router, RouterView, make_router
from .workloads import SimRequest, Workload

MODES = ("colocated", "always", "selective")


@dataclass(frozen=True)
class PDConfig:
    mode: str = "selective"
    num_prefill: int = 1  # 0 for colocated
    num_decode: int = 3  # colocated: the whole fleet
    min_uncached_prompt_tokens: int = 512  # selective only
    prefill_replica: ReplicaConfig = ReplicaConfig()
    decode_replica: ReplicaConfig = ReplicaConfig()  # colocated replicas too
    link: KVLink = KVLink(100.0)
    kv_bytes_per_token: int = 128 * 1024
    prefill_router: str = "prefix_precise"
    stats_period_s: float = 1.0  # routing stats (request_routing_stats_period_s)
    max_time_s: float = math.inf  # requests still open then count as unfinished

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode {self.mode!r}: one of {MODES}")
        if (self.mode == "colocated") != (self.num_prefill == 0):
            raise ValueError("colocated has no prefill pool; always and selective need one")
        if self.num_decode < 1:
            raise ValueError("the decode pool needs a replica")


@dataclass
class PDTrace:
    sim: SimRequest
    arrival: float
    decode_replica: str
    prefill_replica: str | None = None  # None: prefilled on the decode replica
    uncached_tokens: int = 0  # the prompt minus what the chosen prefill replica caches, as the router saw it
    prefill_done: float | None = None  # the prefill replica's step that sampled (and dropped) a token
    blocks_reserved: float | None = None  # blocks found on the decode replica; the pull may start
    transfer_tokens: int = 0
    transfer_start: float | None = None  # its first byte on the wire
    wire_done: float | None = None  # its last byte received
    kv_ready: float | None = None  # usable on the decode replica: wire_done + the link's latency
    token_times: list[float] = field(default_factory=list)
    finished: float | None = None

    @property
    def disaggregated(self) -> bool:
        return self.prefill_replica is not None

    @property
    def first_token(self) -> float | None:
        return self.token_times[0] if self.token_times else None

    @property
    def ttft(self) -> float | None:
        return self.token_times[0] - self.arrival if self.token_times else None

    def gaps(self) -> list[float]:
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:])]


@dataclass
class PDOutcome:
    traces: list[PDTrace]
    prefill: list[SimReplica]
    decode: list[SimReplica]
    end_time: float
    wall_s: float


@dataclass
class _Flow:
    key: str
    remaining: float  # bytes
    nics: tuple[str, str]  # sending, receiving
    rate: float = 0.0  # bytes/s


class Fabric:
    """KV transfers in flight, sharing NIC bandwidth max-min fairly (progressive filling: the most crowded
    NIC splits its bandwidth evenly, its flows are fixed at that share, and what they leave on their other
    NIC goes to the rest). Rates change only when a transfer starts or ends."""

    def __init__(self, bandwidth_bytes_s: float) -> None:
        self.bandwidth = bandwidth_bytes_s
        self.flows: dict[str, _Flow] = {}
        self._at = 0.0

    def _advance(self, now: float) -> None:
        for f in self.flows.values():
            f.remaining -= f.rate * (now - self._at)
        self._at = now

    def _share(self) -> None:
        capacity: dict[str, float] = {}
        crowd: dict[str, int] = {}
        for f in self.flows.values():
            for nic in f.nics:
                capacity[nic] = self.bandwidth
                crowd[nic] = crowd.get(nic, 0) + 1
        unfixed = dict(self.flows)
        while unfixed:
            nic = min((n for n in crowd if crowd[n]), key=lambda n: (capacity[n] / crowd[n], n))
            share = capacity[nic] / crowd[nic]
            for key in [k for k, f in unfixed.items() if nic in f.nics]:
                f = unfixed.pop(key)
                f.rate = share
                for n in f.nics:
                    capacity[n] -= share
                    crowd[n] -= 1

    def add(self, now: float, key: str, num_bytes: float, nics: tuple[str, str]) -> None:
        self._advance(now)
        self.flows[key] = _Flow(key, num_bytes, nics)
        self._share()

    def remove(self, now: float, key: str) -> None:
        self._advance(now)
        del self.flows[key]
        self._share()

    def next_done(self) -> tuple[float, str] | None:
        """The next transfer to finish at current rates, and when."""
        if not self.flows:
            return None
        f = min(self.flows.values(), key=lambda f: (f.remaining / f.rate, f.key))
        return self._at + max(0.0, f.remaining) / f.rate, f.key


class PDCluster:
    def __init__(self, workload: Workload, cost: StepCostModel, config: PDConfig) -> None:
        self.workload, self.cost, self.config = workload, cost, config
        self.prefill = [self._replica(f"p{i}", config.prefill_replica) for i in range(config.num_prefill)]
        self.decode = [self._replica(f"d{i}", config.decode_replica) for i in range(config.num_decode)]
        self.by_id = {r.replica_id: r for r in self.prefill + self.decode}
        self._prefill_ids = {r.replica_id for r in self.prefill}
        self.p_router: Router = make_router(config.prefill_router, block_size=config.prefill_replica.block_size)
        self.d_router: Router = LeastLoaded()
        self.ongoing = {rid: 0 for rid in self.by_id}
        self.reports: dict[str, ReplicaReport] = {}
        self.traces: dict[str, PDTrace] = {}
        self.pending: dict[str, deque[PDTrace]] = {r.replica_id: deque() for r in self.decode}
        self.fabric = Fabric(config.link.bandwidth_gbit_s * 1e9 / 8)
        self._fabric_version = 0  # a wire_done event is stale once a transfer started or ended after it
        self._heap: list[tuple[float, int, str, object]] = []
        self._seq = itertools.count()
        self._open = 0

    def _replica(self, rid: str, config: ReplicaConfig) -> SimReplica:
        replica = SimReplica(rid, config, self.cost, 0.0, 0.0)
        replica.state = "running"  # a fixed fleet, warm from the start
        return replica

    def run(self) -> PDOutcome:
        start_wall = time.perf_counter()
        for sim in self.workload.requests:
            self._push(sim.arrival, "arrive", sim)
            self._open += 1
        self._push(0.0, "stats", None)
        now = 0.0
        while self._heap and self._open > 0:
            now, _, kind, obj = heapq.heappop(self._heap)
            if now > self.config.max_time_s:
                break
            getattr(self, f"_on_{kind}")(obj, now)
        return PDOutcome(list(self.traces.values()), self.prefill, self.decode, now, time.perf_counter() - start_wall)

    def _push(self, t: float, kind: str, obj: object) -> None:
        heapq.heappush(self._heap, (t, next(self._seq), kind, obj))

    def _view(self, pool: list[SimReplica]) -> RouterView:
        return RouterView(pool, {r.replica_id: self.ongoing[r.replica_id] for r in pool}, self.reports)

    def _start_step(self, replica: SimReplica, now: float) -> None:
        if not replica.in_step:
            duration = replica.start_step()
            if duration is not None:
                self._push(now + duration, "step_end", replica)

    # --- a request's path ----------------------------------------------------------------------------
    def _on_arrive(self, sim: SimRequest, now: float) -> None:
        cfg = self.config
        did = self.d_router.rank(sim, self._view(self.decode), now)[0]
        self.ongoing[did] += 1
        self.d_router.on_routed(sim, did, now)
        trace = self.traces[sim.request_id] = PDTrace(sim, now, did)
        if self.prefill:
            ranked = self.p_router.rank(sim, self._view(self.prefill), now)
            decision = getattr(self.p_router, "last_decision", None)
            matched = decision.matched_blocks if decision else 0
            trace.uncached_tokens = len(sim.prompt) - matched * cfg.prefill_replica.block_size
            if cfg.mode == "always" or should_disaggregate(trace.uncached_tokens, cfg.min_uncached_prompt_tokens):
                pid = ranked[0]
                leg = SimRequest(sim.request_id, sim.arrival, sim.group, sim.prompt, sim.output[:1],
                                 _hashes=sim.block_hashes(cfg.prefill_replica.block_size))
                self.by_id[pid].add(leg, now)
                self.ongoing[pid] += 1
                self.p_router.on_routed(sim, pid, now)
                trace.prefill_replica = pid
                self._start_step(self.by_id[pid], now)
                return
        self.by_id[did].add(sim, now)
        self._start_step(self.by_id[did], now)

    def _on_step_end(self, replica: SimReplica, now: float) -> None:
        result = replica.finish_step()
        rid = replica.replica_id
        if rid in self._prefill_ids:  # its requests end with their (dropped) token
            for done in result.finished:
                trace = self.traces[done.sim.request_id]
                trace.prefill_done = now
                self.ongoing[rid] -= 1
                self.p_router.on_completed(rid, now)
                self._pull(trace, now)
        else:
            for sim in result.tokens:
                self.traces[sim.request_id].token_times.append(now)
            for done in result.finished:
                self.traces[done.sim.request_id].finished = now
                self.ongoing[rid] -= 1
                self.d_router.on_completed(rid, now)
                self._open -= 1
            if result.finished:
                self._reserve_pending(replica, now)
        self._start_step(replica, now)

    def _pull(self, trace: PDTrace, now: float) -> None:
        self.pending[trace.decode_replica].append(trace)
        self._reserve_pending(self.by_id[trace.decode_replica], now)

    def _reserve_pending(self, replica: SimReplica, now: float) -> None:
        """Blocks for waiting pulls, in order; the first that does not fit waits for the next freed ones."""
        queue = self.pending[replica.replica_id]
        while queue:
            trace = queue[0]
            tokens = replica.reserve_remote(trace.sim, now)
            if tokens is None:
                return
            queue.popleft()
            trace.blocks_reserved = now
            self._transfer(trace, tokens, now)

    def _transfer(self, trace: PDTrace, tokens: int, now: float) -> None:
        trace.transfer_tokens, trace.transfer_start = tokens, now
        nics = (f"{trace.prefill_replica}/send", f"{trace.decode_replica}/recv")
        self.fabric.add(now, trace.sim.request_id, tokens * self.config.kv_bytes_per_token, nics)
        self._next_wire_done()

    def _next_wire_done(self) -> None:
        self._fabric_version += 1
        nxt = self.fabric.next_done()
        if nxt is not None:
            self._push(nxt[0], "wire_done", (self._fabric_version, nxt[1]))

    def _on_wire_done(self, event: tuple[int, str], now: float) -> None:
        version, request_id = event
        if version != self._fabric_version:
            return
        self.fabric.remove(now, request_id)
        self._next_wire_done()
        trace = self.traces[request_id]
        trace.wire_done = now
        self._push(now + self.config.link.latency_s, "kv_ready", trace)

    def _on_kv_ready(self, trace: PDTrace, now: float) -> None:
        trace.kv_ready = now
        replica = self.by_id[trace.decode_replica]
        replica.activate_remote(trace.sim.request_id)
        self._start_step(replica, now)

    def _on_stats(self, _: object, now: float) -> None:
        for r in self.prefill + self.decode:
            summaries = r in self.prefill and self.p_router.wants_summaries
            self.reports[r.replica_id] = ReplicaReport(now, r.num_running, r.num_waiting, r.kv_cache_usage,
                                                       r.cache_summary() if summaries else None)
        self._push(now + self.config.stats_period_s, "stats", None)


def simulate_pd(workload: Workload, cost: StepCostModel, config: PDConfig) -> PDOutcome:
    return PDCluster(workload, cost, config).run()


# --- what a run is judged by ------------------------------------------------------------------------------

@dataclass(frozen=True)
class PDSlo:
    """Per request: TTFT within ttft_s, and the itl_percentile of its own inter-token gaps within itl_s."""

    ttft_s: float = 1.0
    itl_s: float = 0.050
    itl_percentile: float = 99.0


@dataclass(frozen=True)
class PDResult:
    requests: int
    finished: int
    good: int  # finished and within both SLOs
    window_s: float  # the arrivals' span: goodput = good / window_s
    disaggregated: int
    ttft_p50: float
    ttft_p90: float
    ttft_p99: float
    itl_p50: float  # over every inter-token gap of every request
    itl_p99: float
    transfer_p50: float  # prefill answer to usable KV (NIC queueing and latency included), disaggregated only
    prefill_busy: float  # fraction of the run the prefill pool spent stepping
    decode_busy: float

    @property
    def goodput(self) -> float:
        return self.good / self.window_s

    @property
    def attainment(self) -> float:
        return self.good / self.requests if self.requests else math.nan


def meets(trace: PDTrace, slo: PDSlo) -> bool:
    if trace.finished is None:
        return False
    gaps = trace.gaps()
    return trace.ttft <= slo.ttft_s and (not gaps or percentile(gaps, slo.itl_percentile) <= slo.itl_s)


def summarize_pd(outcome: PDOutcome, window_s: float, slo: PDSlo = PDSlo(), group: str | None = None) -> PDResult:
    traces = [t for t in outcome.traces if group is None or t.sim.group == group]
    ttft = [t.ttft for t in traces if t.ttft is not None]
    gaps = [g for t in traces for g in t.gaps()]
    moved = [t.kv_ready - t.prefill_done for t in traces if t.kv_ready is not None]
    span = outcome.end_time or math.inf  # no request at all: nothing ran
    busy = lambda pool: sum(r.busy_s for r in pool) / (len(pool) * span) if pool else 0.0  # noqa: E731
    return PDResult(
        requests=len(traces), finished=sum(t.finished is not None for t in traces),
        good=sum(meets(t, slo) for t in traces), window_s=window_s,
        disaggregated=sum(t.disaggregated for t in traces),
        ttft_p50=percentile(ttft, 50), ttft_p90=percentile(ttft, 90), ttft_p99=percentile(ttft, 99),
        itl_p50=percentile(gaps, 50), itl_p99=percentile(gaps, 99), transfer_p50=percentile(moved, 50),
        prefill_busy=busy(outcome.prefill), decode_busy=busy(outcome.decode),
    )
