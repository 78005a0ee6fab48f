"""An engine replica over two ranks (tensor_parallel_size: 2) in the live app: its placement group holds a
bundle per rank, its other rank runs as a Ray actor in that group, it answers the OpenAI routes with the
same tokens as a one-rank replica, and a killed worker actor ends its streams with an error event, after
which Serve replaces the replica (new placement group, new workers) and the app serves again."""

from __future__ import annotations

import asyncio

import openai
import pytest

from tests.serve_app.conftest import ENGINE, wait_for
from tests.serve_app.test_faults import _stream

APP, PREFIX = "parallel", "/parallel"


@pytest.fixture(scope="module")
def app_url(deploy_app):
    from ray import serve

    yield deploy_app(APP, PREFIX, num_replicas=1, engine={**ENGINE, "tensor_parallel_size": 2})
    serve.delete(APP)


def _replica_actors() -> list[str]:
    """While Serve replaces a replica, the old one's actor may still be listed next to the new one's."""
    import ray

    return [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
            if a["name"].startswith(f"SERVE_REPLICA::{APP}#LLMServer#")]


def _replica_actor() -> str:
    [name] = _replica_actors()
    return name


def _worker_actors(replica: str | None = None) -> list[tuple[str, str]]:
    """(name, namespace) of the replica's worker actors."""
    import ray

    replica_id = (replica or _replica_actor()).rsplit("#", 1)[1]
    return [(a["name"], a["namespace"]) for a in ray.util.list_named_actors(all_namespaces=True)
            if a["name"].startswith(f"pagedserve-{replica_id}-rank")]


def test_two_rank_replica_answers_like_one_rank(app_url, serve_app_url):
    one = openai.OpenAI(base_url=serve_app_url + "/v1", api_key="-", max_retries=0, timeout=60)
    two = openai.OpenAI(base_url=app_url + "/v1", api_key="-", max_retries=0, timeout=60)
    body = {"model": "pagedserve-tiny", "prompt": "Tensor parallel", "max_tokens": 12, "temperature": 0, "logprobs": 2}
    a, b = one.completions.create(**body), two.completions.create(**body)
    assert b.choices[0].text == a.choices[0].text and b.usage.completion_tokens == 12
    for x, y in zip(a.choices[0].logprobs.token_logprobs, b.choices[0].logprobs.token_logprobs):
        assert y == pytest.approx(x, abs=1e-4)
    chat = {"model": "pagedserve-tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8,
            "temperature": 0}
    streamed = "".join(c.choices[0].delta.content or "" for c in two.chat.completions.create(**chat, stream=True)
                       if c.choices)
    assert streamed == one.chat.completions.create(**chat).choices[0].message.content


def test_placement_group_has_a_bundle_per_rank(app_url):
    import ray

    replica = _replica_actor()
    [group] = [g for g in ray.util.placement_group_table().values()
               if g["name"] == replica.removeprefix("SERVE_REPLICA::") or g["name"] == replica]
    assert group["strategy"] == "STRICT_PACK" and group["state"] == "CREATED"
    assert list(group["bundles"].values()) == [{"CPU": 0.01}, {"CPU": 0.01}]
    assert len(_worker_actors()) == 1


def test_killed_worker_ends_streams_and_the_replica_is_replaced(app_url):
    import ray

    [(worker, namespace)] = _worker_actors()
    replica = _replica_actor()

    async def stream_then_kill() -> dict:
        import httpx

        async with httpx.AsyncClient(timeout=httpx.Timeout(60)) as client:
            started = asyncio.Event()
            task = asyncio.create_task(_stream(client, app_url, 0, started))
            await asyncio.wait_for(started.wait(), 30)
            ray.kill(ray.get_actor(worker, namespace=namespace), no_restart=True)
            return await asyncio.wait_for(task, 30)

    outcome = asyncio.run(stream_then_kill())
    assert outcome["finish_reason"] != "length" and outcome["error"] is not None and outcome["done"], outcome
    def replaced() -> bool:
        replicas = _replica_actors()
        return len(replicas) == 1 and replicas[0] != replica and len(_worker_actors(replicas[0])) == 1

    wait_for(replaced, timeout=120, interval=1)
    client = openai.OpenAI(base_url=app_url + "/v1", api_key="-", max_retries=2, timeout=60)
    wait_for(lambda: client.completions.create(model="pagedserve-tiny", prompt="again",
                                               max_tokens=4).usage.completion_tokens == 4,
             timeout=60, interval=1)
