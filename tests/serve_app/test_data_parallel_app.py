"""A data-parallel MoE deployment in the live app (engine.data_parallel_size: 2): its two replicas are the
ranks of one DP group (serve_app/data_parallel.py), each with its own scheduler and KV cache, sharing the
experts every step. Its greedy tokens equal the offline engine's at DP=1; requests spread over both ranks; a
killed rank takes its group down, and Serve replaces the group as a whole, which serves again."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from tests.serve_app.conftest import ENGINE, wait_for
from tests.serve_app.test_faults import _stream

APP, PREFIX = "dp", "/dp"
MODEL = "pagedserve-tiny-moe"
PROMPTS = ["Data parallel experts", "another prompt entirely", "a third", "and a fourth one"]


@pytest.fixture(scope="module")
def app_url(deploy_app):
    from ray import serve

    yield deploy_app(APP, PREFIX, model=MODEL,  # the prefix router chooses among the ranks
                     engine={**ENGINE, "data_parallel_size": 2, "enable_expert_parallel": True})
    serve.delete(APP)


def _complete(url: str, prompt: str) -> str:
    r = httpx.post(url + "/v1/completions", timeout=60, json={"model": MODEL, "prompt": prompt, "max_tokens": 8,
                                                              "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def _ranks() -> list:
    from ray import serve

    return serve.get_deployment_handle("LLMServer", app_name=APP).broadcast("stats").results()


def test_two_ranks_answer_like_one_engine(app_url):
    from concurrent.futures import ThreadPoolExecutor

    from engine import LLM, SamplingParams

    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda p: _complete(app_url, p), PROMPTS))
    llm = LLM(MODEL, **ENGINE)
    try:
        want = [o.outputs[0].text for o in llm.generate(
            PROMPTS, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True), use_tqdm=False)]
    finally:
        llm.shutdown()
    assert got == want
    stats = _ranks()
    assert len(stats) == 2 and all(s.num_steps > 0 for s in stats)  # both ranks stepped (dummy steps count)


def test_a_killed_rank_ends_the_groups_streams_and_replaces_the_group(app_url):
    """Whichever rank a stream runs on, the other rank's death breaks the group: the stream ends with an error
    event within 5 s (both ranks step every MoE layer together), then Serve replaces both ranks."""
    import ray

    before = sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                    if a["name"].startswith(f"SERVE_REPLICA::{APP}#LLMServer#"))
    assert len(before) == 2

    async def stream_then_kill() -> tuple[dict, float]:
        async with httpx.AsyncClient(timeout=httpx.Timeout(60)) as client:
            started = asyncio.Event()
            task = asyncio.create_task(_stream(client, app_url, 0, started, max_tokens=900))
            await asyncio.wait_for(started.wait(), 30)
            ray.kill(ray.get_actor(before[1], namespace="serve"), no_restart=True)
            killed_at = time.monotonic()
            outcome = await asyncio.wait_for(task, 30)
            return outcome, time.monotonic() - killed_at

    outcome, after = asyncio.run(stream_then_kill())
    assert outcome["finish_reason"] != "length" and outcome["error"] is not None and outcome["done"], outcome
    assert after < 5, f"the stream ended {after:.1f} s after a rank was killed"

    def replaced() -> bool:
        now = {a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
               if a["name"].startswith(f"SERVE_REPLICA::{APP}#LLMServer#")}
        return len(now) == 2 and not now & set(before)

    wait_for(replaced, timeout=120, interval=1)
    wait_for(lambda: _complete(app_url, PROMPTS[0]), timeout=60, interval=1)


def test_the_rank_assigner_is_a_deployment_that_goes_with_the_app(app_url):
    """Ray Serve LLM's shape: a named detached actor per deployment outlived the app that started it."""
    import ray
    from ray import serve

    def assigners() -> list[str]:
        return [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                if "RankAssigner" in a["name"] or a["name"].startswith("pagedserve-dp-")]  # the old actor's name

    assert serve.status().applications[APP].deployments["LLMServerRankAssigner"].status == "HEALTHY"
    assert len(assigners()) == 1, assigners()  # SERVE_REPLICA::dp#LLMServerRankAssigner#...
    serve.delete(APP)
    wait_for(lambda: not assigners(), timeout=30)
