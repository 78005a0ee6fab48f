"""The scaling decision, as a pure core: no Ray here. The Serve adapter (autoscale/ray_policy.py) and the
cluster simulator (benchmarks/) call it unchanged.

Inputs: each running replica's KV-cache usage, waiting and running requests, prompt tokens still to
prefill and recent TTFT, the requests queued in front of the replicas (at the handles), and how many
replicas are running versus wanted (the rest are still starting). Output: the replica count to aim for.
Which signals count is the config's choice: KV usage and waiting requests for a decode (or colocated)
pool, queued prefill tokens and TTFT for a prefill pool.

- Up, quickly: as soon as the average of any signal per replica passes its target, add
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
    queued_prefill_tokens: float = 0.0  # prompt tokens admitted or waiting but not yet computed
    ttft_s: float = 0.0  # the replica's recent time to first token (p90 over its last seconds)


@dataclass
class KVQueuePolicyConfig:
    """Every threshold is a `policy_kwargs` setting of the Serve policy. A target set to None leaves its
    signal out: a prefill pool scales on queued prefill tokens and TTFT, a decode pool (or a colocated
    one) on KV usage and waiting requests."""

    target_kv_cache_usage: float | None = 0.75  # average KV usage per replica to stay under
    target_waiting_per_replica: float | None = 2.0  # average waiting requests per replica to stay under
    target_queued_prefill_tokens: float | None = None  # average prompt tokens still to prefill per replica
    target_ttft_s: float | None = None  # average recent TTFT per replica
    downscale_margin: float = 0.6  # scale down only if load on one replica fewer stays under margin x target
    downscale_delay_s: float = 30.0  # ...continuously for this long
    max_upscale_step: int = 4  # replicas added at once, at most

    def __post_init__(self) -> None:
        targets = (self.target_kv_cache_usage, self.target_waiting_per_replica, self.target_queued_prefill_tokens,
                   self.target_ttft_s)
        if all(t is None for t in targets):
            raise ValueError("policy_kwargs: every target is None; set at least one signal to scale on")


@dataclass
class PolicyState:
    low_since: float | None = None  # when the scale-down condition began to hold


def _signals(metrics: list[ReplicaMetrics], queued_requests: float,
             config: KVQueuePolicyConfig) -> list[tuple[float, float]]:
    """(fleet total, per-replica target) of each signal the config scales on. Every signal is a total that
    spreads over the replicas: KV and queues do; so does TTFT, taken as the sum of the replicas' (queueing
    delay falls as replicas are added), which makes its per-replica average the quantity compared."""
    totals = (
        (sum(m.kv_cache_usage for m in metrics), config.target_kv_cache_usage),
        (sum(m.num_waiting for m in metrics) + queued_requests, config.target_waiting_per_replica),
        (sum(m.queued_prefill_tokens for m in metrics), config.target_queued_prefill_tokens),
        (sum(m.ttft_s for m in metrics), config.target_ttft_s),
    )
    return [(total, target) for total, target in totals if target is not None]


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
    signals = _signals(metrics, queued_requests, config)
    needed = max([math.ceil(total / target - 1e-9) for total, target in signals if total] + [1])
    over = any(total / running > target for total, target in signals)
    if over:
        state.low_since = None
        if target_replicas > running:  # replicas still starting: their capacity is on its way
            return clamp(target_replicas)
        return clamp(running + max(1, min(config.max_upscale_step, needed - running)))
    fewer = running - 1
    fits = fewer >= 1 and all(total / fewer <= config.downscale_margin * target for total, target in signals)
    if not fits or running <= min_replicas:
        state.low_since = None
        return clamp(max(running, target_replicas))
    if state.low_since is None:
        state.low_since = now
    if now - state.low_since >= config.downscale_delay_s:
        state.low_since = None
        return clamp(fewer)
    return clamp(max(running, target_replicas))
