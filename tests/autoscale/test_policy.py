"""The autoscaling core: up fast, down slowly and only when the load fits, no double scale-up while
replicas start, bounds, cold start. Plus the Ray adapter on a real AutoscalingContext."""

from __future__ import annotations

import pytest

from autoscale.policy import KVQueuePolicyConfig, PolicyState, ReplicaMetrics, desired_replicas

CFG = KVQueuePolicyConfig(target_kv_cache_usage=0.75, target_waiting_per_replica=2, downscale_margin=0.6,
                          downscale_delay_s=30, max_upscale_step=4)


def decide(metrics, target=None, queued=0, now=0.0, state=None, lo=1, hi=8):
    return desired_replicas(metrics, len(metrics) if target is None else target, queued, now,
                            state or PolicyState(), CFG, lo, hi)


def m(kv=0.0, waiting=0, running=0):
    return ReplicaMetrics(kv, waiting, running)


def test_steady_under_target():
    assert decide([m(0.5, 1, 4), m(0.6, 0, 5)]) == 2


def test_scales_up_when_kv_or_queue_passes_target():
    assert decide([m(0.9), m(0.8)]) == 3  # avg 0.85 > 0.75: ceil(1.7 / 0.75) = 3
    assert decide([m(0.2, 3), m(0.2, 2)]) == 3  # 5 waiting at 2 per replica: 3


def test_upscale_step_and_max_bound():
    assert decide([m(0.2, 9), m(0.2, 7)]) == 6  # needs 8, adds at most 4 at once
    assert decide([m(1.0, 50)] * 6, hi=7) == 7


def test_no_second_scale_up_while_replicas_start():
    assert decide([m(0.95, 5), m(0.95, 5)], target=4) == 4


def test_queued_requests_at_handles_count():
    assert decide([m(0.1)], queued=10) == 5


def test_scales_down_slowly_and_only_if_the_load_fits():
    state = PolicyState()
    low = [m(0.1, 0, 1)] * 4  # 0.4 KV in all: fits on 3 under 0.6 x 0.75
    assert decide(low, now=0, state=state) == 4
    assert decide(low, now=29, state=state) == 4
    assert decide(low, now=31, state=state) == 3  # one at a time, after the delay
    busy = [m(0.35, 1, 3)] * 4  # 1.4 KV on 3 replicas = 0.47 > 0.45: does not fit
    state = PolicyState()
    assert decide(busy, now=0, state=state) == 4 and decide(busy, now=100, state=state) == 4


def test_a_spike_resets_the_downscale_clock():
    state = PolicyState()
    low = [m(0.1)] * 3
    decide(low, now=0, state=state)
    decide([m(0.9)] * 3, now=20, state=state)
    assert decide(low, now=40, state=state) == 3  # the clock restarted at 40
    assert decide(low, now=71, state=state) == 2


def test_min_and_cold_start():
    assert decide([m(0.0)], lo=1) == 1
    assert desired_replicas([], 0, 0, 0.0, PolicyState(), CFG, 0, 3) == 0
    assert desired_replicas([], 0, 3, 0.0, PolicyState(), CFG, 0, 3) == 1  # a request waits: start one
    assert desired_replicas([], 2, 0, 0.0, PolicyState(), CFG, 0, 3) == 2  # already starting: keep
    state = PolicyState()
    assert decide([m(0.0)], now=0, state=state, lo=0) == 1
    assert decide([m(0.0)], now=31, state=state, lo=0) == 1  # never below one replica while one runs


def test_ray_adapter_on_an_autoscaling_context():
    from ray.serve._private.common import DeploymentID, ReplicaID
    from ray.serve.config import AutoscalingConfig, AutoscalingContext

    from autoscale.ray_policy import KVQueueAutoscalingPolicy

    dep = DeploymentID(name="LLMServer", app_name="app")
    reps = [ReplicaID(unique_id=f"r{i}", deployment_id=dep) for i in range(2)]

    def ctx(kv, waiting, target=2, queued=0, now=0.0):
        return AutoscalingContext(
            deployment_id=dep, deployment_name="LLMServer", app_name="app", current_num_replicas=len(reps),
            target_num_replicas=target, running_replicas=reps, total_num_requests=0, total_queued_requests=queued,
            aggregated_metrics={"kv_cache_usage": dict(zip(reps, kv)),
                                                          "num_waiting": dict(zip(reps, waiting)),
                                                          "num_running": dict(zip(reps, [1, 1]))},
            raw_metrics={}, capacity_adjusted_min_replicas=1, capacity_adjusted_max_replicas=4, policy_state={},
            last_scale_up_time=None, last_scale_down_time=None, current_time=now,
            config=AutoscalingConfig(max_replicas=4),
        )

    policy = KVQueueAutoscalingPolicy(target_kv_cache_usage=0.5, downscale_delay_s=0)
    assert policy(ctx([0.9, 0.9], [0, 0]))[0] == 4
    assert policy(ctx([0.1, 0.1], [0, 0]))[0] == 1
    with pytest.raises(TypeError):
        KVQueueAutoscalingPolicy(no_such_knob=1)
    broken = KVQueueAutoscalingPolicy()
    bad = ctx([0.9, 0.9], [0, 0])
    bad.aggregated_metrics = "not a dict"  # anything inside raising must not reach the controller
    assert broken(bad)[0] == 2


PREFILL = KVQueuePolicyConfig(target_kv_cache_usage=None, target_waiting_per_replica=None,
                              target_queued_prefill_tokens=4096, target_ttft_s=1.0, downscale_delay_s=30)


def p(prefill_tokens=0.0, ttft=0.0, kv=0.0, waiting=0):
    return ReplicaMetrics(kv, waiting, 0, prefill_tokens, ttft)


def test_prefill_pool_scales_on_queued_prefill_tokens_and_ttft_not_kv():
    def prefill(metrics, target=None, now=0.0, state=None):
        return desired_replicas(metrics, len(metrics) if target is None else target, 0, now,
                                state or PolicyState(), PREFILL, 1, 8)

    assert prefill([p(kv=0.99, waiting=20)] * 2) == 2  # full KV and queues do not move a prefill pool
    assert prefill([p(prefill_tokens=9000), p(prefill_tokens=7000)]) == 4  # 16000 tokens at 4096 each
    assert prefill([p(ttft=1.5), p(ttft=2.5)]) == 4  # TTFT 2 s on average at a 1 s target: twice the replicas
    state = PolicyState()
    assert prefill([p(800, 0.2), p(600, 0.1)], now=0.0, state=state) == 2
    assert prefill([p(800, 0.2), p(600, 0.1)], now=31.0, state=state) == 1  # fits on one for 30 s: down


def test_a_config_without_signals_is_refused():
    with pytest.raises(ValueError, match="every target is None"):
        KVQueuePolicyConfig(target_kv_cache_usage=None, target_waiting_per_replica=None)
