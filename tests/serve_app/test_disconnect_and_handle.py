"""A client that goes away frees its KV blocks; Python callers use the ingress through a handle."""

from __future__ import annotations

import httpx

from serve_app.protocol.openai import ChatCompletionChunk, ChatCompletionRequest, ChatCompletionResponse, CompletionRequest, CompletionResponse
from tests.serve_app.conftest import APP, wait_for


def _idle(engine_handle) -> bool:
    stats = engine_handle.broadcast("stats").results()
    return all(s.num_running == 0 and s.num_waiting == 0 and s.kv_cache_usage == 0 for s in stats)


def test_disconnect_mid_stream_aborts_and_frees_blocks(serve_app_url, engine_handle):
    wait_for(lambda: _idle(engine_handle))
    before = sum(s.generation_tokens for s in engine_handle.broadcast("stats").results())
    body = {"prompt": "keep going", "max_tokens": 900, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", serve_app_url + "/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        received = [next(lines) for _ in range(6)]
        assert any(line.startswith("data: {") for line in received)
    # The connection is closed: the ingress cancels the handle call, the replica aborts the request,
    # well before its 900 tokens, and its KV blocks go back to the pool.
    wait_for(lambda: _idle(engine_handle), timeout=20)
    assert sum(s.generation_tokens for s in engine_handle.broadcast("stats").results()) - before < 900


def test_handle_chat_and_completions():
    from ray import serve

    handle = serve.get_app_handle(APP).options(stream=True)
    request = ChatCompletionRequest(messages=[{"role": "user", "content": "Hi"}], max_tokens=5, temperature=0)
    [response] = list(handle.chat.remote(request))
    assert isinstance(response, ChatCompletionResponse) and response.usage.completion_tokens == 5
    chunks = list(handle.chat.remote(request.model_copy(update={"stream": True})))
    assert all(isinstance(c, ChatCompletionChunk) for c in chunks)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == response.choices[0].message.content
    [completion] = list(handle.completions.remote({"prompt": "Hello", "max_tokens": 3}))
    assert isinstance(completion, CompletionResponse) and completion.usage.completion_tokens == 3
    chunks = list(handle.completions.remote(CompletionRequest(prompt="Hello", max_tokens=3, stream=True)))
    assert sum(len(c.choices) for c in chunks) >= 1


def test_handle_errors_are_typed(serve_app_url):
    from ray import serve

    from serve_app.errors import APIError

    handle = serve.get_app_handle(APP).options(stream=True)
    try:
        list(handle.completions.remote({"prompt": "x", "model": "nope"}))
    except APIError as e:
        assert e.status == 404 and e.param == "model"
    else:
        raise AssertionError("expected an APIError")
