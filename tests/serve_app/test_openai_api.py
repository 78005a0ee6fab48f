"""The OpenAI routes through the official `openai` SDK, a real client, against the running app."""

from __future__ import annotations

import httpx
import openai
import psutil
import pytest

from tests.serve_app.conftest import INGRESS

MODEL = "pagedserve-tiny"


@pytest.fixture(scope="module")
def client(serve_app_url) -> openai.OpenAI:
    return openai.OpenAI(base_url=serve_app_url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def tokenize(serve_app_url):
    return lambda text: httpx.post(serve_app_url + "/tokenize", json={"prompt": text}).json()["tokens"]


@pytest.fixture(scope="module")
def detokenize(serve_app_url):
    return lambda ids: httpx.post(serve_app_url + "/detokenize", json={"tokens": ids}).json()["prompt"]


def test_http_arrives_the_way_the_session_was_started(serve_app_url):
    """HAProxy in front (as `make run`) or Ray's proxy actor alone (a plain `serve run`): the environment
    the session set took effect."""
    names = {p.info["name"] for p in psutil.process_iter(["name"])}
    assert ("haproxy" in names) == (INGRESS == "haproxy")


def test_models(client):
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_completion(client, tokenize):
    r = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=12, temperature=0)
    assert r.object == "text_completion" and len(r.choices) == 1
    choice = r.choices[0]
    assert choice.finish_reason == "length" and choice.text
    assert r.usage.completion_tokens == 12 and r.usage.prompt_tokens == len(tokenize("Once upon a time"))
    again = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=12, temperature=0)
    assert again.choices[0].text == choice.text  # greedy is deterministic


def test_completion_stream_matches_non_stream(client):
    full = client.completions.create(model=MODEL, prompt="The river", max_tokens=20, temperature=0)
    chunks = list(client.completions.create(model=MODEL, prompt="The river", max_tokens=20, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full.choices[0].text
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 20


def test_chat(client):
    messages = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hello!"}]
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0)
    assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 10
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == r.choices[0].message.content
    assert chunks[-1].usage.total_tokens == r.usage.total_tokens


def test_max_completion_tokens_and_content_parts(client):
    r = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}]}],
        max_completion_tokens=3,
    )
    assert r.usage.completion_tokens == 3


def test_n_and_seed(client):
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Pick"}], n=2, max_tokens=8,
                                       temperature=1.0, seed=11)
    assert [c.index for c in r.choices] == [0, 1]
    assert r.choices[0].message.content != r.choices[1].message.content
    again = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Pick"}], n=2,
                                           max_tokens=8, temperature=1.0, seed=11)
    assert [c.message.content for c in again.choices] == [c.message.content for c in r.choices]
    streamed = client.completions.create(model=MODEL, prompt="abc", n=2, max_tokens=6, stream=True, seed=3)
    per_index: dict[int, str] = {}
    for chunk in streamed:
        for c in chunk.choices:
            per_index[c.index] = per_index.get(c.index, "") + c.text
    assert sorted(per_index) == [0, 1]


def test_chat_logprobs(client):
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=5,
                                       temperature=0, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == 5
    for entry in content:
        assert len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob >= entry.top_logprobs[2].logprob
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)  # greedy: the top token


def test_completion_logprobs_and_echo_on_token_ids(client, serve_app_url, detokenize):
    prompt = [1, 415, 2936, 9060, 285, 1142, 10575]
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0, logprobs=2, echo=True)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(prompt) + 4
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(isinstance(x, float) for x in lp.token_logprobs[1:])
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    assert r.choices[0].text.startswith(detokenize(prompt))
    # The echoed prompt logprobs are the engine's prompt_logprobs.
    direct = httpx.post(serve_app_url + "/v1/completions", json={
        "model": MODEL, "prompt": prompt, "max_tokens": 1, "prompt_logprobs": 2, "echo": True, "logprobs": 2},
        timeout=60).json()
    assert direct["choices"][0]["logprobs"]["token_logprobs"][: len(prompt)] == lp.token_logprobs[: len(prompt)]
    from engine import LLM, SamplingParams

    engine = LLM(MODEL, max_model_len=1024).generate([prompt], SamplingParams(max_tokens=1, prompt_logprobs=2),
                                                     use_tqdm=False)[0]
    expected = [None] + [e[t].logprob for t, e in zip(prompt[1:], engine.prompt_logprobs[1:])]
    assert lp.token_logprobs[: len(prompt)] == pytest.approx(expected, abs=1e-5)


def test_batch_of_prompts(client):
    r = client.completions.create(model=MODEL, prompt=["first one", "second one", "third"], max_tokens=4, temperature=0)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert r.usage.completion_tokens == 12


def test_stop_and_sampling_knobs(client, detokenize):
    base = client.completions.create(model=MODEL, prompt="Tell me", max_tokens=16, temperature=0)
    text = base.choices[0].text
    stop = text[5:9]
    r = client.completions.create(model=MODEL, prompt="Tell me", max_tokens=16, temperature=0, stop=[stop])
    assert r.choices[0].finish_reason == "stop" and r.choices[0].text == text[: text.index(stop)]
    r = client.completions.create(model=MODEL, prompt="Tell me", max_tokens=8, temperature=0.7, top_p=0.9,
                                  presence_penalty=0.5, frequency_penalty=0.5, logit_bias={"777": 100},
                                  extra_body={"top_k": 40, "min_p": 0.01, "repetition_penalty": 1.1})
    assert r.usage.completion_tokens == 8
    forced = client.completions.create(model=MODEL, prompt="x", max_tokens=3, logit_bias={"777": 100})
    assert forced.choices[0].text.strip() == detokenize([777, 777, 777]).strip()


def test_cached_tokens_are_reported(client):
    prompt = " ".join(["shared prefix words"] * 30)
    client.completions.create(model=MODEL, prompt=prompt, max_tokens=2)
    counts = [client.completions.create(model=MODEL, prompt=prompt,
                                        max_tokens=2).usage.prompt_tokens_details.cached_tokens
              for _ in range(4)]
    assert max(counts) > 0  # at least one landed on a replica holding the prefix


def test_tokenize_detokenize_version_health(serve_app_url):
    t = httpx.post(serve_app_url + "/tokenize", json={"prompt": "Hello world"}).json()
    assert t["count"] == len(t["tokens"]) and t["max_model_len"] == 1024
    assert t["tokens"][0] == 1  # BOS
    assert httpx.post(serve_app_url + "/detokenize", json={"tokens": t["tokens"][1:]}).json()["prompt"] == "Hello world"
    chat = httpx.post(serve_app_url + "/tokenize", json={"messages": [{"role": "user", "content": "Hi"}]}).json()
    assert chat["tokens"][0] == 1
    assert httpx.get(serve_app_url + "/version").json()["version"]
    assert httpx.get(serve_app_url + "/health").status_code == 200


def test_openapi_describes_every_route(serve_app_url):
    spec = httpx.get(serve_app_url + "/openapi.json").json()
    for path in ("/v1/completions", "/v1/chat/completions", "/v1/models", "/tokenize", "/detokenize", "/health",
                 "/version"):
        assert path in spec["paths"], path
    bad_body = spec["paths"]["/v1/completions"]["post"]["responses"]
    assert "400" in bad_body and "422" not in bad_body  # invalid bodies are 400, as OpenAI answers
