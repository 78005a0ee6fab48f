"""direct_streaming: the engine replica is the app's ingress (serve_app/engine_ingress.py). The same
routes, errors, disconnect handling and handle API as with OpenAIIngress in front, without it."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import httpx
import pytest

from serve_app.protocol.openai import ChatCompletionRequest, ChatCompletionResponse
from tests.serve_app.conftest import INGRESS, delete_app, disconnect_mid_stream

APP = "direct"
# One app for the module (each app deployed costs 15-25 s on 2 cores): two replicas, and behind HAProxy the
# prefix router, which HAProxy asks; Ray's proxy has no router to ask (app.py refuses prefix behind it).
ROUTER = "prefix" if INGRESS == "haproxy" else "pow2"


# The app as a user writes it: one replica, every serving setting the default (test_one_replica_app_...).
ONE, ONE_ARGS = "one", {"model": "pagedserve-tiny", "num_replicas": 1, "direct_streaming": "auto"}


@pytest.fixture(scope="module")
def direct_url(deploy_apps, request) -> Iterator[str]:
    apps = {APP: ("/direct", dict(model="pagedserve-tiny", num_replicas=2, router=ROUTER, direct_streaming=True))}
    if any(item.name == "test_one_replica_app_serves_clients_itself_by_default" for item in request.session.items):
        apps[ONE] = ("/one", ONE_ARGS)  # deployed beside this one where its test runs: ~4 s less than after it
    yield deploy_apps(apps)[APP]
    delete_app(APP)  # its replicas would otherwise share the 2 cores with every later test


@pytest.fixture(scope="module")
def direct_engine(direct_url):
    from ray import serve

    return serve.get_deployment_handle("LLMServer", app_name=APP)


def test_only_the_engine_deployment_runs(direct_url):
    from ray import serve

    routers = {"IngressRouter"} if ROUTER == "prefix" else set()
    assert set(serve.status().applications[APP].deployments) == {"LLMServer"} | routers


def test_stream_matches_non_stream(direct_url):
    body = {"prompt": "The direct path", "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    whole = httpx.post(direct_url + "/v1/completions", json=body, timeout=60).json()
    events = []
    with httpx.stream("POST", direct_url + "/v1/completions", json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = [line.removeprefix("data: ") for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    text = "".join(c["text"] for e in events[:-1] for c in json.loads(e)["choices"])
    assert text == whole["choices"][0]["text"] and whole["usage"]["completion_tokens"] == 12


def test_chat_and_messages_routes(direct_url):
    chat = httpx.post(direct_url + "/v1/chat/completions", timeout=60,
                      json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}).json()
    assert chat["object"] == "chat.completion" and chat["usage"]["completion_tokens"] <= 4
    message = httpx.post(direct_url + "/v1/messages", timeout=60,
                         json={"model": "pagedserve-tiny", "max_tokens": 4,
                               "messages": [{"role": "user", "content": "Hi"}]})
    assert message.status_code == 200 and message.json()["type"] == "message"
    assert httpx.get(direct_url + "/health", timeout=10).status_code == 200


def test_bad_request_is_an_openai_error_and_restarts_nothing(direct_url, direct_engine):
    replicas = sorted(direct_engine.broadcast("identity").results())
    r = httpx.post(direct_url + "/v1/completions", json={"prompt": "x", "temperature": -1}, timeout=30)
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["param"] == "temperature" and error["type"] == "invalid_request_error"
    assert sorted(direct_engine.broadcast("identity").results()) == replicas


def test_disconnect_mid_stream_aborts_and_frees_blocks(direct_url, direct_engine):
    disconnect_mid_stream(direct_url, direct_engine)  # the replica's own HTTP server cancels its generate


def test_handle_api(direct_url):
    from ray import serve

    handle = serve.get_app_handle(APP).options(stream=True)
    request = ChatCompletionRequest(messages=[{"role": "user", "content": "Hi"}], max_tokens=5, temperature=0,
                                    ignore_eos=True)
    [response] = list(handle.chat.remote(request))
    assert isinstance(response, ChatCompletionResponse) and response.usage.completion_tokens == 5
    chunks = list(handle.chat.remote(request.model_copy(update={"stream": True})))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == response.choices[0].message.content


@pytest.mark.skipif(INGRESS != "haproxy", reason="HAProxy asks the ingress request router; Ray's proxy has none")
def test_prefix_router_picks_the_replica_through_haproxy(direct_url, direct_engine):
    """Behind HAProxy alone, requests spread over the replicas by least connections; with router: prefix,
    IngressRouter sends every prompt with the same long prefix to the replica that holds it."""
    url, engine = direct_url, direct_engine
    before = [s.num_requests_finished for s in engine.broadcast("stats").results()]
    shared = " ".join(f"rule {i}: answer briefly and cite the handbook." for i in range(40))
    for i in range(4):
        r = httpx.post(url + "/v1/completions", timeout=60,
                       json={"prompt": f"{shared} Question {i}?", "max_tokens": 2, "temperature": 0})
        assert r.status_code == 200, r.text
        # Nobody tells the router that a request HAProxy forwarded has ended: until a replica report taken
        # after it arrives, it counts as queued there, and two queued would let the other replica win. Reports
        # are asked for every second, in a controller loop that runs every 0.5 s (SERVE_ENV), and reach the
        # router up to ~2 s old on a loaded 2-core host (CI saw [3, 3] with 1.2 s between requests).
        time.sleep(2.5)
    after = [s.num_requests_finished for s in engine.broadcast("stats").results()]
    assert sorted(a - b for a, b in zip(after, before)) == [0, 4]
    # A body the router cannot read is routed by load, and the replica answers its error.
    r = httpx.post(url + "/v1/completions", content=b'{"prompt": ', headers={"Content-Type": "application/json"},
                   timeout=30)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"


def test_every_replica_continues_a_stored_response(direct_url, direct_engine):
    """The Responses store is one actor per app (serve_app/response_store.py): a response one replica made is
    continued by any replica serving HTTP, its exchange in the new prompt."""
    from concurrent.futures import ThreadPoolExecutor

    ask = {"model": "pagedserve-tiny", "max_output_tokens": 3, "temperature": 0}
    first = httpx.post(direct_url + "/v1/responses", json={**ask, "input": "Hi"}, timeout=60).json()
    exchange = first["usage"]["input_tokens"] + first["usage"]["output_tokens"]
    before = [s.num_requests_finished for s in direct_engine.broadcast("stats").results()]

    def follow_up(i: int) -> dict:  # prompts of no common prefix: the router spreads them by load
        body = {**ask, "input": f"{'QWERTYUIOPAS'[i]} then?", "previous_response_id": first["id"]}
        return httpx.post(direct_url + "/v1/responses", json=body, timeout=60).json()

    with ThreadPoolExecutor(12) as pool:
        answers = list(pool.map(follow_up, range(12)))
    after = [s.num_requests_finished for s in direct_engine.broadcast("stats").results()]
    assert all(a - b >= 1 for a, b in zip(after, before)), (before, after)  # both replicas continued it
    assert all(r["status"] in ("completed", "incomplete") and r["previous_response_id"] == first["id"]
               and r["usage"]["input_tokens"] > exchange for r in answers)


def test_one_replica_app_serves_clients_itself_by_default(deploy_app):
    """The app as a user writes it (one replica, every serving setting the default: `direct_streaming: auto`,
    the prefix router): behind HAProxy or Ray's proxy the engine replica serves clients itself, with nothing to
    route (Serve refuses a custom router on a deployment HAProxy balances over)."""
    from ray import serve

    url = deploy_app(ONE, "/one", **ONE_ARGS)
    try:
        assert set(serve.status().applications[ONE].deployments) == {"LLMServer"}
        body = {"prompt": "One replica", "max_tokens": 4, "ignore_eos": True}
        response = httpx.post(url + "/v1/completions", json=body, timeout=60)
        assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 4
    finally:
        delete_app(ONE)
