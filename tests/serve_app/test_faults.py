"""Fault injection on the live app: an engine replica or the ingress replica killed mid-stream
(`ray.kill`). The affected streams end promptly with an error (no hang), Ray replaces the actor, the
router stops choosing the dead replica, nothing is left running, and new requests succeed.

These run on the session's shared app (2 engine replicas of the tiny model), after every other test
(the `runs_last` marker): a separate app of the same shape would cost its start-up again."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from tests.serve_app.conftest import APP, wait_for

MAX_TOKENS = 250
pytestmark = pytest.mark.runs_last


@pytest.fixture(scope="module")
def app_url(serve_app_url):
    return serve_app_url


def _replica_actors(deployment: str) -> list[str]:
    import ray

    return sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                  if a["name"].startswith(f"SERVE_REPLICA::{APP}#{deployment}#"))


def _running_replicas(deployment: str) -> int:
    from ray import serve

    states = serve.status().applications[APP].deployments[deployment].replica_states
    return states.get("RUNNING", 0)


def _kill(actor_name: str) -> None:
    import ray

    ray.kill(ray.get_actor(actor_name, namespace="serve"), no_restart=True)


async def _stream(client: httpx.AsyncClient, url: str, i: int, started: asyncio.Event,
                  max_tokens: int = MAX_TOKENS) -> dict:
    """One stream's outcome: its tokens, finish reason and error event, or that the connection broke."""
    body = {"prompt": f"stream {i} " + "word " * (10 + 7 * i), "max_tokens": max_tokens, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    outcome = {"tokens": 0, "finish_reason": None, "error": None, "broken": False, "done": False}
    try:
        async with client.stream("POST", url + "/v1/completions", json=body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line == "data: [DONE]":
                    outcome["done"] = True
                elif line.startswith("data: "):
                    event = json.loads(line[6:])
                    if "error" in event:
                        outcome["error"] = event["error"]
                        continue
                    started.set()
                    if event.get("usage"):
                        outcome["tokens"] = event["usage"]["completion_tokens"]
                    for choice in event["choices"]:
                        outcome["finish_reason"] = choice["finish_reason"] or outcome["finish_reason"]
    except httpx.HTTPError:
        outcome["broken"] = True
    return outcome


async def _streams_with_kill(url: str, victim: str, n: int = 4) -> tuple[list[dict], float]:
    """Start n streams, kill `victim` once each has produced tokens; how they ended and how long the
    last one took after the kill."""
    async with httpx.AsyncClient(timeout=httpx.Timeout(60)) as client:
        tasks, events = [], []
        for i in range(n):  # one at a time: the router spreads them by its count of in-flight requests
            events.append(asyncio.Event())
            tasks.append(asyncio.create_task(_stream(client, url, i, events[-1])))
            await asyncio.wait_for(events[-1].wait(), 30)
        _kill(victim)
        killed_at = time.monotonic()
        outcomes = await asyncio.wait_for(asyncio.gather(*tasks), 30)
        return outcomes, time.monotonic() - killed_at


def _engines_idle(app_url: str) -> bool:
    from ray import serve

    handle = serve.get_deployment_handle("LLMServer", app_name=APP)
    return all(s.num_running == 0 and s.num_waiting == 0 and s.kv_cache_usage == 0
               for s in handle.broadcast("stats").results())


def _requests_succeed(url: str, count: int = 6) -> None:
    for i in range(count):
        r = httpx.post(url + "/v1/completions", json={"prompt": f"after {i}", "max_tokens": 4}, timeout=30)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 4


def _all_succeed(url: str) -> bool:
    try:
        _requests_succeed(url)
    except (AssertionError, httpx.HTTPError):
        return False
    return True


def test_engine_replica_killed_mid_stream(app_url):
    wait_for(lambda: _running_replicas("LLMServer") == 2, timeout=60)
    before = _replica_actors("LLMServer")
    outcomes, elapsed = asyncio.run(_streams_with_kill(app_url, before[0]))
    assert elapsed < 20, f"streams took {elapsed:.1f} s to end after the kill"
    failed = [o for o in outcomes if o["finish_reason"] != "length"]
    completed = [o for o in outcomes if o["finish_reason"] == "length"]
    assert failed and completed, outcomes  # the router had spread the streams over both replicas
    for o in failed:  # an in-band error event, then the end of the stream
        assert o["error"]["code"] == "replica_unavailable" and o["done"], o
    for o in completed:
        assert o["tokens"] == MAX_TOKENS and o["error"] is None, o
    _requests_succeed(app_url)  # at once: the router no longer picks the dead replica
    # Ray replaces it (the named actors are the truth; Serve's status lags the death a little)
    wait_for(lambda: len(after := _replica_actors("LLMServer")) == 2 and before[0] not in after
             and _running_replicas("LLMServer") == 2, timeout=90)
    _requests_succeed(app_url)
    wait_for(lambda: _engines_idle(app_url), timeout=20)


def test_ingress_replica_killed_mid_stream(app_url):
    wait_for(lambda: _running_replicas("OpenAIIngress") == 1 and _running_replicas("LLMServer") == 2, timeout=90)
    [ingress] = _replica_actors("OpenAIIngress")
    outcomes, elapsed = asyncio.run(_streams_with_kill(app_url, ingress, n=2))
    assert elapsed < 20, f"streams took {elapsed:.1f} s to end after the kill"
    for o in outcomes:  # the proxy reports the failure in-band or cuts the connection; neither hangs
        assert o["finish_reason"] != "length" and (o["error"] or o["broken"] or not o["done"]), o
    # The engine replicas notice their caller is gone: the requests are aborted, their blocks freed.
    wait_for(lambda: _engines_idle(app_url), timeout=30)
    wait_for(lambda: _running_replicas("OpenAIIngress") == 1 and _replica_actors("OpenAIIngress") != [ingress],
             timeout=90)
    # Through HAProxy the route can drop out for a moment after the replacement runs (one CI run: 200, 200,
    # then 404 "Path not found" ~2 s later, while Serve rewrote HAProxy's backends): Ray's controller lists an
    # app with no RUNNING ingress replica as no backend at all. The app must settle to serving every request.
    wait_for(lambda: _all_succeed(app_url), timeout=30, interval=1)
