"""The app on a Ray cluster of several nodes (`ray.cluster_utils.Cluster`: one raylet per node, all on this
machine), served through Ray's proxy actor on the head node.

A tensor-parallel replica's two ranks are placed on two nodes (STRICT_SPREAD over nodes that offer the
`tp_node` resource): its tokens equal a one-rank engine's, and the other rank reads each step over TCP, as a
rank on another host must. Removing a node ends the streams it serves with an error event within 5 s; the
replacement replica waits for a node that can hold it and serves once one joins.

Prefill/decode disaggregation with its pools on different nodes (custom resources in each pool's
ray_actor_options): the KV crosses raylets through the object store and the tokens equal a colocated
engine's; removing the prefill node while a request waits on it ends in a correct, locally recomputed answer
with nothing left held or staged, and remote prefills resume once a node for the pool joins.

The nodes share two cores and talk over loopback: only outcomes and orderings mean something here."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import httpx
import pytest

from engine.shm_files import SHM_DIR
from tests.serve_app.conftest import ENGINE, HTTP_PORT, run_apps, wait_for
from tests.serve_app.test_faults import _stream

pytestmark = pytest.mark.own_ray

PORT = HTTP_PORT + 17  # apart from the session app's port: this cluster runs before it, but a port may linger
URL = f"http://127.0.0.1:{PORT}"
TP_APP, TP_PREFIX = "multinode-tp", "/tp"
NODE_RESOURCES = {"num_cpus": 1, "object_store_memory": 80 * 2**20, "resources": {"tp_node": 1}}
PREFILL_NODE = {"num_cpus": 1, "object_store_memory": 80 * 2**20, "resources": {"prefill_node": 1}}
PD_APP, PD_PREFIX = "multinode-pd", "/pd"
LONG = "disaggregated " * 60  # ~240 tokens: prefilled remotely


@pytest.fixture(scope="module")
def cluster():
    import ray
    from ray import serve
    from ray.cluster_utils import Cluster

    # Ray's health checks find a killed raylet's node dead in ~1.5 s here instead of ~15 s by default.
    system_config = {"health_check_period_ms": 500, "health_check_failure_threshold": 3,
                     "health_check_initial_delay_ms": 0}
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 2, "object_store_memory": 80 * 2**20, "resources": {"decode_node": 1, "head_node": 1},
        "_system_config": system_config})
    try:
        # The driver joins before the other nodes exist: ray.init picks the head's raylet only when it finds it
        # among this host's raylets, else any of them (one CI run's driver landed on the prefill node), and the
        # tests remove worker nodes; removing the driver's own makes `Cluster.remove_node` shut the driver down.
        ray.init(address=cluster.address, include_dashboard=False, log_to_driver=False, configure_logging=False)
        assert ray.get_runtime_context().get_node_id() == cluster.head_node.node_id, "the driver is not on the head"
        for _ in range(2):
            cluster.add_node(**NODE_RESOURCES)
        cluster.add_node(**PREFILL_NODE)
        cluster.wait_for_nodes()
        serve.start(http_options={"host": "127.0.0.1", "port": PORT, "location": "HeadOnly"})
        yield cluster
    finally:  # no serve.shutdown(): draining every replica costs ~30 s, and the nodes go anyway
        ray.shutdown()
        cluster.shutdown()


def _target(name: str, prefix: str, **args):
    from ray import serve

    from serve_app.app import build_app
    from serve_app.app_args import AppArgs

    # The ingress stays on the head node, which no test removes: a stream's end is the engine side's doing.
    args = {"engine": ENGINE, "ingress_ray_actor_options": {"num_cpus": 0, "resources": {"head_node": 0.01}}, **args}
    return serve.RunTarget(build_app(AppArgs(**args)), name=name, route_prefix=prefix)


@pytest.fixture(scope="module")
def apps(cluster) -> dict[str, str]:
    """Both apps of the module, deployed side by side: their replicas start together (~5 s less than one after
    the other on 2 cores); the P/D app's replicas idle on nodes the TP tests leave alone."""
    run_apps([
        _target(TP_APP, TP_PREFIX, num_replicas=1, engine={**ENGINE, "tensor_parallel_size": 2},
                placement_group_config={"bundle_per_worker": {"CPU": 0.01, "tp_node": 1}, "strategy": "STRICT_SPREAD"}),
        _target(PD_APP, PD_PREFIX, disaggregation={
            "min_uncached_prompt_tokens": 32, "transfer_timeout_s": 10,
            "prefill": {"ray_actor_options": {"num_cpus": 0, "resources": {"prefill_node": 1}}},
            "decode": {"ray_actor_options": {"num_cpus": 0, "resources": {"decode_node": 1}}}})])
    return {TP_APP: URL + TP_PREFIX, PD_APP: URL + PD_PREFIX}


@pytest.fixture(scope="module")
def tp_url(apps):
    return apps[TP_APP]


@pytest.fixture(scope="module")
def pd_url(apps):
    return apps[PD_APP]


@pytest.fixture(scope="module")
def offline():
    """The answers of a one-rank engine on this process, one engine for the module."""
    from engine import LLM

    llm = LLM("pagedserve-tiny", **ENGINE)
    yield llm
    llm.shutdown()


def _tp_group() -> dict:
    """The placement group of the TP app's one live replica."""
    import ray

    groups = [g for g in ray.util.placement_group_table().values()
              if g["state"] == "CREATED" and TP_APP in g["name"]]
    assert len(groups) == 1, groups
    return groups[0]


def _node(cluster, node_id: str):
    [node] = [n for n in cluster.worker_nodes if n.node_id == node_id]
    return node


def _complete(url: str, prompt: str, max_tokens: int) -> dict:
    r = httpx.post(url + "/v1/completions", timeout=60, json={
        "model": "pagedserve-tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "logprobs": 1})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def test_ranks_on_two_nodes_answer_like_one_rank(tp_url, offline):
    from ray import serve

    from engine import SamplingParams

    group = _tp_group()
    assert group["strategy"] == "STRICT_SPREAD"
    assert list(group["bundles"].values()) == [{"CPU": 0.01, "tp_node": 1}] * 2
    nodes = set(group["bundles_to_node_id"].values())
    assert len(nodes) == 2, group["bundles_to_node_id"]
    [stats] = serve.get_deployment_handle("LLMServer", app_name=TP_APP).broadcast("stats").results()
    assert stats.step_queue_tcp_readers == 1  # the other rank is on another node: it reads steps over TCP

    got = _complete(tp_url, "Across two nodes", 12)
    params = SamplingParams(max_tokens=12, temperature=0, logprobs=1)
    [want] = offline.generate(["Across two nodes"], params, use_tqdm=False)
    assert got["text"] == want.outputs[0].text
    want_logprobs = [entry[tid].logprob for entry, tid in zip(want.outputs[0].logprobs, want.outputs[0].token_ids)]
    assert got["logprobs"]["token_logprobs"] == pytest.approx(want_logprobs, abs=1e-4)


def _stream_then_remove(url: str, cluster, node) -> tuple[dict, float]:
    """A stream that has produced tokens when `node` is removed: how it ended and how long after the removal."""

    async def run() -> tuple[dict, float]:
        async with httpx.AsyncClient(timeout=httpx.Timeout(60)) as client:
            started = asyncio.Event()
            task = asyncio.create_task(_stream(client, url, 0, started, max_tokens=900))  # outlasts the removal
            await asyncio.wait_for(started.wait(), 30)
            await asyncio.to_thread(cluster.remove_node, node, False)
            removed_at = time.monotonic()
            outcome = await asyncio.wait_for(task, 30)
            return outcome, time.monotonic() - removed_at

    return asyncio.run(run())


def _replicas(app: str) -> set[str]:
    import ray

    return {a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
            if a["name"].startswith(f"SERVE_REPLICA::{app}#LLMServer#")}


def _replaced(app: str, old: set[str]) -> bool:
    """A new replica of `app` runs, and none of `old` is left."""
    from ray import serve

    now = _replicas(app)
    running = serve.status().applications[app].deployments["LLMServer"].replica_states.get("RUNNING", 0)
    return bool(now) and not now & old and running == len(now)


def _serves(url: str) -> bool:
    try:
        r = httpx.post(url + "/v1/completions", json={"prompt": "again", "max_tokens": 4}, timeout=30)
    except httpx.HTTPError:
        return False
    return r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4


@pytest.mark.parametrize("bundle", [1, 0], ids=["worker-rank-node", "replica-node"])
def test_removed_node_ends_its_streams_and_a_joining_node_takes_the_replacement(tp_url, cluster, bundle):
    """Bundle 1 holds the worker rank; bundle 0 the replica, its engine process (the driver rank) and its
    streams. Either node going ends the stream with an error event within 5 s; the replacement replica needs
    two `tp_node` nodes and so waits until one joins."""
    node_id = _tp_group()["bundles_to_node_id"][bundle]
    old = _replicas(TP_APP)
    outcome, after = _stream_then_remove(tp_url, cluster, _node(cluster, node_id))
    assert outcome["finish_reason"] != "length" and outcome["error"] is not None and outcome["done"], outcome
    assert after < 5, f"the stream ended {after:.1f} s after its node was removed"
    cluster.add_node(**NODE_RESOURCES)
    # Asked only once the replacement runs: a request sent while the old replica is going may wait out its whole
    # timeout there (one run of this test took 42 s instead of ~13).
    wait_for(lambda: _replaced(TP_APP, old), timeout=120, interval=0.5)
    wait_for(lambda: _serves(tp_url), timeout=60, interval=0.5)
    assert node_id not in _tp_group()["bundles_to_node_id"].values()


def _pd(method: str, *args):
    from ray import serve

    [result] = serve.get_deployment_handle("DecodeServer", app_name=PD_APP).broadcast(method, *args).results()
    return result


def _pd_idle(deployments: tuple[str, ...] = ("PrefillServer", "DecodeServer")) -> bool:
    from ray import serve

    stats = [s for name in deployments
             for s in serve.get_deployment_handle(name, app_name=PD_APP).broadcast("stats").results()]
    staged = [p.name for p in Path(SHM_DIR).iterdir() if p.name.startswith(("pagedserve-kv-", "pagedserve-rx-"))]
    return not staged and all(not (s.num_running or s.num_waiting or s.kv_cache_usage or s.num_kv_held)
                              for s in stats)


def _offline(llm, prompts: list[str], max_tokens: int) -> list[str]:
    from engine import SamplingParams

    outputs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0), use_tqdm=False)
    return [o.outputs[0].text for o in outputs]


def test_pools_on_different_nodes_move_kv_through_the_object_store(pd_url, cluster, offline):
    import ray

    assert ray.available_resources().get("prefill_node", 0) == 0  # the prefill replica holds its node
    before = _pd("pd_stats")
    prompts = [f"{i} {LONG}" for i in range(2)]
    got = [_complete(pd_url, p, 10)["text"] for p in prompts]
    after = _pd("pd_stats")
    assert after["remote"] - before["remote"] == 2 and after["transfers"] - before["transfers"] == 2
    assert got == _offline(offline, prompts, 10)
    wait_for(_pd_idle, timeout=20)

    # The prefill node goes while a request waits to fetch its KV there: the decode replica recomputes.
    [prefill_node] = [n for n in cluster.worker_nodes if n.node_id in _nodes_with("prefill_node")]
    _pd("set_pd_faults", {"pause_before_fetch_s": 3.0})
    try:
        threading.Timer(1.0, cluster.remove_node, args=(prefill_node, False)).start()
        start = time.monotonic()
        text = _complete(pd_url, "gone " + LONG, 10)["text"]
        assert time.monotonic() - start < 15
    finally:
        _pd("set_pd_faults", None)
    assert [text] == _offline(offline, ["gone " + LONG], 10)
    wait_for(lambda: _pd_idle(("DecodeServer",)), timeout=20)  # the prefill pool has no replica now

    cluster.add_node(**PREFILL_NODE)
    before = _pd("pd_stats")["remote"]
    wait_for(lambda: _complete(pd_url, f"back {time.time_ns()} {LONG}", 4) and _pd("pd_stats")["remote"] > before,
             timeout=120, interval=0.5)


def _nodes_with(resource: str) -> set[str]:
    import ray

    return {n["NodeID"] for n in ray.nodes() if n.get("Alive") and n["Resources"].get(resource)}
