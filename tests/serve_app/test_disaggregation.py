"""Disaggregated prefill/decode in the live app: one prefill and one decode replica of the tiny model. Greedy
tokens, logprobs and seeded samples equal the colocated app's (streamed or not, n > 1); prefix hits on the
prefill side show in `cached_tokens`; short prompts stay on the decode replica; and every fault (a transfer
that fails, a lease that runs out, a prefill replica killed before the fetch, a client that goes away)
ends in a correct answer (or a clear 503 when so configured), never a hang, with both pools' KV idle and
nothing left staged. Faults are injected through the decode replica's hook, not by racing kills."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import openai
import pytest

from tests.serve_app.conftest import ENGINE, wait_for

APP, PREFIX = "pd", "/pd"
LONG = "disaggregated " * 60  # ~120 tokens: above the threshold below
SHORT = "hi there"


def fresh(tag: str) -> str:
    """A long prompt no replica has cached (its first block differs): its uncached part is all of it."""
    return f"{tag} {time.time_ns()} " + LONG


@pytest.fixture(scope="module")
def app_url(deploy_app):
    from ray import serve

    yield deploy_app(APP, PREFIX, model="pagedserve-tiny", engine={**ENGINE, "max_num_batched_tokens": 64},
                     disaggregation={"min_uncached_prompt_tokens": 32, "kv_lease_s": 2.0, "transfer_timeout_s": 20})
    serve.delete(APP)


def _handle(deployment: str):
    from ray import serve

    return serve.get_deployment_handle(deployment, app_name=APP)


def _pd_stats() -> dict:
    [stats] = _handle("DecodeServer").broadcast("pd_stats").results()
    return stats


def _faults(faults: dict | None) -> None:
    _handle("DecodeServer").broadcast("set_pd_faults", faults).results()


def _leftovers() -> list:
    """What either pool still holds (requests, KV blocks, leases) or left staged; empty when idle."""
    stats = {d: s for d in ("PrefillServer", "DecodeServer") for s in _handle(d).broadcast("stats").results()}
    busy = [(d, s.num_running, s.num_waiting, s.kv_cache_usage, s.num_kv_held) for d, s in stats.items()
            if s.num_running or s.num_waiting or s.kv_cache_usage or s.num_kv_held]
    return busy + [p.name for p in Path("/dev/shm").glob("*.kv") if p.name.startswith(("rx-", "kv-"))]


def _assert_idle(timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while (left := _leftovers()) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not left, left


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="-", max_retries=0, timeout=60)


def _complete(url: str, prompt: str, **kw):
    return _client(url).completions.create(model="pagedserve-tiny", prompt=prompt, **{"max_tokens": 10, "temperature": 0, **kw})


def test_disaggregated_answers_equal_colocated(app_url, serve_app_url):
    before = _pd_stats()
    ours, ref = _complete(app_url, LONG, logprobs=2), _complete(serve_app_url, LONG, logprobs=2)
    assert ours.choices[0].text == ref.choices[0].text
    for a, b in zip(ours.choices[0].logprobs.token_logprobs, ref.choices[0].logprobs.token_logprobs):
        assert a == pytest.approx(b, abs=1e-4)
    sampled = dict(n=2, temperature=0.8, seed=11)
    assert [c.text for c in _complete(app_url, LONG, **sampled).choices] == [c.text for c in _complete(serve_app_url, LONG, **sampled).choices]
    chat = {"model": "pagedserve-tiny", "messages": [{"role": "user", "content": LONG}], "max_tokens": 8, "temperature": 0}
    streamed = "".join(c.choices[0].delta.content or "" for c in _client(app_url).chat.completions.create(**chat, stream=True)
                       if c.choices)
    assert streamed == _client(serve_app_url).chat.completions.create(**chat).choices[0].message.content
    after = _pd_stats()
    assert after["remote"] - before["remote"] == 3 and after["transfers"] - before["transfers"] == 3
    assert after["transfer_bytes"] > before["transfer_bytes"]
    _assert_idle()


def test_prefill_side_cache_hits_show_in_usage_and_short_prompts_stay_local(app_url):
    prompt = "shared prefix " * 80
    _complete(app_url, prompt)
    second = _complete(app_url, prompt)
    assert second.usage.prompt_tokens_details.cached_tokens >= 64
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


def test_client_gone_during_the_transfer_frees_both_sides(app_url):
    _faults({"pause_before_fetch_s": 3.0})
    try:
        with pytest.raises(httpx.TimeoutException):
            httpx.post(app_url + "/v1/completions", json={"prompt": fresh("gone"), "max_tokens": 4}, timeout=1.0)
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
             timeout=90, interval=1)
    before = _pd_stats()["remote"]
    wait_for(lambda: _complete(app_url, fresh("again")).choices[0].text and _pd_stats()["remote"] > before,
             timeout=60, interval=1)
    _assert_idle()
