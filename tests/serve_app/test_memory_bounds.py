"""Per-request state of the serving layer that must not outlive its window (benchmarks/soak.py follows the
processes' memory over 20,000 requests; these are the cheap, exact checks of what it found)."""

from __future__ import annotations

import time

import pytest

from engine.outputs import RequestMetrics, RequestOutput
from serve_app.metrics import RecentTTFT


def _finished(ttft: float) -> RequestOutput:
    now = time.monotonic()
    return RequestOutput("r", None, [1], [], finished=True,
                         metrics=RequestMetrics(arrival_time=now - ttft, first_token_time=now))


def test_recent_ttft_forgets_old_samples_without_being_read():
    ttft = RecentTTFT(window_s=0.05)
    for _ in range(100):
        ttft.observe(_finished(0.01))
    time.sleep(0.06)
    ttft.observe(_finished(0.02))  # no p90() call: a replica without autoscaling never reads it
    assert len(ttft) == 1
    assert ttft.p90() == pytest.approx(0.02)
