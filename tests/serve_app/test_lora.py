"""Multi-LoRA serving through the app: adapters named as models through the `openai` and `anthropic` SDKs,
`/v1/models`, runtime load and unload (off by default, behind the API keys, only under lora_root),
404 for unknown adapters, 400 for bad ones with the engine still serving, the registry shared by ingress
replicas through lora_root, and, live on two engine replicas, an adapter's requests routed to the replica
that holds it."""

from __future__ import annotations

import os
import re
import shutil

import anthropic
import httpx
import openai
import pytest
from ray import serve

from serve_app.lora_registry import REGISTRY_FILE, AdapterNotFound, LoRAModule, LoRARegistry
from tests.lora_adapters import write_peft_adapter
from tests.serve_app.conftest import ENGINE, delete_app

BASE = "pagedserve-tiny"
KEY = "lora-test-key"
APP = "lora"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def adapters(tiny_model_path, tmp_path_factory):
    """Adapter folders of the tiny model: two declared in lora_modules (outside lora_root), one under
    lora_root for runtime loads, and a corrupt one there."""
    outside, root = tmp_path_factory.mktemp("declared"), tmp_path_factory.mktemp("lora_root")
    write_peft_adapter(tiny_model_path, outside / "sql", 8, ["q_proj", "v_proj", "down_proj"], seed=1, std=0.3)
    write_peft_adapter(tiny_model_path, outside / "chat", 4, ["o_proj", "gate_proj", "up_proj"], seed=2, std=0.3)
    shutil.copytree(outside / "sql", root / "runtime")
    shutil.copytree(outside / "sql", root / "corrupt")
    (root / "corrupt" / "adapter_config.json").write_text('{"r": 8, "lora_alpha": 16, "target_modules": ["q_proj"], '
                                                          '"use_dora": true}')
    return outside, root


@pytest.fixture(scope="module")
def lora_url(deploy_app, adapters) -> str:
    outside, root = adapters
    yield deploy_app(APP, "/lora", model=BASE, num_replicas=2, api_keys=[KEY], lora_root=str(root),
                     allow_runtime_lora_updating=True, engine={**ENGINE, "max_loras": 2},
                     lora_modules=[{"name": "sql", "path": str(outside / "sql")},
                                   {"name": "chat", "path": str(outside / "chat")}])
    delete_app(APP)  # its three replicas would otherwise share the 2 cores with every later test


@pytest.fixture(scope="module")
def client(lora_url) -> openai.OpenAI:
    return openai.OpenAI(base_url=lora_url + "/v1", api_key=KEY, max_retries=0, timeout=60)


def _complete(client, model: str, prompt: str = "Once upon a time", max_tokens: int = 12):
    return client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                     extra_body={"ignore_eos": True})


def test_models_list_adapters_with_their_parent(client, adapters):
    cards = {m.id: m for m in client.models.list().data}
    assert list(cards)[:3] == [BASE, "sql", "chat"]
    assert cards["sql"].parent == BASE and cards["sql"].root == str(adapters[0] / "sql")
    assert getattr(cards[BASE], "parent", None) is None


def test_adapters_are_models_on_every_route(client, lora_url):
    base, sql = _complete(client, BASE), _complete(client, "sql")
    assert sql.model == "sql" and base.model == BASE
    assert sql.choices[0].text != base.choices[0].text  # the adapter changes the output
    assert _complete(client, f"{BASE}:sql").choices[0].text == sql.choices[0].text  # Ray Serve LLM's naming
    assert _complete(client, "chat").choices[0].text not in (sql.choices[0].text, base.choices[0].text)
    messages = [{"role": "user", "content": "Hello"}]
    chat = client.chat.completions.create(model="sql", messages=messages, max_tokens=6, temperature=0)
    assert chat.model == "sql" and chat.usage.completion_tokens == 6
    streamed = client.chat.completions.create(model="sql", messages=messages, max_tokens=6, temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == chat.choices[0].message.content
    claude = anthropic.Anthropic(base_url=lora_url, api_key=KEY, max_retries=0)
    message = claude.messages.create(model="chat", max_tokens=5, messages=messages)
    assert message.usage.output_tokens > 0


def test_unknown_adapters_are_404_naming_them(client, lora_url):
    with pytest.raises(openai.NotFoundError, match="`nope` does not exist"):
        _complete(client, "nope")
    with pytest.raises(openai.NotFoundError, match=f"`{BASE}:nope` does not exist"):
        client.chat.completions.create(model=f"{BASE}:nope", messages=[{"role": "user", "content": "x"}], max_tokens=2)
    r = httpx.post(lora_url + "/v1/messages", headers=AUTH, timeout=60,
                   json={"model": "nope", "max_tokens": 2, "messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 404 and "`nope`" in r.json()["error"]["message"]


def _post(url: str, route: str, body: dict, headers: dict | None = AUTH) -> httpx.Response:
    return httpx.post(url + route, json=body, headers=headers, timeout=60)


def test_runtime_load_and_unload(client, lora_url, adapters):
    outside, root = adapters
    load = {"lora_name": "runtime", "lora_path": str(root / "runtime")}
    assert _post(lora_url, "/v1/load_lora_adapter", load, headers=None).status_code == 401  # behind the API keys
    r = _post(lora_url, "/v1/load_lora_adapter", load)
    assert r.status_code == 200 and "runtime" in r.text
    assert "runtime" in [m.id for m in client.models.list().data]
    # The same files as `sql`: the same tokens (and, by digest, the same cached blocks).
    assert _complete(client, "runtime").choices[0].text == _complete(client, "sql").choices[0].text
    assert _post(lora_url, "/v1/load_lora_adapter", load).status_code == 400  # the name is taken
    assert _post(lora_url, "/v1/load_lora_adapter", {**load, "load_inplace": True}).status_code == 200
    r = _post(lora_url, "/v1/unload_lora_adapter", {"lora_name": "runtime"})
    assert r.status_code == 200
    with pytest.raises(openai.NotFoundError):
        _complete(client, "runtime")
    assert _post(lora_url, "/v1/unload_lora_adapter", {"lora_name": "runtime"}).status_code == 404
    assert _post(lora_url, "/v1/unload_lora_adapter", {"lora_name": "sql"}).status_code == 400  # declared in config


def test_runtime_loads_are_refused_outside_lora_root_and_when_bad(client, lora_url, adapters, serve_app_url):
    outside, root = adapters
    for path in (str(outside / "sql"), str(root / ".." / outside.name / "sql"), "/etc", "../../etc"):
        r = _post(lora_url, "/v1/load_lora_adapter", {"lora_name": "escape", "lora_path": path})
        assert (r.status_code == 400
                and r.json()["error"]["message"] == "lora_path: must be a folder under the app's lora_root")
    r = _post(lora_url, "/v1/load_lora_adapter", {"lora_name": "bad", "lora_path": "corrupt"})
    assert r.status_code == 400 and "use_dora" in r.json()["error"]["message"]
    r = _post(lora_url, "/v1/load_lora_adapter", {"lora_name": "missing", "lora_path": "nothing-here"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "lora_path"
    assert _complete(client, "sql").usage.completion_tokens == 12  # still serving
    # Off unless allow_runtime_lora_updating: the default app has no such route.
    assert _post(serve_app_url, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "y"}, None).status_code == 404


def test_disk_problems_are_answered_naming_the_path(client, lora_url, adapters):
    """An adapter path that cannot be read is the request's fault (400 naming it); a registry that cannot be
    read or written is the deployment's (500 naming the file under lora_root); the app goes on serving.
    Made so that they fail for root too (chmod does not stop root): a symbolic link loop, a name too long
    for the file system, a directory where the registry's lock file goes, a corrupt registry file."""
    outside, root = adapters
    (root / "loop").symlink_to(root / "loop")
    unreadable = {"loop": str(root / "loop"), "x" * 300: "File name too long"}
    if os.geteuid() != 0:  # permissions hold for other users only
        shutil.copytree(root / "runtime", root / "locked")
        (root / "locked").chmod(0)
        unreadable["locked"] = "PermissionError"
    try:
        for path, named in unreadable.items():
            r = _post(lora_url, "/v1/load_lora_adapter", {"lora_name": "unreadable", "lora_path": path})
            error = r.json()["error"]
            assert r.status_code == 400 and error["param"] == "lora_path" and named in error["message"], error
    finally:
        (root / "loop").unlink()
        if (root / "locked").exists():
            (root / "locked").chmod(0o755)
            shutil.rmtree(root / "locked")
    lock, registry = root / (REGISTRY_FILE + ".lock"), root / REGISTRY_FILE
    lock.unlink(missing_ok=True)
    lock.mkdir()  # the registry cannot be locked, hence not written (as a read-only lora_root would have it)
    try:
        for route, body in (("load", {"lora_name": "w", "lora_path": "runtime"}), ("unload", {"lora_name": "w"})):
            r = _post(lora_url, f"/v1/{route}_lora_adapter", body)
            message = r.json()["error"]["message"]
            assert r.status_code == 500 and message.startswith(
                f"lora_root: cannot lock the LoRA adapter registry {registry}")
            assert str(lock) in message, message
    finally:
        lock.rmdir()
    saved = registry.read_bytes() if registry.exists() else None
    registry.write_text("{not json")
    try:
        with pytest.raises(openai.InternalServerError,
                           match=re.escape(f"the LoRA adapter registry {registry} is corrupt")):
            _complete(client, "runtime-or-not")
    finally:
        registry.unlink()
        if saved is not None:
            registry.write_bytes(saved)
    assert _complete(client, "sql").usage.completion_tokens == 12  # still serving


def test_an_adapter_sticks_to_the_replica_holding_it(client):
    """Live, two engine replicas: after the first request for an adapter, the router prefers the replica
    that reports holding it (or that it sent the adapter to since that report)."""
    prompts = [f"Request {i} about tables" for i in range(12)]
    for prompt in prompts:
        _complete(client, "chat", prompt, max_tokens=2)
    handle = serve.get_deployment_handle("LLMServer", app_name=APP)
    counts = [c.get("chat", 0) for c in handle.broadcast("lora_requests").results()]
    assert len(counts) == 2 and sum(counts) >= len(prompts)
    assert max(counts) >= sum(counts) - 2, counts


def test_registry_is_shared_through_lora_root(tiny_model_path, adapters):
    """Two ingress replicas (or a restarted one) see each other's runtime loads; digests follow the files."""
    from engine.models.config import ModelConfig

    outside, root = adapters
    copy = root.parent / (root.name + "-registry")
    shutil.copytree(root, copy)
    config = ModelConfig.from_pretrained(tiny_model_path)
    modules = [LoRAModule(name="sql", path=str(outside / "sql"))]
    a, b = (LoRARegistry(BASE, config, 16, modules, str(copy)) for _ in range(2))
    entry = a.load("fresh", "runtime")
    assert b.resolve("fresh") == entry and b.resolve(f"{BASE}:fresh") == entry
    assert entry.digest == a.resolve("sql").digest  # the same files
    assert entry.lora_int_id > a.resolve("sql").lora_int_id
    restarted = LoRARegistry(BASE, config, 16, modules, str(copy))
    assert [e.name for e in restarted.entries()] == ["sql", "fresh"] and (copy / REGISTRY_FILE).is_file()
    newer = b.load("fresh", "runtime", replace=True)
    assert newer.lora_int_id != entry.lora_int_id and a.resolve("fresh") == newer  # a new version, a new id
    b.unload("fresh")
    with pytest.raises(AdapterNotFound):
        a.resolve("fresh")
    assert a.resolve(BASE) is None and a.resolve(None) is None
