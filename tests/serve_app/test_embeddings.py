"""`/v1/embeddings` on an app whose engine runs task 'embed' (the built-in Qwen3-Embedding-style model), through
the official `openai` SDK: every input form equals Hugging Face's vector within 1e-5, as floats or base64 (the
SDK's default); concurrent requests of different lengths, batched together, equal the same requests one at a
time; `dimensions` cuts a Matryoshka vector; bad fields and the wrong task are 400s naming them; the app's
DeploymentHandle answers `embeddings`; no KV is held afterwards."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import openai
import pytest

from engine.models.builtin import materialize_builtin
from tests.engine.pooling.test_embed import hf_embedding
from tests.serve_app.conftest import ENGINE, delete_app, engine_idle, wait_for

MODEL = "pagedserve-tiny-embed"
APP_NAME = "embed"
TEXTS = ["Hello world", "Embeddings for retrieval pipelines, " * 6, "Short"]


@pytest.fixture(scope="module")
def embed_url(deploy_app) -> Iterator[str]:
    yield deploy_app(APP_NAME, "/embed", model=MODEL, num_replicas=1, engine={**ENGINE, "task": "embed"})
    delete_app(APP_NAME)  # its replica would otherwise share the 2 cores with every later test


@pytest.fixture(scope="module")
def client(embed_url) -> openai.OpenAI:
    return openai.OpenAI(base_url=embed_url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(materialize_builtin(MODEL))


def _oracle(tokenizer, item) -> np.ndarray:
    ids = item if isinstance(item, list) else tokenizer.encode(item)
    return hf_embedding(materialize_builtin(MODEL), ids, "last")


def test_every_input_form_equals_hugging_face(client, tokenizer):
    one = client.embeddings.create(model=MODEL, input=TEXTS[0])  # the SDK asks for base64 and decodes it
    np.testing.assert_allclose(one.data[0].embedding, _oracle(tokenizer, TEXTS[0]), atol=1e-5)
    assert one.usage.prompt_tokens == len(tokenizer.encode(TEXTS[0])) and one.model == MODEL
    many = client.embeddings.create(model=MODEL, input=TEXTS, encoding_format="float")
    assert [d.index for d in many.data] == [0, 1, 2]
    for text, item in zip(TEXTS, many.data):
        np.testing.assert_allclose(item.embedding, _oracle(tokenizer, text), atol=1e-5)
    ids = [[5, 6, 7, 8], [300, 301, 302]]
    by_ids = client.embeddings.create(model=MODEL, input=ids)
    for prompt, item in zip(ids, by_ids.data):
        np.testing.assert_allclose(item.embedding, _oracle(tokenizer, prompt), atol=1e-5)
    single_ids = client.embeddings.create(model=MODEL, input=ids[0])
    np.testing.assert_allclose(single_ids.data[0].embedding, by_ids.data[0].embedding, atol=1e-6)
    cut = client.embeddings.create(model=MODEL, input=TEXTS[0], dimensions=16).data[0].embedding
    full = np.asarray(client.embeddings.create(model=MODEL, input=TEXTS[0]).data[0].embedding)
    assert len(cut) == 16 and abs(np.linalg.norm(cut) - 1) < 1e-5  # the first 16 values, normalized again
    assert np.corrcoef(cut, full[:16])[0, 1] > 0.9999


def test_concurrent_requests_of_different_lengths_equal_one_at_a_time(client, engine_url_idle):
    prompts = [f"{'word ' * (3 + 7 * i)}end {i}" for i in range(8)]
    alone = [client.embeddings.create(model=MODEL, input=p).data[0].embedding for p in prompts]
    with ThreadPoolExecutor(8) as pool:
        together = list(pool.map(lambda p: client.embeddings.create(model=MODEL, input=p).data[0].embedding,
                                 prompts))
    np.testing.assert_allclose(together, alone, atol=1e-5)


@pytest.fixture
def engine_url_idle(embed_url):
    from ray import serve

    yield
    engine = serve.get_deployment_handle("LLMServer", app_name=APP_NAME)
    wait_for(lambda: engine_idle(engine), timeout=10)  # every prompt pooled: no KV held, nothing queued


@pytest.mark.parametrize("body, param, fragment", [
    ({"input": "x", "dimensions": 65}, "dimensions", "not a size this model embeds in"),
    ({"input": ""}, "input", "must not be empty"),
    ({"input": []}, "input", "must not be empty"),
    ({"input": [[1, 2], []]}, "input", "must not be empty"),
    ({"input": [99999]}, "input", "outside the vocabulary"),
    ({"input": "x", "truncate_prompt_tokens": 8}, "truncate_prompt_tokens", "not supported"),
    ({"input": "x", "encoding_format": "int8"}, "encoding_format", ""),
    ({"input": "x", "model": "other"}, "model", "does not exist"),
])
def test_bad_fields_are_400s_naming_them(embed_url, body, param, fragment):
    r = httpx.post(embed_url + "/v1/embeddings", json=body, timeout=30)
    assert r.status_code in (400, 404), r.text
    error = r.json()["error"]
    assert error["param"] == param and fragment in error["message"]


def test_the_wrong_task_is_refused_by_name(embed_url, serve_app_url):
    chat = httpx.post(embed_url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]},
                      timeout=30)
    assert chat.status_code == 400 and chat.json()["error"]["code"] == "unsupported_task"
    assert "served with task 'embed'" in chat.json()["error"]["message"]
    embed = httpx.post(serve_app_url + "/v1/embeddings", json={"input": "hi"}, timeout=30)
    assert embed.status_code == 400 and embed.json()["error"]["param"] == "model"
    assert "/v1/embeddings needs task 'embed'" in embed.json()["error"]["message"]


def test_deployment_handle_embeds(embed_url, tokenizer):
    from ray import serve

    from serve_app.protocol.embeddings import EmbeddingResponse

    handle = serve.get_app_handle(APP_NAME).options(stream=True)
    [response] = list(handle.embeddings.remote({"input": TEXTS[2]}))
    assert isinstance(response, EmbeddingResponse)
    np.testing.assert_allclose(response.data[0].embedding, _oracle(tokenizer, TEXTS[2]), atol=1e-5)
