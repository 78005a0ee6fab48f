"""The prefix-affinity routing decision, as a pure core: no Ray here. The Ray adapter
(serve_app/routing/ray_router.py) and the cluster simulator (benchmarks/) call it unchanged.

A request arrives with its prompt's chained block hashes (engine/core/block_hash.py). For each replica we
estimate how many of those blocks, from block 0, it already holds: precisely, from the summary of cached
block hashes the replica reports (when fresh enough), else approximately, from this router's own record
of where it sent which prefixes (aged, LRU-bounded). Either way the prompts of this router's requests
still in flight there count as held: their blocks are computed or about to be, and a running request's
blocks cannot be evicted, yet a report taken before they were computed cannot show them. The replica
with the lowest cost wins:

    cost = tokens it would still have to prefill (x kv_full_token_factor when its KV cache is nearly
             full: each block stored there evicts another prefix's block or preempts a request)
           + waiting_cost_tokens x requests waiting there + running_cost_tokens x requests running there
           + adapter_miss_cost_tokens if the request names a LoRA adapter the replica does not hold

A request's LoRA adapter is already in its block hashes (its digest is an extra key of the first block),
so cached prefixes never match across adapters; the adapter term makes a replica holding the adapter
(as its last report says, or because this router sent it a request for it since) win over one that
would first read it from disk and take a device slot from another adapter, unless it is busier.

Replica reports are up to a stats period old; requests this router sent since are counted too (in
flight until Serve reports them completed), so a burst does not pile onto one replica that still
reports an empty queue.

Guards learned from the anchors' bugs (reference/routing_autoscaling.md, section 8):
- a cache miss is not sent to the emptiest cache but balanced by load, and among the least loaded by
  rendezvous hashing of the prompt's first block, so a new shared prefix lands on one replica instead of
  being prefilled everywhere, and every ingress replica picks the same one;
- a hot prefix spills: its holder's queue raises its cost until another replica wins and caches it too;
- prompts shorter than min_prefix_blocks skip affinity;
- stats older than max_stats_age_s are not trusted: the approximate record takes over;
- ties break deterministically (the same stats give the same choice on every ingress replica)."""

from __future__ import annotations

import hashlib
from collections import Counter, OrderedDict, deque
from dataclasses import dataclass, field

from engine.core.block_hash import short_hash


@dataclass(frozen=True)
class ReplicaLoad:
    replica_id: str
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    cached_blocks: frozenset[int] | None = None  # short hashes of the blocks it holds; None: not reported
    stats_age_s: float = 0.0
    adapters: frozenset[str] | None = None  # LoRA adapters it holds; None: not reported


@dataclass
class RoutingDecision:
    ranked: list[str]  # replica ids, best first
    matched_blocks: int  # prompt blocks the first choice is estimated to hold
    reason: str  # "prefix" | "load" | "short_prompt" | "spill"
    source: str  # where matched_blocks came from: "precise" | "approximate" | "none"
    # Prompt blocks each replica is estimated to hold (when Serve falls through to a later choice, the
    # P/D orchestrator asks what that one holds).
    matched_by_replica: dict[str, int] = field(default_factory=dict)


@dataclass
class PrefixRouterConfig:
    """Every knob is a `request_router_kwargs` setting of the `prefix` router."""

    block_size: int = 16  # tokens per block: the engine's block_size
    affinity: bool = True  # False: route by load and KV usage alone (a decode pool: its prompts come prefilled)
    min_prefix_blocks: int = 2  # prompts with fewer full blocks are routed by load alone
    waiting_cost_tokens: float = 256.0  # a request queued ahead delays us like prefilling this many tokens
    running_cost_tokens: float = 32.0  # a running request slows each step a little
    kv_full_usage: float = 0.92  # above this KV usage a replica would evict or preempt
    kv_full_token_factor: float = 2.0  # ...so each token it must newly store there costs this much more
    max_stats_age_s: float = 5.0  # older replica reports are not trusted
    approx_ttl_s: float = 300.0  # the router's own record forgets a routing after this long
    approx_capacity_blocks: int = 200_000  # per replica, LRU
    adapter_miss_cost_tokens: float = 512.0  # a replica without the request's LoRA adapter must load it first


@dataclass
class _ApproxIndex:
    """Where this router sent which blocks: short hash -> {replica: last time}, LRU-bounded per replica."""

    ttl_s: float
    capacity: int
    holders: dict[int, dict[str, float]] = field(default_factory=dict)
    lru: dict[str, OrderedDict] = field(default_factory=dict)

    def record(self, hashes: list[int], replica: str, now: float) -> None:
        order = self.lru.setdefault(replica, OrderedDict())
        for h in hashes:
            self.holders.setdefault(h, {})[replica] = now
            order[h] = None
            order.move_to_end(h)
        while len(order) > self.capacity:
            old, _ = order.popitem(last=False)
            holders = self.holders.get(old)
            if holders is not None:
                holders.pop(replica, None)
                if not holders:
                    del self.holders[old]

    def holds(self, h: int, replica: str, now: float, since: float | None = None) -> bool:
        """Sent there within the TTL (and, with `since`, after that time)."""
        seen = self.holders.get(h, {}).get(replica)
        return seen is not None and now - seen <= self.ttl_s and (since is None or seen >= since)

    def forget(self, replica: str) -> None:
        for h in self.lru.pop(replica, ()):
            holders = self.holders.get(h)
            if holders is not None:
                holders.pop(replica, None)
                if not holders:
                    del self.holders[h]


def _rendezvous(key: int, replica_id: str) -> int:
    return int.from_bytes(hashlib.blake2b(f"{key}:{replica_id}".encode(), digest_size=8).digest(), "little")


class PrefixRouterPolicy:
    def __init__(self, config: PrefixRouterConfig | None = None) -> None:
        self.config = config or PrefixRouterConfig()
        self._approx = _ApproxIndex(self.config.approx_ttl_s, self.config.approx_capacity_blocks)
        # Per replica, this router's open requests (send time, short hashes, oldest first) and their blocks.
        self._in_flight: dict[str, deque[tuple[float, list[int]]]] = {}
        self._in_flight_blocks: dict[str, Counter[int]] = {}
        self._adapter_sent: dict[tuple[str, str], float] = {}  # (replica, adapter) -> last routing there

    def route(self, block_hashes: list[int], replicas: list[ReplicaLoad], now: float,
              adapter: str | None = None) -> RoutingDecision:
        """Rank replicas for a prompt's blocks; `adapter`: the LoRA adapter the request names, if any."""
        if not replicas:
            return RoutingDecision([], 0, "load", "none")
        cfg = self.config
        hashes = [short_hash(h) for h in block_hashes]
        key = hashes[0] if hashes else 0
        if len(hashes) < cfg.min_prefix_blocks or not cfg.affinity:
            ranked = sorted(replicas, key=lambda r: (self._load_cost(r, now) + self._kv_cost(r, len(hashes))
                                                     + self._adapter_cost(r, adapter, now),
                                                     _rendezvous(key, r.replica_id)))
            return RoutingDecision([r.replica_id for r in ranked], 0, "short_prompt" if cfg.affinity else "load",
                                   "none")
        scored = []
        for r in replicas:
            matched, source = self._matched(hashes, r, now)
            uncached = (len(hashes) - matched) * cfg.block_size
            if r.kv_cache_usage >= cfg.kv_full_usage:
                uncached *= cfg.kv_full_token_factor
            cost = uncached + self._load_cost(r, now) + self._adapter_cost(r, adapter, now)
            scored.append((cost, _rendezvous(key, r.replica_id), r, matched, source))
        scored.sort(key=lambda s: (s[0], s[1]))
        _, _, best, matched, source = scored[0]
        most = max(s[3] for s in scored)
        if most == 0:
            reason = "load"
        elif matched == most:
            reason = "prefix"
        else:
            reason = "spill"  # a holder exists but is too busy: this one will cache the prefix too
        return RoutingDecision([s[2].replica_id for s in scored], matched, reason, source if matched else "none",
                               {s[2].replica_id: s[3] for s in scored})

    def record(self, block_hashes: list[int], replica_id: str, now: float, adapter: str | None = None) -> None:
        """The request went to `replica_id`: from now on it (approximately) holds the prompt's blocks and
        its adapter, and the request is in flight there until `complete`."""
        if adapter is not None:
            if len(self._adapter_sent) > 65536:  # forget the oldest routings rather than grow without bound
                cutoff = now - self.config.approx_ttl_s
                self._adapter_sent = {k: t for k, t in self._adapter_sent.items() if t > cutoff}
            self._adapter_sent[(replica_id, adapter)] = now
        hashes = [short_hash(h) for h in block_hashes]
        self._approx.record(hashes, replica_id, now)
        self._in_flight.setdefault(replica_id, deque()).append((now, hashes))
        self._in_flight_blocks.setdefault(replica_id, Counter()).update(hashes)

    def record_sent(self, block_hashes: list[int], replica_id: str, now: float, adapter: str | None = None) -> None:
        """`record` for a request that reached the replica without Serve (HAProxy forwarded it after the
        ingress request router picked it: serve_app/routing/ingress_router.py), so that nobody reports its end:
        it counts as in flight until a report taken after it is trusted to show it, max_stats_age_s later."""
        self.record(block_hashes, replica_id, now, adapter)
        horizon = now - self.config.max_stats_age_s
        for replica, sent in self._in_flight.items():
            while sent and sent[0][0] < horizon:
                self.complete(replica)

    def complete(self, replica_id: str) -> None:
        """One of this router's requests to `replica_id` ended. Serve does not say which, so the oldest
        is taken: a mismatch only swaps which of two prompts sent there still counts as held."""
        sent = self._in_flight.get(replica_id)
        if sent:
            _, hashes = sent.popleft()
            blocks = self._in_flight_blocks[replica_id]
            blocks.subtract(hashes)
            for h in hashes:
                if blocks[h] <= 0:
                    blocks.pop(h, None)

    def forget_replica(self, replica_id: str) -> None:
        self._adapter_sent = {k: t for k, t in self._adapter_sent.items() if k[0] != replica_id}
        self._approx.forget(replica_id)
        self._in_flight.pop(replica_id, None)
        self._in_flight_blocks.pop(replica_id, None)

    def holds_adapter(self, r: ReplicaLoad, adapter: str, now: float) -> bool:
        """In its last report, or sent there since (a report older than the routing cannot show it yet)."""
        if r.adapters is not None and adapter in r.adapters:
            return True
        sent = self._adapter_sent.get((r.replica_id, adapter))
        if sent is None:
            return False
        horizon = self.config.approx_ttl_s if r.adapters is None or r.stats_age_s > self.config.max_stats_age_s \
            else r.stats_age_s
        return sent >= now - horizon

    def _adapter_cost(self, r: ReplicaLoad, adapter: str | None, now: float) -> float:
        if adapter is None or self.holds_adapter(r, adapter, now):
            return 0.0
        return self.config.adapter_miss_cost_tokens

    def _load_cost(self, r: ReplicaLoad, now: float) -> float:
        cfg = self.config
        waiting, running = r.num_waiting, r.num_running
        # Requests sent after the report was taken are not in it yet: count them as waiting.
        newer = sum(1 for t, _ in self._in_flight.get(r.replica_id, ()) if t > now - r.stats_age_s)
        if r.stats_age_s == float("inf"):  # never reported: what this router has in flight there
            newer = len(self._in_flight.get(r.replica_id, ()))
        return cfg.waiting_cost_tokens * (waiting + newer) + cfg.running_cost_tokens * running

    def _kv_cost(self, r: ReplicaLoad, num_blocks: int) -> float:
        """Routed by load alone, a nearly full KV cache still costs: the prompt's blocks would evict or
        preempt there."""
        cfg = self.config
        if r.kv_cache_usage < cfg.kv_full_usage:
            return 0.0
        return num_blocks * cfg.block_size * (cfg.kv_full_token_factor - 1)

    def _matched(self, hashes: list[int], r: ReplicaLoad, now: float) -> tuple[int, str]:
        """Blocks of the prompt, from block 0, the replica holds; and which knowledge said so. A fresh
        report, with the prompts still in flight there, wins; only routings made after it (which it
        cannot show yet) may extend it."""
        since = None
        precise = 0
        if r.cached_blocks is not None and r.stats_age_s <= self.config.max_stats_age_s:
            in_flight = self._in_flight_blocks.get(r.replica_id, ())
            for h in hashes:
                if h not in r.cached_blocks and h not in in_flight:
                    break
                precise += 1
            since = now - r.stats_age_s
        approx = 0
        for h in hashes:
            if not self._approx.holds(h, r.replica_id, now, since):
                break
            approx += 1
        if since is not None and precise >= approx:
            return precise, "precise"
        return approx, "approximate"
