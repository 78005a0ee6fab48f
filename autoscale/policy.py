"""The scaling decision, as a pure core: no Ray here. The Serve adapter (autoscale/ray_policy.py) and the
cluster simulator (benchmarks/) call it unchanged.

Inputs: each running replica's KV-cache usage, waiting and running requests, the requests queued in front
of the replicas (at the handles), and how many replicas are running versus wanted (the rest are still
starting). Output: the replica count to aim for.

- Up, quickly: as soon as the average KV usage or waiting queue per replica passes its target, add
  enough replicas for the load to fit under target (at most max_upscale_step at once) - but not while
  replicas added earlier are still starting: their capacity is already on its way (Dynamo's guard).
- Down, slowly: one replica at a time, only when the load of all replicas, redistributed over one fewer,
  stays under downscale_margin x target (WVA's check), and only after that has held for
  downscale_delay_s without interruption.
- From zero: a request waiting with no replica running starts one.
- Always inside [min_replicas, max_replicas]."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class ReplicaMetrics:
    kv_cache_usage: float
    num_waiting: float
    num_running: float


@dataclass
class KVQueuePolicyConfig:
    """Every threshold is a `policy_kwargs` setting of the Serve policy."""

    target_kv_cache_usage: float = 0.75  # average KV usage per replica to stay under
    target_waiting_per_replica: float = 2.0  # average waiting requests per replica to stay under
    downscale_margin: float = 0.6  # scale down only if load on one replica fewer stays under margin x target
    downscale_delay_s: float = 30.0  # ...continuously for this long
    max_upscale_step: int = 4  # replicas added at once, at most


@dataclass
class PolicyState:
    low_since: float | None = None  # when the scale-down condition began to hold


def desired_replicas(
    metrics: list[ReplicaMetrics],
    target_replicas: int,
    queued_requests: float,
    now: float,
    state: PolicyState,
    config: KVQueuePolicyConfig,
    min_replicas: int,
    max_replicas: int,
) -> int:
    """`metrics`: one entry per running replica; `target_replicas`: the count currently aimed at (so
    target - running replicas are still starting); `queued_requests`: requests not yet on any replica."""
    running = len(metrics)
    clamp = lambda n: max(min_replicas, min(max_replicas, n))  # noqa: E731
    if running == 0:
        state.low_since = None
        if queued_requests > 0 or target_replicas > 0:
            return clamp(max(target_replicas, 1))  # cold start: one replica, or the ones already starting
        return clamp(0)
    kv = sum(m.kv_cache_usage for m in metrics)
    waiting = sum(m.num_waiting for m in metrics) + queued_requests
    needed = max(
        math.ceil(kv / config.target_kv_cache_usage - 1e-9),
        math.ceil(waiting / config.target_waiting_per_replica - 1e-9) if waiting else 0,
        1,
    )
    over = kv / running > config.target_kv_cache_usage or waiting / running > config.target_waiting_per_replica
    if over:
        state.low_since = None
        if target_replicas > running:  # replicas still starting: their capacity is on its way
            return clamp(target_replicas)
        return clamp(running + max(1, min(config.max_upscale_step, needed - running)))
    fewer = running - 1
    fits = fewer >= 1 and (
        kv / fewer <= config.downscale_margin * config.target_kv_cache_usage
        and waiting / fewer <= config.downscale_margin * config.target_waiting_per_replica
    )
    if not fits or running <= min_replicas:
        state.low_since = None
        return clamp(max(running, target_replicas))
    if state.low_since is None:
        state.low_since = now
    if now - state.low_since >= config.downscale_delay_s:
        state.low_since = None
        return clamp(fewer)
    return clamp(max(running, target_replicas))
