"""Disaggregated prefill/decode in the live app: one prefill and one decode replica of the tiny model. Greedy
tokens, logprobs and seeded samples equal the colocated app's (streamed or not, n > 1), with a LoRA adapter
too; prefix hits on the prefill side show in `cached_tokens`; short prompts stay on the decode replica; a
client's request_id reused while the KV of its first use is held gets its own KV; and every fault (a
transfer that fails, a lease that runs out, a prefill replica killed before the fetch, a client that goes
away) ends in a correct answer (or a clear 503 when so configured), never a hang, with both pools' KV idle
and nothing left staged. Faults are injected through the decode replica's hook, not by racing kills."""

from __future__ import annotations

import errno
import os
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import openai
import psutil
import pytest

from engine.shm_files import SHM_DIR, owner
from tests.lora_adapters import write_peft_adapter
from tests.serve_app.conftest import ENGINE, delete_app, wait_for

APP, PREFIX = "pd", "/pd"
LONG = "disaggregated " * 60  # ~240 tokens: above the threshold below
SHORT = "hi there"
ADAPTER = "sql"


def fresh(tag: str) -> str:
    """A long prompt no replica has cached (its first block differs): its uncached part is all of it."""
    return f"{tag} {time.time_ns()} " + LONG


@pytest.fixture(scope="module")
def adapter(tiny_model_path, tmp_path_factory) -> Path:
    return write_peft_adapter(tiny_model_path, tmp_path_factory.mktemp("pd_lora") / ADAPTER, 8,
                              ["q_proj", "v_proj", "down_proj"], seed=1, std=0.3)


@pytest.fixture(scope="module")
def app_url(deploy_app, adapter):
    yield deploy_app(APP, PREFIX, model="pagedserve-tiny", engine={**ENGINE, "max_num_batched_tokens": 64},
                     disaggregation={"min_uncached_prompt_tokens": 32, "kv_lease_s": 2.0, "transfer_timeout_s": 20},
                     lora_modules=[{"name": ADAPTER, "path": str(adapter)}])
    delete_app(APP)


@pytest.fixture(scope="module")
def tokenizer(tiny_model_path):
    from engine.tokenizer import load_tokenizer

    return load_tokenizer(tiny_model_path)


def _handle(deployment: str):
    from ray import serve

    return serve.get_deployment_handle(deployment, app_name=APP)


def _pd_stats() -> dict:
    [stats] = _handle("DecodeServer").broadcast("pd_stats").results()
    return stats


def _faults(faults: dict | None) -> None:
    _handle("DecodeServer").broadcast("set_pd_faults", faults).results()


def _stats(deployment: str):
    [stats] = _handle(deployment).broadcast("stats").results()
    return stats


def _our_files() -> list[str]:
    """Files in /dev/shm owned by this session's processes (Ray's workers, the replicas' engine processes):
    other sessions on the host have theirs."""
    ours = {os.getpid()} | {p.pid for p in psutil.Process().children(recursive=True)}
    return [p.name for p in Path(SHM_DIR).iterdir() if (owner(p.name) or ("", 0))[1] in ours]


def _leftovers() -> list:
    """What either pool still holds (requests, KV blocks, leases) or left in /dev/shm; empty when idle."""
    stats = {d: _stats(d) for d in ("PrefillServer", "DecodeServer")}
    busy = [(d, s.num_running, s.num_waiting, s.kv_cache_usage, s.num_kv_held) for d, s in stats.items()
            if s.num_running or s.num_waiting or s.kv_cache_usage or s.num_kv_held]
    return busy + _our_files()


def _assert_idle(timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while (left := _leftovers()) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not left, left


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="-", max_retries=0, timeout=60)


def _complete(url: str, prompt: str | list[int], **kw):
    return _client(url).completions.create(prompt=prompt, **{"model": "pagedserve-tiny", "max_tokens": 10,
                                                             "temperature": 0, **kw})


def test_disaggregated_answers_equal_colocated(app_url, serve_app_url):
    before = _pd_stats()
    ours, ref = _complete(app_url, LONG, logprobs=2), _complete(serve_app_url, LONG, logprobs=2)
    assert ours.choices[0].text == ref.choices[0].text
    for a, b in zip(ours.choices[0].logprobs.token_logprobs, ref.choices[0].logprobs.token_logprobs):
        assert a == pytest.approx(b, abs=1e-4)
    sampled = dict(n=2, temperature=0.8, seed=11)
    assert ([c.text for c in _complete(app_url, LONG, **sampled).choices]
            == [c.text for c in _complete(serve_app_url, LONG, **sampled).choices])
    chat = {"model": "pagedserve-tiny", "messages": [{"role": "user", "content": LONG}], "max_tokens": 8,
            "temperature": 0}
    streamed = "".join(c.choices[0].delta.content or ""
                       for c in _client(app_url).chat.completions.create(**chat, stream=True) if c.choices)
    assert streamed == _client(serve_app_url).chat.completions.create(**chat).choices[0].message.content
    after = _pd_stats()
    assert after["remote"] - before["remote"] == 3 and after["transfers"] - before["transfers"] == 3
    assert after["transfer_bytes"] > before["transfer_bytes"]
    _assert_idle()


def test_lora_remote_prefill_equals_colocated(app_url, tiny_model_path, adapter):
    """The prefill replica computes the prompt's KV with the request's adapter; the decode side caches it
    under the adapter's block hashes, so a later request on the prefix reuses the right KV."""
    from engine import LLM, SamplingParams
    from engine.lora.request import LoRARequest

    prompt = f"{time.time_ns()} " + "the adapter decodes what it prefilled " * 16
    before = _pd_stats()
    ours = _complete(app_url, prompt, model=ADAPTER, logprobs=1)
    assert _pd_stats()["remote"] == before["remote"] + 1
    llm = LLM(str(tiny_model_path), enable_lora=True, **ENGINE)  # the colocated engine, as the app configures it
    try:
        [ref] = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=10, logprobs=1), use_tqdm=False,
                             lora_request=LoRARequest(ADAPTER, 1, str(adapter)))
    finally:
        llm.shutdown()
    ref = ref.outputs[0]
    assert ours.choices[0].text == ref.text
    expected = [lp[token].logprob for token, lp in zip(ref.token_ids, ref.logprobs)]
    assert ours.choices[0].logprobs.token_logprobs == pytest.approx(expected, abs=1e-4)
    again = _complete(app_url, prompt, model=ADAPTER, logprobs=1)
    assert again.usage.prompt_tokens_details.cached_tokens >= 64 and again.choices[0].text == ref.text
    _assert_idle()


def test_reused_request_id_gets_its_own_kv(app_url, serve_app_url, tokenizer):
    """A client reuses its request_id while the prefill side holds the KV of the first use (a request_id
    is refused only while a request of that id runs on the engine): each gets its own tokens, and nothing
    is left held or staged."""
    first = tokenizer.encode(f"{time.time_ns()} " + LONG)
    # As long and ending in the same token (which the decode side computes itself): a mix-up would load the
    # other request's KV without notice, and only that KV tells the two apart.
    second = tokenizer.encode(f"{time.time_ns()} " + "a prompt of other words " * 80)[:len(first) - 1] + first[-1:]
    rid = f"reused-{uuid.uuid4().hex}"
    expected = [_complete(serve_app_url, ids, max_tokens=4).choices[0].text for ids in (first, second)]
    assert expected[0] != expected[1]
    _faults({"pause_before_fetch_s": 1.5})  # the first's KV stays held for 1.5 s (its lease: 2 s)
    try:
        with ThreadPoolExecutor(2) as pool:
            answers = [pool.submit(_complete, app_url, first, max_tokens=4, extra_body={"request_id": rid})]
            wait_for(lambda: _stats("PrefillServer").num_kv_held, timeout=20, interval=0.05)
            time.sleep(0.5)  # the first decodes (4 tokens) well before the second reaches the decode engine
            answers.append(pool.submit(_complete, app_url, second, max_tokens=4, extra_body={"request_id": rid}))
            texts = [a.result().choices[0].text for a in answers]
    finally:
        _faults(None)
    assert texts == expected
    _assert_idle()


def test_request_id_in_flight_is_refused(app_url):
    body = {"model": "pagedserve-tiny", "prompt": SHORT, "max_tokens": 1000, "ignore_eos": True,  # seconds of work
            "request_id": f"dup-{uuid.uuid4().hex}"}
    with httpx.stream("POST", app_url + "/v1/completions", json={**body, "stream": True}, timeout=60) as stream:
        lines = stream.iter_lines()  # held: a dropped iterator closes the connection, which aborts the request
        next(lines)
        r = httpx.post(app_url + "/v1/completions", json={**body, "max_tokens": 1}, timeout=60)
    assert r.status_code == 400 and "already in flight" in r.json()["error"]["message"], r.text
    _assert_idle()


def test_a_failed_write_leaves_no_staged_file(tmp_path):
    """Received KV is written rank by rank; a write that fails (here: the disk fills up in rank 1's)
    removes what was written, whole or half."""
    from serve_app.disaggregation.transfer import write_staged

    class DiskFull(np.ndarray):
        def tofile(self, fid, *args, **kwargs):
            Path(fid).write_bytes(b"half")
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    arrays = [np.zeros(64, dtype=np.uint8), np.zeros(64, dtype=np.uint8).view(DiskFull)]
    with pytest.raises(OSError, match="No space"):
        write_staged(arrays, "pagedserve-rx-1-test", str(tmp_path))
    assert list(tmp_path.iterdir()) == []


def _prefill_only(prompt_ids: list[int]) -> None:
    """Prefill a prompt on the prefill replica alone (its KV released at once, its blocks left cached there)."""
    from engine.core.block_hash import hash_block_chain
    from engine.core.prepared_request import PreparedRequest
    from engine.sampling_params import SamplingParams
    from serve_app.disaggregation.transfer import KVFetchRequest

    request = PreparedRequest(f"warm-{uuid.uuid4().hex}", None, prompt_ids, SamplingParams(max_tokens=1, temperature=0),
                              time.monotonic(), block_hashes=hash_block_chain(prompt_ids, 16))
    result = _handle("PrefillServer").prefill.remote(request).result()
    _handle("PrefillServer").release_kv.remote(KVFetchRequest(result.replica_id, result.request_id)).result()


def test_prefill_side_cache_hits_show_in_usage_and_short_prompts_stay_local(app_url, tokenizer):
    prefix = tokenizer.encode(f"{time.time_ns()} " + "shared prefix " * 40)  # 5 full blocks at least
    _prefill_only(prefix)  # the decode replica has never seen it
    prefill_hits, decode_hits = _stats("PrefillServer").prefix_cache_hits, _stats("DecodeServer").prefix_cache_hits
    before = _pd_stats()
    out = _complete(app_url, prefix + tokenizer.encode(" and a tail that nobody has seen before" * 6))
    assert _pd_stats()["remote"] == before["remote"] + 1  # the tail alone is above min_uncached_prompt_tokens
    cached = out.usage.prompt_tokens_details.cached_tokens
    assert cached >= 64
    wait_for(lambda: _stats("PrefillServer").prefix_cache_hits - prefill_hits == cached, timeout=5)
    assert _stats("DecodeServer").prefix_cache_hits == decode_hits  # none of it was cached on the decode side
    before = _pd_stats()
    _complete(app_url, SHORT)
    after = _pd_stats()
    assert after.get("local_short_prompt", 0) == before.get("local_short_prompt", 0) + 1
    assert after["remote"] == before["remote"]
    _assert_idle()


@pytest.mark.parametrize("faults", [{"fail_transfer": True}, {"pause_before_fetch_s": 3.5}],
                         ids=["transfer_fails", "lease_expires"])
def test_failed_transfers_are_recomputed_locally(app_url, serve_app_url, faults):
    before = _pd_stats()
    _faults(faults)
    try:
        prompt = fresh("fault")
        assert _complete(app_url, prompt).choices[0].text == _complete(serve_app_url, prompt).choices[0].text
    finally:
        _faults(None)
    assert _pd_stats().get("local_fallback", 0) == before.get("local_fallback", 0) + 1
    _assert_idle()


def test_failed_transfer_can_be_a_503(app_url):
    _faults({"fail_transfer": True, "on_transfer_failure": "fail"})
    try:
        r = httpx.post(app_url + "/v1/completions", json={"prompt": fresh("fail"), "max_tokens": 4}, timeout=60)
    finally:
        _faults(None)
    assert r.status_code == 503 and r.json()["error"]["code"] == "kv_transfer_failed"
    _assert_idle()


@pytest.mark.parametrize("faults", [{"pause_before_fetch_s": 3.0}, {"pause_in_write_s": 2.0}],
                         ids=["before_fetch", "while_writing"])
def test_client_gone_during_the_transfer_frees_both_sides(app_url, faults):
    _faults(faults)
    try:
        with pytest.raises(httpx.TimeoutException):
            httpx.post(app_url + "/v1/completions", json={"prompt": fresh("gone"), "max_tokens": 4}, timeout=1.0)
        time.sleep(faults.get("pause_in_write_s", 0))  # the writing thread, which outlives the request, is done
        _assert_idle()
    finally:
        _faults(None)


def test_prefill_replica_killed_before_the_fetch(app_url, serve_app_url):
    import ray

    [replica] = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                 if a["name"].startswith(f"SERVE_REPLICA::{APP}#PrefillServer#")]
    _faults({"pause_before_fetch_s": 3.0})
    try:
        import threading

        threading.Timer(1.0, lambda: ray.kill(ray.get_actor(replica, namespace="serve"), no_restart=True)).start()
        start = time.monotonic()
        prompt = fresh("killed")
        text = _complete(app_url, prompt).choices[0].text
        assert time.monotonic() - start < 15  # no wait for a fetch pinned to a dead replica
    finally:
        _faults(None)
    assert text == _complete(serve_app_url, prompt).choices[0].text
    # Serve replaces the prefill replica; remote prefills resume.
    wait_for(lambda: [a for a in ray.util.list_named_actors(all_namespaces=True)
                      if a["name"].startswith(f"SERVE_REPLICA::{APP}#PrefillServer#") and a["name"] != replica],
             timeout=90, interval=0.5)
    before = _pd_stats()["remote"]
    wait_for(lambda: _complete(app_url, fresh("again")).choices[0].text and _pd_stats()["remote"] > before,
             timeout=60, interval=0.5)
    _assert_idle()
