"""Hostile text in every text field of every generating route (the CI sample of benchmarks/text_fuzz.py,
which benchmarks/fuzz.py runs whole): unpaired surrogates, control characters, ZWJ emoji and
right-to-left text everywhere, megabyte texts in the fields that reach the tokenizer. Each is served or
refused with a 4xx naming the field; never a 5xx. Then no replica restarted and the engines are idle."""

from __future__ import annotations

import requests

from benchmarks import live_app
from benchmarks.text_fuzz import HOSTILE_TEXTS, cases, run, table
from tests.serve_app.conftest import APP

SAMPLE_TEXTS = {name: HOSTILE_TEXTS[name] for name in (
    "lone low surrogate", "reversed surrogate pair", "NUL and controls", "ZWJ emoji", "right-to-left", "overlong line",
    "one character a million times")}
LONG_TEXTS_ON = {"prompt", "messages", "system", "tools"}


def test_hostile_text_in_every_field_is_served_or_refused_naming_it(serve_app_url):
    model = requests.get(serve_app_url + "/v1/models", timeout=30).json()["data"][0]["id"]
    before = live_app.replicas(APP)
    sample = cases(model, SAMPLE_TEXTS, long_texts_on=LONG_TEXTS_ON)
    outcomes = run(serve_app_url, sample, concurrency=8)
    failures = "\n".join(f"{o.case.route} {o.case.field} <- {o.case.text_name}: {o.problem}"
                         for o in outcomes if o.problem)
    assert not failures, f"{table(outcomes)}\n{failures}"
    statuses = {o.status // 100 for o in outcomes}
    assert statuses == {2, 4}  # both served and refused cases: the sample reaches both paths
    assert not live_app.restarts(before, live_app.replicas(APP))
    assert all(load.idle for load in live_app.engine_loads(APP))
