"""How engine replicas pace streams (serve_app/llm_server.py, StreamPacing): while the CPU is saturated a
stream rests between messages and its tokens travel together; the first token never waits."""

from __future__ import annotations

import json
import time

import httpx
import pytest

from serve_app.cpu_utilization import CpuUtilization


def _events(url: str, max_tokens: int, headers: dict | None = None) -> list[int]:
    """Tokens per SSE event of one streamed completion (continuous usage)."""
    body = {"prompt": "Hello", "max_tokens": max_tokens, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    tokens, seen = [], 0
    with httpx.stream("POST", url + "/v1/completions", json=body, headers=headers, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                total = json.loads(line[6:])["usage"]["completion_tokens"]
                if total > seen:
                    tokens.append(total - seen)
                    seen = total
    return tokens


@pytest.mark.skipif(CpuUtilization().source is None, reason="no CPU usage figures (cgroup, /proc/stat) here")
def test_saturated_cpu_coalesces_tokens(small_app):
    # small_app's threshold is 0: any utilization counts as saturated, so every stream is paced at 0.25 s.
    # A replica just started samples the utilization every second: 2.5 s after its start (or at once, where
    # earlier tests already used it) it streams as saturated.
    time.sleep(max(0.0, small_app.deployed_at + 2.5 - time.monotonic()))
    tokens = _events(small_app.url, 200, small_app.auth)
    assert sum(tokens) == 200
    assert tokens[0] >= 1 and len(tokens) < 100, tokens  # fewer, fuller messages than one per step
    assert max(tokens) > 1
