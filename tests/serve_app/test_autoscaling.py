"""Live autoscaling on the real app: a burst scales the engine replicas up, idleness scales them back
down, and no stream is cut on the way (replicas being stopped drain first)."""

from __future__ import annotations

import json
import threading

import httpx

from tests.serve_app.conftest import delete_app, wait_for

APP = "autoscale"


def _replicas() -> int:
    from ray import serve

    status = serve.status().applications[APP].deployments["LLMServer"]
    return status.replica_states.get("RUNNING", 0)


def _stream(url: str, results: list, max_tokens: int) -> None:
    body = {"prompt": "scale me", "max_tokens": max_tokens, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    usage, finish, events = None, None, []
    try:
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=180) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    chunk = json.loads(line[6:])
                    events.append(chunk)
                    if chunk.get("usage"):
                        usage = chunk["usage"]["completion_tokens"]
                    for c in chunk.get("choices", []):
                        finish = c.get("finish_reason") or finish
        results.append((r.status_code, usage, finish) if usage else (r.status_code, events[-1:]))
    except Exception as e:  # noqa: BLE001 - reported in the assertion
        results.append(repr(e))


def test_burst_scales_up_idle_scales_down_no_stream_cut(deploy_app):
    url = deploy_app(
        APP, "/autoscale",
        engine={"max_model_len": 1024, "num_kv_blocks": 512, "num_threads": 1, "max_num_seqs": 2},
        autoscaling_config={
            "min_replicas": 1, "max_replicas": 3, "look_back_period_s": 2,
            "policy": {"policy_function": "autoscale.ray_policy:KVQueueAutoscalingPolicy",
                       "policy_kwargs": {"target_waiting_per_replica": 1, "downscale_delay_s": 2}},
        },
    )
    assert _replicas() == 1
    results: list = []
    # 8 streams on one replica (2 running, 6 waiting): the autoscaler wants 3. The requests stay queued on the
    # first replica, which works through them 2 at a time: the queue outlasts a new replica's start.
    burst = [threading.Thread(target=_stream, args=(url, results, 700)) for _ in range(8)]
    for t in burst:
        t.start()
    wait_for(lambda: _replicas() >= 2, timeout=90, interval=0.5)  # the queue built up: more replicas
    # A stream that runs while the app scales back down must not be cut. It starts now, not after the burst:
    # routed by load, it lands on a new replica, one of those the scale-down then stops (draining it first).
    survivor: list = []
    streaming = threading.Thread(target=_stream, args=(url, survivor, 900))
    streaming.start()
    for t in burst:
        t.join()
    wait_for(lambda: _replicas() == 1, timeout=120, interval=0.5)
    streaming.join()
    assert results + survivor == [(200, 700, "length")] * 8 + [(200, 900, "length")]
    delete_app(APP)  # its replica would otherwise share the 2 cores with every later test
