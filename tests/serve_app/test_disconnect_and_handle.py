"""A client that goes away frees its KV blocks; Python callers use the ingress through a handle."""

from __future__ import annotations

from serve_app.protocol.openai import (
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
)
from tests.serve_app.conftest import APP, disconnect_mid_stream


def test_disconnect_mid_stream_aborts_and_frees_blocks(serve_app_url, engine_handle):
    disconnect_mid_stream(serve_app_url, engine_handle)  # through the ingress, which cancels its handle call


def test_handle_chat_and_completions(serve_app_url):
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
