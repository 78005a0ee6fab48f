"""Every bad request gets its status and the OpenAI error object; none restarts a replica."""

from __future__ import annotations

import threading

import httpx
import pytest

from tests.serve_app.conftest import SMALL_APP, SMALL_APP_KEYS, wait_for

MODEL = "pagedserve-tiny"


def _error(response: httpx.Response, status: int, param: str | None = None) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["message"]
    if param is not None:
        assert body["error"]["param"] == param, body
    return body["error"]


@pytest.fixture(scope="module")
def replicas_before(engine_handle):
    return sorted(engine_handle.broadcast("identity").results())


@pytest.mark.parametrize(
    "route, body, param",
    [
        ("/v1/completions", {"prompt": "x", "temperature": "hot"}, "temperature"),
        ("/v1/completions", {"prompt": "x", "temperature": -0.5}, "temperature"),
        ("/v1/completions", {"prompt": "x", "top_p": 0}, "top_p"),
        ("/v1/completions", {"prompt": "x", "n": 0}, "n"),
        ("/v1/completions", {"prompt": "x", "n": 1000}, "n"),
        ("/v1/completions", {"prompt": "x", "max_tokens": 0}, "max_tokens"),
        ("/v1/completions", {"prompt": "x", "logprobs": 30}, "logprobs"),
        ("/v1/completions", {"prompt": "x", "stop": ["s"] * 40}, "stop"),
        ("/v1/completions", {"prompt": "x", "logit_bias": {"abc": 1}}, "logit_bias"),
        ("/v1/completions", {"prompt": "x", "logit_bias": {"5": 500}}, "logit_bias"),
        ("/v1/completions", {"prompt": "x", "presence_penalty": 3}, "presence_penalty"),
        ("/v1/completions", {"prompt": "x", "min_tokens": 50, "max_tokens": 5}, "min_tokens"),
        ("/v1/completions", {"prompt": [1, 2, 10**9]}, "prompt"),
        ("/v1/completions", {"prompt": ""}, "prompt"),
        ("/v1/completions", {}, "prompt"),
        ("/v1/completions", {"prompt": "x", "stop_token_ids": [10**9]}, "stop_token_ids/logit_bias"),
        ("/v1/chat/completions", {"messages": []}, "messages"),
        ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 3}, "top_logprobs"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
         "messages.0.content.0"),
        ("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, "prompt"),
        ("/detokenize", {"tokens": [-1]}, "tokens"),
    ],
)
def test_invalid_values_are_400_naming_the_field(serve_app_url, route, body, param):
    error = _error(httpx.post(serve_app_url + route, json=body), 400, param)
    assert error["type"] == "invalid_request_error"


def test_malformed_json_and_non_object_body(serve_app_url):
    headers = {"content-type": "application/json"}
    assert (_error(httpx.post(serve_app_url + "/v1/completions", content=b"{oops", headers=headers), 400)["code"]
            == "invalid_json")
    _error(httpx.post(serve_app_url + "/v1/chat/completions", content=b"[1, 2]", headers=headers), 400)


def test_framework_errors_carry_the_error_object(serve_app_url):
    # Found by benchmarks/fuzz.py: Starlette's own answers (no such route, a method the route does not
    # serve, a body that is not UTF-8) were FastAPI's {"detail": ...}.
    error = _error(httpx.get(serve_app_url + "/v1/unknown"), 404)
    assert error["type"] == "not_found_error" and error["code"] == "not_found" and "/v1/unknown" in error["message"]
    r = httpx.put(serve_app_url + "/v1/completions", json={})
    assert _error(r, 405)["code"] == "method_not_allowed" and r.headers["Allow"] == "POST"
    headers = {"content-type": "application/json"}
    error = _error(httpx.post(serve_app_url + "/tokenize", content=b"\xff\xfe{", headers=headers), 400)
    assert error["code"] == "invalid_json"
    for r in (httpx.get(serve_app_url + "/v1/messages"),
              httpx.post(serve_app_url + "/v1/messages", content=b"\xff", headers=headers)):
        assert r.status_code in (400, 405)
        assert r.json() == {"type": "error",
                            "error": {"type": "invalid_request_error", "message": r.json()["error"]["message"]}}


def test_oversized_bodies_are_413_before_parsing(serve_app_url):
    big = b'{"prompt": "' + b"x" * (8 * 2**20) + b'"}'  # AppArgs.max_request_body_bytes: 8 MiB
    headers = {"content-type": "application/json"}
    error = _error(httpx.post(serve_app_url + "/v1/completions", content=big, headers=headers), 413)
    assert error["code"] == "request_too_large"

    def chunked():  # no Content-Length: counted as it arrives
        for i in range(0, len(big), 2**20):
            yield big[i:i + 2**20]

    _error(httpx.post(serve_app_url + "/v1/completions", content=chunked(), headers=headers), 413)
    r = httpx.post(serve_app_url + "/v1/messages", content=big, headers=headers)
    assert r.status_code == 413 and r.json()["error"]["type"] == "request_too_large"
    small = iter([b'{"prompt": "hi", ', b'"max_tokens": 2}'])  # a chunked body under the limit still works
    assert httpx.post(serve_app_url + "/v1/completions", content=small, headers=headers).status_code == 200


def test_unknown_model_is_404(serve_app_url):
    error = _error(httpx.post(serve_app_url + "/v1/completions", json={"model": "gpt-9", "prompt": "x"}), 404, "model")
    assert error["code"] == "model_not_found"


def test_prompt_too_long(serve_app_url):
    long_prompt = list(range(1, 1100))  # max_model_len is 1024
    error = _error(httpx.post(serve_app_url + "/v1/completions", json={"prompt": long_prompt}), 400, "prompt")
    assert error["code"] == "context_length_exceeded"
    error = _error(httpx.post(serve_app_url + "/v1/completions", json={"prompt": "hi", "max_tokens": 5000}), 400,
                   "max_tokens")
    assert error["code"] == "context_length_exceeded"


def test_streaming_errors_still_get_a_status(serve_app_url):
    r = httpx.post(serve_app_url + "/v1/chat/completions",
                   json={"messages": [{"role": "user", "content": "x"}], "stream": True, "temperature": 9})
    _error(r, 400, "temperature")


def test_bad_requests_restart_no_replica(serve_app_url, engine_handle, replicas_before):
    # Runs after the parametrized cases above in this module.
    for _ in range(3):
        httpx.post(serve_app_url + "/v1/completions", json={"prompt": [5, 10**9]})
    assert sorted(engine_handle.broadcast("identity").results()) == replicas_before
    assert all(engine_handle.broadcast("is_healthy").results())
    r = httpx.post(serve_app_url + "/v1/completions", json={"prompt": "still fine", "max_tokens": 3}, timeout=60)
    assert r.status_code == 200


def test_api_keys(small_app):
    url = small_app.url
    body = {"prompt": "x", "max_tokens": 2}
    _error(httpx.post(url + "/v1/completions", json=body), 401)
    assert _error(httpx.post(url + "/v1/completions", json=body, headers={"Authorization": "Bearer nope"}),
                  401)["type"] == "authentication_error"
    for key in SMALL_APP_KEYS:
        assert httpx.post(url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"},
                          timeout=60).status_code == 200
    assert httpx.get(url + "/health").status_code == 200  # no key needed outside /v1
    assert httpx.get(url + "/v1/models", headers={"Authorization": f"Bearer {SMALL_APP_KEYS[1]}"}).status_code == 200


def test_overload_is_429_with_retry_after(small_app):
    from ray import serve

    url, auth = small_app.url, small_app.auth  # one request runs, one waits
    handle = serve.get_deployment_handle("LLMServer", app_name=SMALL_APP)
    long = {"prompt": "x", "max_tokens": 1000, "ignore_eos": True}

    def hold() -> None:
        httpx.post(url + "/v1/completions", json=long, headers=auth, timeout=120)

    def stats():
        return handle.stats.remote().result()

    threads = [threading.Thread(target=hold, daemon=True) for _ in range(2)]
    threads[0].start()
    wait_for(lambda: stats().num_running == 1, interval=0.01)
    threads[1].start()
    wait_for(lambda: stats().num_waiting == 1, interval=0.01)  # one running, one waiting: the queue is full
    r = httpx.post(url + "/v1/completions", json={"prompt": "one more", "max_tokens": 2}, headers=auth, timeout=30)
    error = _error(r, 429)
    assert error["type"] == "rate_limit_error" and int(r.headers["Retry-After"]) >= 1
    assert "max_waiting_requests" in error["message"] and "ray::" not in error["message"]
    # A streamed Responses request too: refused before its first event, so with the status, not in-band.
    r = httpx.post(url + "/v1/responses", json={"input": "one more", "max_output_tokens": 2, "stream": True},
                   headers=auth, timeout=30)
    assert _error(r, 429)["type"] == "rate_limit_error"
    for t in threads:
        t.join()
