"""Engine metrics reach Ray's Prometheus endpoint with vLLM's names, labelled by model and replica."""

from __future__ import annotations

import httpx

from tests.serve_app.conftest import wait_for

NAMES = [
    "ray_pagedserve_num_requests_running",
    "ray_pagedserve_num_requests_waiting",
    "ray_pagedserve_kv_cache_usage_perc",
    "ray_pagedserve_prompt_tokens",
    "ray_pagedserve_generation_tokens",
    "ray_pagedserve_prefix_cache_queries",
    "ray_pagedserve_time_to_first_token_seconds_bucket",
    "ray_pagedserve_e2e_request_latency_seconds_bucket",
    "ray_pagedserve_inter_token_latency_seconds_bucket",
    "ray_pagedserve_request_success",
]


def test_engine_metrics_on_the_prometheus_endpoint(serve_app_url):
    import ray

    for _ in range(3):
        httpx.post(serve_app_url + "/v1/completions", json={"prompt": "metrics please", "max_tokens": 5}, timeout=60)
    node = ray._private.worker.global_worker.node
    url = f"http://{node.node_ip_address}:{node.metrics_export_port}/metrics"

    def scrape() -> str | None:
        """The generation tokens' line once every name is there and it counts the 3 requests' 15 tokens (an
        export every 2 s may come between them)."""
        text = httpx.get(url, timeout=5).text
        if not all(name in text for name in NAMES):
            return None
        line = next(line for line in text.splitlines() if line.startswith("ray_pagedserve_generation_tokens"))
        return line if float(line.rsplit(" ", 1)[1]) >= 15 else None

    line = wait_for(scrape, timeout=60, interval=0.5)
    assert 'model_name="pagedserve-tiny"' in line and "replica=" in line


def test_moe_expert_load_on_the_prometheus_endpoint(ray_session):
    """A mixture-of-experts engine's tokens per expert (EngineStats.expert_tokens) become a counter per expert."""
    import ray

    from engine.stats import EngineStats
    from serve_app.metrics import EngineMetrics

    metrics = EngineMetrics("moe-metrics-test", "r0")
    snapshot = dict(kv_cache_usage=0.0, num_running=0, num_waiting=0, num_kv_blocks=8, block_size=16)
    metrics.update(EngineStats(**snapshot, expert_tokens=(5, 0, 7)))
    metrics.update(EngineStats(**snapshot, expert_tokens=(9, 2, 7)))
    node = ray._private.worker.global_worker.node
    url = f"http://{node.node_ip_address}:{node.metrics_export_port}/metrics"

    def scrape() -> dict[str, float] | None:
        lines = [line for line in httpx.get(url, timeout=5).text.splitlines()
                 if line.startswith("ray_pagedserve_moe_expert_tokens") and 'model_name="moe-metrics-test"' in line]
        counts = {line.split('expert="')[1].split('"')[0]: float(line.rsplit(" ", 1)[1]) for line in lines}
        return counts if len(counts) == 3 else None

    assert wait_for(scrape, timeout=60, interval=0.5) == {"0": 9.0, "1": 2.0, "2": 7.0}
