"""What one run is judged by, computed from its traces and its replicas' block pools.

The hit rate is counted twice on purpose: from the requests' own first-admission hits (the traces) and
from the replicas' KVCacheManager counters; the two must agree, or the simulator is wrong. It is also
bounded from above by one infinite cache shared by all (`infinite_cache_hits`), which no router can
beat. A request cut by a scale-down counts against SLO attainment, as does one that never finished."""

from __future__ import annotations

import math
from dataclasses import dataclass

from engine.core.block_hash import hash_block_chain

from .sim import SimOutcome, Trace


@dataclass(frozen=True)
class Slo:
    ttft_s: float = 2.0
    tpot_s: float = 0.25  # mean time per output token after the first


@dataclass(frozen=True)
class RunResult:
    workload: str
    router: str
    autoscaler: str
    requests: int  # that arrived
    finished: int
    dropped: int  # cut by a scale-down
    abandoned: int  # chat turns never sent because an earlier turn was cut
    unfinished: int  # still open when the run hit max_time_s
    prompt_tokens: int  # of admitted requests
    hit_tokens: int  # their prefix-cache hits, from the traces
    pool_queries: int  # the same two, from the replicas' KV-cache managers
    pool_hits: int
    bound_hits: int  # what one infinite cache would have hit of the same prompt tokens
    ttft_p50: float
    ttft_p99: float
    tpot_p50: float
    slo_attainment: float
    imbalance: float  # time-averaged max/mean of in-flight requests over routable replicas
    replica_seconds: float
    busy_fraction: float  # replica time spent stepping / replica-seconds
    scale_ups: int
    scale_downs: int
    preemptions: int
    duration_s: float  # simulated
    wall_s: float

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def hit_bound(self) -> float:
        return self.bound_hits / self.prompt_tokens if self.prompt_tokens else 0.0


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100); nan for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q / 100 * len(ordered)) - 1))]


def infinite_cache_hits(traces: list[Trace], block_size: int) -> int:
    """Prompt tokens a single cache that never evicts would have hit, over the admitted requests: each
    one's longest prefix of full blocks (its last token always computed) among the prompts of requests
    that arrived before it and the answers of those that finished before it. Generous: an upper bound."""
    events = sorted([(t.arrival, 1, i) for i, t in enumerate(traces)]
                    + [(t.finished, 0, i) for i, t in enumerate(traces) if t.finished is not None])
    seen: set = set()
    hits = 0
    for _, arriving, i in events:
        sim = traces[i].sim
        hashes = sim.block_hashes(block_size)
        if not arriving:
            seen.update(hash_block_chain(sim.prompt + sim.output, block_size, parent_hashes=hashes))
            continue
        if traces[i].cached_tokens >= 0:
            for h in hashes[: (len(sim.prompt) - 1) // block_size]:
                if h not in seen:
                    break
                hits += block_size
        seen.update(hashes)
    return hits


def summarize(outcome: SimOutcome, workload: str, router: str, autoscaler: str, slo: Slo = Slo(),
              block_size: int = 16) -> RunResult:
    traces = outcome.traces
    done = [t for t in traces if t.finished is not None]
    admitted = [t for t in traces if t.cached_tokens >= 0]
    ttft = [t.first_token - t.arrival for t in done]
    tpot = [(t.finished - t.first_token) / (len(t.sim.output) - 1) for t in done if len(t.sim.output) > 1]
    good = sum(
        1 for t in done
        if t.first_token - t.arrival <= slo.ttft_s
        and (len(t.sim.output) < 2 or (t.finished - t.first_token) / (len(t.sim.output) - 1) <= slo.tpot_s)
    )
    replica_s = sum(r.stopped_at - r.started_at for r in outcome.replicas)
    busy = sum(r.busy_s for r in outcome.replicas)
    dropped = sum(t.dropped for t in traces)
    total = len(traces) + outcome.abandoned
    return RunResult(
        workload=workload, router=router, autoscaler=autoscaler,
        requests=len(traces), finished=len(done), dropped=dropped, abandoned=outcome.abandoned,
        unfinished=len(traces) - len(done) - dropped,
        prompt_tokens=sum(len(t.sim.prompt) for t in admitted), hit_tokens=sum(t.cached_tokens for t in admitted),
        pool_queries=sum(r.prefix_cache_queries for r in outcome.replicas),
        pool_hits=sum(r.prefix_cache_hits for r in outcome.replicas),
        bound_hits=infinite_cache_hits(traces, block_size),
        ttft_p50=percentile(ttft, 50), ttft_p99=percentile(ttft, 99), tpot_p50=percentile(tpot, 50),
        slo_attainment=good / total if total else math.nan,
        imbalance=sum(outcome.imbalance_samples) / len(outcome.imbalance_samples) if outcome.imbalance_samples else 1.0,
        replica_seconds=replica_s, busy_fraction=busy / replica_s if replica_s else 0.0,
        scale_ups=outcome.scale_ups, scale_downs=outcome.scale_downs,
        preemptions=sum(t.preemptions for t in traces), duration_s=outcome.end_time, wall_s=outcome.wall_s,
    )


def live_history_blocks(outcome: SimOutcome, block_size: int = 16) -> float:
    """Time-averaged blocks of the chat histories alive (from a session's first arrival to its last
    token): the multi-turn working set, which only the run itself decides."""
    spans: dict[str, tuple[float, float, int]] = {}
    for t in outcome.traces:
        if t.finished is None:
            continue
        blocks = (len(t.sim.prompt) + len(t.sim.output)) // block_size
        start, end, size = spans.get(t.sim.group, (t.arrival, t.finished, 0))
        spans[t.sim.group] = (min(start, t.arrival), max(end, t.finished), max(size, blocks))
    if not spans or outcome.end_time <= 0:
        return 0.0
    return sum((end - start) * size for start, end, size in spans.values()) / outcome.end_time
