"""Schemathesis fuzzing of every route, generated from the app's own /openapi.json (valid and invalid
requests, and the methods and paths it does not serve): no 5xx, every 4xx the documented error object,
no replica restarted, the engine healthy and idle afterwards. The CI-sized run of benchmarks/fuzz.py."""

from __future__ import annotations

from benchmarks.fuzz import fuzz, table
from tests.serve_app.conftest import APP

CASES = 120  # every route several times over (benchmarks/fuzz.py runs thousands)
# Valid requests' max_tokens capped (the shared app's context is 1024 tokens): validation is under test.
MAX_TOKENS_CAP = 8


def test_fuzz_every_route(serve_app_url):
    report = fuzz(serve_app_url, CASES, concurrency=8, seed=1, max_tokens_cap=MAX_TOKENS_CAP, app=APP)
    failures = "\n".join(f"{o.route}: {o.problem}\n  {o.reproduce}" for o in report.failures)
    assert not report.failures, f"{table(report.outcomes)}\n{failures}"
    assert len(report.outcomes) >= CASES
    assert not report.restarts
    assert report.health_status == 200 and report.idle
