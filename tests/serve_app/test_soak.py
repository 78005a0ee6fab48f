"""A short soak (the CI-sized run of benchmarks/soak.py) on the session's app: mixed routes, streamed and
not, n > 1, stop tokens and strings, structured outputs, shared prefixes, clients that disconnect or are
cancelled. Every request completes with its exact token count and finish reason or gets a clear error;
afterwards every replica is idle with its KV pool free, and none restarted.

Memory is not checked here: every process's resident memory climbs while the run warms up (allocators'
high-water marks, caches filling), so a run this short cannot tell a leak from warm-up; benchmarks/soak.py
follows it over 20,000 requests."""

from __future__ import annotations

from collections import Counter

from benchmarks.soak import soak
from tests.serve_app.conftest import APP

REQUESTS = 150


def test_soak_mixed_requests(serve_app_url):
    report = soak(serve_app_url, REQUESTS, concurrency=16, seed=1, app=APP, max_rss_growth=None,
                  max_rss_slope=None)
    assert not report.problems, report.table() + "\n" + "\n".join(report.problems)
    results = Counter(o.result for o in report.outcomes)
    assert results["completed"] >= REQUESTS * 0.7 and results["disconnected"] > 0 and results["cancelled"] > 0
    assert ({o.spec.ending for o in report.outcomes if o.result == "completed"}
            == {"length", "stop_token", "stop_string", "json"})
