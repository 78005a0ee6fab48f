"""The Serve adapter of the autoscaling core: a class-based custom AutoscalingPolicy (Ray Serve 2.60).

    autoscaling_config:
      min_replicas: 1
      max_replicas: 4
      metrics_interval_s: 1
      look_back_period_s: 5
      upscale_delay_s: 0        # the policy debounces itself
      downscale_delay_s: 0
      policy:
        policy_function: autoscale.ray_policy:KVQueueAutoscalingPolicy
        policy_kwargs: {target_kv_cache_usage: 0.75, target_waiting_per_replica: 2, downscale_delay_s: 30}

Replicas report kv_cache_usage, num_waiting, num_running, queued_prefill_tokens and ttft_s through
`record_autoscaling_stats`
(serve_app/llm_server.py). The policy runs inside the Serve controller: it never raises there (on any
error it keeps the current target and logs)."""

from __future__ import annotations

import logging

from autoscale.policy import KVQueuePolicyConfig, PolicyState, ReplicaMetrics, desired_replicas

logger = logging.getLogger(__name__)


class KVQueueAutoscalingPolicy:
    def __init__(self, **policy_kwargs) -> None:
        self.config = KVQueuePolicyConfig(**policy_kwargs)  # a bad kwarg fails when the app deploys
        self.state = PolicyState()

    def __call__(self, ctx) -> tuple[int, dict]:
        try:
            return self._decide(ctx), {}
        except Exception:  # noqa: BLE001 - an exception here would break the controller's loop
            logger.exception("autoscaling policy failed; keeping %s replicas", ctx.target_num_replicas)
            return ctx.target_num_replicas, {}

    def _decide(self, ctx) -> int:
        metrics = ctx.aggregated_metrics or {}
        kv, waiting, running, prefill, ttft = (metrics.get(k, {}) for k in (
            "kv_cache_usage", "num_waiting", "num_running", "queued_prefill_tokens", "ttft_s"))
        replicas = [
            ReplicaMetrics(kv.get(r, 0.0), waiting.get(r, 0.0), running.get(r, 0.0), prefill.get(r, 0.0),
                           ttft.get(r, 0.0))
            for r in ctx.running_replicas
            if r in kv  # a replica that has not reported yet is still warming up
        ]
        return desired_replicas(
            replicas,
            target_replicas=ctx.target_num_replicas,
            queued_requests=ctx.total_queued_requests,
            now=ctx.current_time,
            state=self.state,
            config=self.config,
            min_replicas=ctx.capacity_adjusted_min_replicas,
            max_replicas=ctx.capacity_adjusted_max_replicas,
        )
