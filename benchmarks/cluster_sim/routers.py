"""The routers under comparison, each deciding only from what it could know in production.

What a router knows: which replicas are routable; how many of its own requests each replica has not
finished yet (a handle sees its streams end; Ray's queue-length probes report the same number for a
single ingress); the replicas' routing stats as of their last report (every stats_period_s, so stale);
and its own routing history. Only the oracle sees the replicas' true caches and load at routing time.

- round_robin: the next replica in turn.
- pow2: Ray Serve's default, two random replicas, the one with fewer ongoing requests.
- ray_prefix_tree: Ray's PrefixCacheAffinityRouter logic over Ray's own character-level PrefixTree
  (imported, not re-implemented): pow2 when ongoing max - min > imbalanced_threshold; else the replicas
  holding the longest character match of the prompt text if it covers match_rate_threshold of it, else
  the replicas with the smallest trees; the fewest ongoing requests among them wins; the prompt text is
  inserted for the chosen replica after routing.
- prefix_precise: our PrefixRouterPolicy fed the replicas' last reports, block summaries included.
- prefix_approx: the same policy without block summaries (only its own routing record).
- oracle: the same policy fed, at routing time, each replica's true cache (plus the prompts it has
  already accepted, which it will have cached by the time this request runs) and its true load: what the
  policy would do with perfect, instant stats. Not an upper bound, not even on the hit rate: it places
  requests by the policy's cost, blind spots included (on the chat shape it piles new sessions onto the
  few replicas that hold the shared system prompt, more than prefix_precise does, and their caches then
  evict live histories). The bound is metrics.infinite_cache_hits."""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass, field

from ray.llm._internal.serve.routing_policies.prefix_aware.prefix_tree import PrefixTree

from engine.core.block_hash import BlockHash, short_hash
from serve_app.routing.prefix_policy import PrefixRouterConfig, PrefixRouterPolicy, ReplicaLoad, RoutingDecision

from .replica import SimReplica
from .workloads import SimRequest

INF = float("inf")


@dataclass(frozen=True)
class ReplicaReport:
    """What a replica's record_routing_stats returned at its last stats tick."""

    reported_at: float
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    cached_blocks: frozenset[int] | None  # short hashes; None when summaries are not collected


@dataclass
class RouterView:
    replicas: list[SimReplica]  # routable now: running, not draining; in start order
    ongoing: dict[str, int]  # this router's unfinished requests per replica
    reports: dict[str, ReplicaReport]  # last routing stats per replica (absent before its first report)


@dataclass
class Router:
    name: str = "router"
    wants_summaries: bool = False  # collect block summaries at stats ticks (costly, so only on demand)
    reasons: Counter = field(default_factory=Counter)  # why requests went where (diagnostics)

    def rank(self, req: SimRequest, view: RouterView, now: float) -> list[str]:
        """Replica ids, best first. The cluster takes the first with room (max_ongoing_requests)."""
        raise NotImplementedError

    def on_routed(self, req: SimRequest, replica_id: str, now: float) -> None:
        pass

    def on_completed(self, replica_id: str, now: float) -> None:
        """One of its requests to `replica_id` ended (finished, or cut by a scale-down)."""

    def on_replicas_changed(self, added: list[str], removed: list[str], now: float) -> None:
        pass


def _by_ongoing(ids: list[str], view: RouterView) -> list[str]:
    return sorted(ids, key=lambda rid: view.ongoing.get(rid, 0))


@dataclass
class RoundRobin(Router):
    name: str = "round_robin"
    _next: int = 0

    def rank(self, req, view, now):
        ids = [r.replica_id for r in view.replicas]
        k = self._next % len(ids)
        self._next += 1
        return ids[k:] + ids[:k]


@dataclass
class Pow2(Router):
    name: str = "pow2"
    seed: int = 0
    rng: random.Random = field(init=False)

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)

    def rank(self, req, view, now):
        ids = [r.replica_id for r in view.replicas]
        two = self.rng.sample(ids, min(2, len(ids)))
        rest = [rid for rid in ids if rid not in two]
        return _by_ongoing(two, view) + _by_ongoing(rest, view)  # the rest only if both are full


@dataclass
class RayPrefixTree(Pow2):
    name: str = "ray_prefix_tree"
    imbalanced_threshold: float = 10
    match_rate_threshold: float = 0.1
    tree: PrefixTree = field(init=False)

    def __post_init__(self) -> None:
        super().__post_init__()
        self.tree = PrefixTree()

    def on_replicas_changed(self, added, removed, now):
        if added:
            self.tree.add_tenants(added, now)
        if removed:
            self.tree.remove_tenants(removed)

    def rank(self, req, view, now):
        fallback = super().rank(req, view, now)  # Ray computes the pow2 choice first, too
        ids = [r.replica_id for r in view.replicas]
        queues = [view.ongoing.get(rid, 0) for rid in ids]
        if max(queues) - min(queues) > self.imbalanced_threshold:
            self.reasons["imbalanced"] += 1
            return fallback
        text = req.text
        matched, tenants = self.tree.prefix_match(text, ids)
        if len(matched) / len(text) < self.match_rate_threshold:
            chosen = self.tree.get_smallest_tenants() or []
            self.reasons["smallest_tenants"] += 1
        else:
            chosen = tenants or []
            self.reasons["prefix"] += 1
        chosen = [rid for rid in chosen if rid in view.ongoing]
        if not chosen:
            return fallback
        first = _by_ongoing(chosen, view)
        return first + [rid for rid in fallback if rid not in first]

    def on_routed(self, req, replica_id, now):
        self.tree.insert(req.text, replica_id, now)


@dataclass
class PrefixPolicyRouter(Router):
    """Our router's pure core, fed exactly what the Ray adapter feeds it (serve_app/routing/ray_router.py)."""

    name: str = "prefix_precise"
    precise: bool = True
    block_size: int = 16
    policy: PrefixRouterPolicy = field(init=False)
    last_decision: RoutingDecision | None = field(default=None, init=False)  # of the latest rank()

    def __post_init__(self) -> None:
        self.wants_summaries = self.precise
        self.policy = PrefixRouterPolicy(PrefixRouterConfig(block_size=self.block_size))

    def _load(self, replica: SimReplica, view: RouterView, now: float) -> ReplicaLoad:
        report = view.reports.get(replica.replica_id)
        if report is None:  # not reported yet: the adapter sees empty stats
            return ReplicaLoad(replica.replica_id, stats_age_s=INF)
        return ReplicaLoad(replica.replica_id, report.num_running, report.num_waiting, report.kv_cache_usage,
                           report.cached_blocks if self.precise else None, now - report.reported_at)

    def rank(self, req, view, now):
        loads = [self._load(r, view, now) for r in view.replicas]
        decision = self.last_decision = self.policy.route(req.block_hashes(self.block_size), loads, now)
        self.reasons[f"{decision.reason}/{decision.source}"] += 1
        return decision.ranked

    def on_routed(self, req, replica_id, now):
        self.policy.record(req.block_hashes(self.block_size), replica_id, now)

    def on_completed(self, replica_id, now):
        self.policy.complete(replica_id)

    def on_replicas_changed(self, added, removed, now):
        for rid in removed:
            self.policy.forget_replica(rid)


class _LiveBlocks:
    """A replica's true cache (and accepted prompts) as the policy's `cached_blocks`: the policy only asks
    about the request's own short hashes, which map back to full ones."""

    def __init__(self, replica: SimReplica, full: dict[int, BlockHash]) -> None:
        self.replica, self.full = replica, full

    def __contains__(self, short: int) -> bool:
        h = self.full.get(short)
        return h is not None and self.replica.holds(h)


@dataclass
class Oracle(PrefixPolicyRouter):
    """Our policy fed the truth at routing time, as if every replica reported at that instant: its true
    cache (plus the prompts it has accepted, which it will hold by the time this request runs) and its
    true waiting / running requests and KV usage. It records nothing: it needs no memory."""

    name: str = "oracle"

    def __post_init__(self) -> None:
        super().__post_init__()
        self.wants_summaries = False

    def rank(self, req, view, now):
        hashes = req.block_hashes(self.block_size)
        full = {short_hash(h): h for h in hashes}
        loads = [ReplicaLoad(r.replica_id, r.num_running, r.num_waiting, r.kv_cache_usage, _LiveBlocks(r, full), 0.0)
                 for r in view.replicas]
        decision = self.last_decision = self.policy.route(hashes, loads, now)
        self.reasons[f"{decision.reason}/{decision.source}"] += 1
        return decision.ranked

    def on_routed(self, req, replica_id, now):
        pass

    def on_completed(self, replica_id, now):
        pass


@dataclass
class LeastLoaded(Router):
    """Decode replicas of a P/D fleet, by load and KV usage (issue 15's app design): fewest ongoing requests
    (the handle's own count, exact; it includes requests still being prefilled elsewhere, which will land
    here), replicas whose last report showed a nearly full KV cache last; ties by the lower reported KV
    usage, then in turn, so an idle fleet is filled evenly."""

    name: str = "least_loaded"
    kv_full_usage: float = 0.92  # as PrefixRouterConfig: above this a replica would evict or preempt
    _next: int = 0

    def rank(self, req, view, now):
        ids = [r.replica_id for r in view.replicas]
        k = self._next % len(ids)
        self._next += 1

        def key(rid: str) -> tuple:
            report = view.reports.get(rid)
            kv = report.kv_cache_usage if report else 0.0
            return kv >= self.kv_full_usage, view.ongoing.get(rid, 0), kv

        return sorted(ids[k:] + ids[:k], key=key)


ROUTERS = ("round_robin", "pow2", "ray_prefix_tree", "prefix_approx", "prefix_precise", "oracle")


def make_router(name: str, seed: int = 0, block_size: int = 16) -> Router:
    if name == "round_robin":
        return RoundRobin()
    if name == "pow2":
        return Pow2(seed=seed)
    if name == "ray_prefix_tree":
        return RayPrefixTree(seed=seed)
    if name == "prefix_precise":
        return PrefixPolicyRouter(block_size=block_size)
    if name == "prefix_approx":
        return PrefixPolicyRouter(name="prefix_approx", precise=False, block_size=block_size)
    if name == "oracle":
        return Oracle(block_size=block_size)
    raise ValueError(f"unknown router {name!r}; one of {ROUTERS}")
