"""The autoscalers under comparison, fed through Ray Serve 2.60's own metric pipeline and decision wrapper.

A scaling policy is judged as much by what it sees, and when, as by its formula, so both policies get
Ray's plumbing, with Ray's own functions wherever they are importable:
- metrics: each source records a point every min(look_back_period_s x 0.2, metrics_interval_s) and pushes
  the points of the last look_back_period_s every metrics_interval_s; the controller merges the series
  (`merge_instantaneous_total`) and takes their time-weighted mean (`time_weighted_average`), the last
  point held until now;
- decision: every control-loop period (0.1 s) the policy's raw answer goes through Ray's wrapper: the
  cold-start fast path, scaling factors (`_apply_scaling_factors`), up/downscale delays
  (`_apply_delay_logic`), then the [min_replicas, max_replicas] bounds.

- fixed: never scales.
- ray_default: Ray's default `replica_queue_length_autoscaling_policy` (its core imported): desired =
  ongoing requests (at replicas, counted by the handle, plus queued at the handle) / target_ongoing_requests,
  with Ray's defaults: metrics every 10 s, look-back 30 s, upscale delay 30 s, downscale delay 600 s.
- ours: autoscale.ray_policy.KVQueueAutoscalingPolicy (the real adapter around autoscale/policy.py), fed
  the replicas' record_autoscaling_stats (kv_cache_usage, num_waiting, num_running) and the handle's
  queued requests, under the app's autoscaling settings (serve_app/app_args.py: metrics 1 s, look-back
  5 s, Ray-side delays 0; the policy debounces scale-down itself)."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Protocol

from ray.serve._private.constants import RAY_SERVE_AUTOSCALING_METRIC_RECORD_INTERVAL_FACTOR
from ray.serve._private.metrics_utils import TimeStampedValue, merge_instantaneous_total, time_weighted_average
from ray.serve.autoscaling_policy import (
    _apply_delay_logic,
    _apply_scaling_factors,
    _core_replica_queue_length_policy,
    _get_cold_start_scale_up_replicas,
)
from ray.serve.config import AutoscalingConfig

from autoscale.ray_policy import KVQueueAutoscalingPolicy

from .replica import SimReplica

CONTROL_LOOP_PERIOD_S = 0.1  # ray.serve._private.constants.CONTROL_LOOP_INTERVAL_S


class ClusterState(Protocol):
    """What the controller and the handle know about the fleet."""

    target: int

    def running_replicas(self) -> list[SimReplica]: ...  # ready and not stopping

    def ongoing(self, replica_id: str) -> int: ...  # handle-side: sent, not finished

    @property
    def queued(self) -> int: ...  # at the handle: not sent to any replica yet


@dataclass
class _Series:
    """One source's gauge, as recorded locally and as last pushed to the controller."""

    local: list[TimeStampedValue] = field(default_factory=list)
    pushed: list[TimeStampedValue] = field(default_factory=list)


def controller_mean(series: list[list[TimeStampedValue]], now: float) -> float:
    """AutoscalingState._merge_and_aggregate_timeseries with the MEAN aggregation."""
    series = [s for s in series if s]
    if not series:
        return 0.0
    merged = merge_instantaneous_total(series)
    if not merged:
        return 0.0
    last_window_s = now - merged[-1].timestamp
    if last_window_s <= 0:
        last_window_s = 1e-3
    window_start = None
    if len(series) > 1:
        aligned = max(s[0].timestamp for s in series)
        if aligned <= merged[-1].timestamp:
            window_start = max(aligned, merged[0].timestamp)
    value = time_weighted_average(merged, window_start=window_start, last_window_s=last_window_s)
    return value if value is not None else 0.0


class MetricPipeline:
    """Ray's record -> push -> controller path for a set of named gauges."""

    def __init__(self, config: AutoscalingConfig) -> None:
        self.look_back = config.look_back_period_s
        self.record_period = min(config.look_back_period_s * RAY_SERVE_AUTOSCALING_METRIC_RECORD_INTERVAL_FACTOR,
                                 config.metrics_interval_s)
        self.push_period = config.metrics_interval_s
        self.series: dict[Any, _Series] = defaultdict(_Series)
        self._next_record = 0.0
        self._next_push = 0.0

    def due(self, now: float) -> tuple[bool, bool]:
        record = now + 1e-9 >= self._next_record
        push = now + 1e-9 >= self._next_push
        if record:
            self._next_record = now + self.record_period
        if push:
            self._next_push = now + self.push_period
        return record, push

    def record(self, key: Any, now: float, value: float) -> None:
        self.series[key].local.append(TimeStampedValue(now, float(value)))

    def push(self, now: float, keys: list[Any] | None = None) -> None:
        start = now - self.look_back
        for key, s in self.series.items():
            if keys is None or key in keys:
                s.local = [p for p in s.local if p.timestamp >= start]
                s.pushed = list(s.local)

    def mean(self, keys: list[Any], now: float) -> float:
        return controller_mean([self.series[k].pushed for k in keys if k in self.series], now)

    def drop(self, key: Any) -> None:
        self.series.pop(key, None)


class Autoscaler:
    name = "autoscaler"

    def tick(self, now: float, cluster: ClusterState) -> int:
        """Called every control-loop period; returns the new target number of replicas."""
        raise NotImplementedError

    def on_replica_stopped(self, replica_id: str) -> None:
        pass


class Fixed(Autoscaler):
    name = "fixed"

    def tick(self, now, cluster):
        return cluster.target


class _RayWrapped(Autoscaler):
    """Ray's _apply_autoscaling_config around a policy, with the simulated clock."""

    def __init__(self, config: AutoscalingConfig) -> None:
        self.config = config
        self.pipeline = MetricPipeline(config)
        self.policy_state: dict = {}

    def _context(self, now: float, cluster: ClusterState) -> SimpleNamespace:
        raise NotImplementedError

    def _policy(self, ctx: SimpleNamespace) -> float:
        raise NotImplementedError

    def tick(self, now, cluster):
        ctx = self._context(now, cluster)
        decision = _get_cold_start_scale_up_replicas(ctx)
        if decision is None:
            desired = _apply_scaling_factors(self._policy(ctx), ctx.current_num_replicas, self.config)
            if ctx.current_num_replicas == 0 and desired > 0:
                decision = desired
            else:
                decision, self.policy_state = _apply_delay_logic(
                    max(0, desired), ctx.target_num_replicas, self.config, self.policy_state, _now=now)
        return max(self.config.min_replicas, min(self.config.max_replicas, decision))


class RayDefault(_RayWrapped):
    name = "ray_default"

    def __init__(self, min_replicas: int, max_replicas: int, target_ongoing_requests: float = 2.0,
                 **overrides: Any) -> None:
        super().__init__(AutoscalingConfig(min_replicas=min_replicas, max_replicas=max_replicas,
                                           target_ongoing_requests=target_ongoing_requests, **overrides))

    def _context(self, now, cluster):
        running = cluster.running_replicas()
        ids = [r.replica_id for r in running]
        record, push = self.pipeline.due(now)
        if record:  # the handle records ongoing requests per replica, and its queue
            for rid in ids:
                self.pipeline.record(rid, now, cluster.ongoing(rid))
            self.pipeline.record("queued", now, cluster.queued)
        if push:
            self.pipeline.push(now)
        total = self.pipeline.mean(ids + ["queued"], now)
        return SimpleNamespace(current_num_replicas=len(running), target_num_replicas=cluster.target,
                               total_num_requests=total, config=self.config, policy_state=self.policy_state)

    def _policy(self, ctx):
        return _core_replica_queue_length_policy(ctx)[0]

    def on_replica_stopped(self, replica_id):
        self.pipeline.drop(replica_id)


_STATS = ("kv_cache_usage", "num_waiting", "num_running")


class Ours(_RayWrapped):
    name = "ours"

    def __init__(self, min_replicas: int, max_replicas: int, **policy_kwargs: Any) -> None:
        # serve_app/app_args.py: engine_autoscaling_config's defaults.
        super().__init__(AutoscalingConfig(min_replicas=min_replicas, max_replicas=max_replicas,
                                           metrics_interval_s=1, look_back_period_s=5, upscale_delay_s=0,
                                           downscale_delay_s=0))
        self.policy = KVQueueAutoscalingPolicy(**policy_kwargs)

    def _context(self, now, cluster):
        running = cluster.running_replicas()
        record, push = self.pipeline.due(now)
        if record:  # each replica's record_autoscaling_stats, and the handle's queue
            for r in running:
                for name, value in zip(_STATS, (r.kv_cache_usage, r.num_waiting, r.num_running)):
                    self.pipeline.record((r.replica_id, name), now, value)
            self.pipeline.record("queued", now, cluster.queued)
            self.pipeline.record("ongoing", now, sum(cluster.ongoing(r.replica_id) for r in running))
        if push:
            self.pipeline.push(now)
        aggregated: dict[str, dict[str, float]] = defaultdict(dict)
        for r in running:
            for name in _STATS:
                if self.pipeline.series.get((r.replica_id, name)) and self.pipeline.series[(r.replica_id, name)].pushed:
                    aggregated[name][r.replica_id] = self.pipeline.mean([(r.replica_id, name)], now)
        queued = self.pipeline.mean(["queued"], now)
        return SimpleNamespace(
            current_num_replicas=len(running), target_num_replicas=cluster.target,
            running_replicas=[r.replica_id for r in running], aggregated_metrics=dict(aggregated),
            total_queued_requests=queued, total_num_requests=queued + self.pipeline.mean(["ongoing"], now),
            current_time=now, capacity_adjusted_min_replicas=self.config.min_replicas,
            capacity_adjusted_max_replicas=self.config.max_replicas, config=self.config,
            policy_state=self.policy_state,
        )

    def _policy(self, ctx):
        return self.policy(ctx)[0]

    def on_replica_stopped(self, replica_id):
        for name in _STATS:
            self.pipeline.drop((replica_id, name))


AUTOSCALERS = ("fixed", "ray_default", "ours")
