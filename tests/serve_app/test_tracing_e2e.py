"""Traces across Ray processes: the session app exports OTLP/HTTP to a receiver this test session runs
(`span_receiver`); a request sent with a traceparent yields spans from the ingress process and the replica
process in that trace, with the right parents, also for a request aborted by the client going away."""

from __future__ import annotations

import secrets

import httpx
import pytest

from tests.serve_app.conftest import SMALL_APP, wait_for


@pytest.fixture(scope="module")
def traced(serve_app_url, span_receiver):
    return serve_app_url, span_receiver  # the prefix router, spans exported every 100 ms


def _traceparent() -> tuple[str, str, str]:
    trace_id, parent = secrets.token_hex(16), secrets.token_hex(8)
    return f"00-{trace_id}-{parent}-01", trace_id, parent


def _spans(receiver, trace_id, names):
    def have():
        spans = {s.name: s for s in receiver.trace(trace_id)}
        return spans if names <= set(spans) else None

    return wait_for(have, timeout=30, interval=0.1)


def test_one_trace_from_the_edge_to_the_engine(traced):
    url, receiver = traced
    header, trace_id, parent = _traceparent()
    prompt = " ".join(["shared words"] * 20)
    r = httpx.post(url + "/v1/completions", headers={"traceparent": header}, timeout=60,
                   json={"prompt": prompt, "max_tokens": 5, "temperature": 0})
    assert r.status_code == 200
    spans = _spans(receiver, trace_id, {"POST /v1/completions", "tokenize", "route", "llm_request"})
    server, tokenize, route, llm = (spans[n] for n in ("POST /v1/completions", "tokenize", "route", "llm_request"))
    assert server.parent_span_id == parent and server.kind == 2  # SERVER
    assert (server.attributes["http.route"] == "/v1/completions"
            and server.attributes["http.response.status_code"] == 200)
    assert tokenize.parent_span_id == route.parent_span_id == llm.parent_span_id == server.span_id
    assert server.resource["pagedserve.component"] == "ingress" and llm.resource["pagedserve.component"] == "engine"
    assert route.attributes["pagedserve.route.policy"] == "prefix"
    assert route.attributes["pagedserve.route.replica"] == llm.resource["pagedserve.replica"]
    assert llm.attributes["gen_ai.usage.output_tokens"] == 5
    assert llm.events == ["queued", "scheduled", "first_token", "finished"]
    assert "gen_ai.prompt" not in llm.attributes and prompt not in str(server.attributes)


def test_an_aborted_request_ends_its_spans(traced):
    url, receiver = traced
    header, trace_id, parent = _traceparent()
    body = {"prompt": "go on", "max_tokens": 900, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, headers={"traceparent": header}, timeout=60) as r:
        lines = r.iter_lines()
        next(lines)
    spans = _spans(receiver, trace_id, {"POST /v1/completions", "llm_request"})
    llm, server = spans["llm_request"], spans["POST /v1/completions"]
    assert llm.parent_span_id == server.span_id and server.parent_span_id == parent
    assert "aborted" in llm.events and llm.attributes["gen_ai.usage.output_tokens"] < 900


def test_a_request_without_traceparent_starts_a_trace(traced):
    url, receiver = traced
    before = {s.trace_id for s in receiver.spans}
    httpx.post(url + "/v1/completions", json={"prompt": "new", "max_tokens": 2}, timeout=60)

    def new_trace():  # both processes' spans: they export independently, either may come first
        fresh = [s for s in receiver.spans if s.trace_id not in before and s.name == "llm_request"]
        servers = [s for s in receiver.trace(fresh[0].trace_id) if s.name == "POST /v1/completions"] if fresh else []
        return (fresh[0], servers[0]) if servers else None

    llm, server = wait_for(new_trace, timeout=30, interval=0.1)
    assert server.parent_span_id == "" and llm.parent_span_id == server.span_id


@pytest.mark.runs_last
def test_a_stopping_app_flushes_its_spans(small_app):
    """Spans still queued for export (small_app exports once an hour) leave when Serve stops the replicas."""
    from ray import serve

    header, trace_id, _ = _traceparent()
    r = httpx.post(small_app.url + "/v1/completions", json={"prompt": "bye", "max_tokens": 2},
                   headers={"traceparent": header, **small_app.auth}, timeout=60)
    assert r.status_code == 200 and small_app.receiver.trace(trace_id) == []
    serve.delete(SMALL_APP)
    assert {s.name for s in small_app.receiver.trace(trace_id)} >= {"POST /v1/completions", "llm_request"}
