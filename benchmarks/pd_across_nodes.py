"""The cost of disaggregated prefill/decode's KV transfer when the pools sit on different Ray nodes, against the
same pools on one node (issue 37). A `ray.cluster_utils.Cluster` of three raylets on this machine: the head (the
ingress) and two workers that offer `pool_a` / `pool_b`; the prefill and decode pools pinned by each pool's
ray_actor_options. Same node: both pools on `pool_a`'s node, and the object store's copy is a memcpy; across nodes:
the object manager moves each rank's KV between the two raylets' stores (over loopback here), as it would over
the network between hosts.

    python -m benchmarks.pd_across_nodes [--model pagedserve-56m] [--prompt-tokens 1024] [--requests 8]

Each request's prompt is new (no prefix-cache hit), prefilled on the prefill replica, its KV fetched by the
decode replica: the table gives the decode replica's own counters (LLMServer.pd_stats: bytes, and seconds from
the fetch's call to the KV staged on the decode side) per transfer and per 1,000 prompt tokens, with the ratio
across / same. Nodes share this machine's cores and talk over loopback: the ratio says what crossing raylets
adds on one host (the object manager's chunked push, a second store's copy), not what a network adds;
benchmarks/simulate_pd.py models real links."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx

PORT = 8460
APP = "pd-nodes"
NODE = {"num_cpus": 1, "object_store_memory": 200 * 2**20}


def _deploy(model: str, prefill_resource: str, decode_resource: str) -> None:
    from ray import serve

    from serve_app.app import build_app
    from serve_app.app_args import AppArgs

    def pool(resource: str) -> dict:
        return {"ray_actor_options": {"num_cpus": 0, "resources": {resource: 0.5}}}

    args = AppArgs(model=model, engine={"max_model_len": 2048, "num_kv_blocks": 1024, "num_threads": 1},
                   ingress_ray_actor_options={"num_cpus": 0, "resources": {"head_node": 0.01}},
                   disaggregation={"min_uncached_prompt_tokens": 32, "prefill": pool(prefill_resource),
                                   "decode": pool(decode_resource)})
    serve.run(build_app(args), name=APP, route_prefix="/")


def _pd_stats() -> dict[str, float]:
    from ray import serve

    [stats] = serve.get_deployment_handle("DecodeServer", app_name=APP).broadcast("pd_stats").results()
    return stats


def _measure(model: str, prompt_tokens: int, requests: int) -> dict[str, float]:
    word = "transfer "  # ~1 token a word for the built-in tokenizer
    with httpx.Client(timeout=300) as client:
        def send(tag: str) -> None:
            body = {"model": model, "prompt": f"{tag} {time.time_ns()} " + word * (prompt_tokens - 4), "max_tokens": 4}
            r = client.post(f"http://127.0.0.1:{PORT}/v1/completions", json=body)
            r.raise_for_status()

        send("warm-up")
        before = _pd_stats()
        for i in range(requests):
            send(str(i))
        after = _pd_stats()
    delta = {k: after.get(k, 0) - before.get(k, 0) for k in ("transfers", "transfer_bytes", "transfer_seconds")}
    if delta["transfers"] != requests:
        raise RuntimeError(f"{delta['transfers']} of {requests} prompts were prefilled remotely: {after}")
    return delta


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="pagedserve-56m")
    parser.add_argument("--prompt-tokens", type=int, default=1024)
    parser.add_argument("--requests", type=int, default=8)
    args = parser.parse_args()

    import ray
    from ray import serve
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "object_store_memory": 200 * 2**20,
                                                             "resources": {"head_node": 1}})
    rows = {}
    try:
        cluster.add_node(**NODE, resources={"pool_a": 1})
        cluster.add_node(**NODE, resources={"pool_b": 1})
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, log_to_driver=False, configure_logging=False)
        serve.start(http_options={"host": "127.0.0.1", "port": PORT, "location": "HeadOnly"})
        for arm, (prefill, decode) in {"same node": ("pool_a", "pool_a"), "across nodes": ("pool_a", "pool_b")}.items():
            _deploy(args.model, prefill, decode)
            rows[arm] = _measure(args.model, args.prompt_tokens, args.requests)
            serve.delete(APP)
    finally:
        ray.shutdown()
        cluster.shutdown()

    tokens = args.prompt_tokens
    print(f"\n{args.model}, prompts of ~{tokens} tokens, {args.requests} transfers per arm; nodes share this machine")
    print("| pools | MB per transfer | ms per transfer | ms per 1,000 prompt tokens | MB/s |")
    print("|---|---:|---:|---:|---:|")
    for arm, d in rows.items():
        n, mb, s = d["transfers"], d["transfer_bytes"] / 2**20, d["transfer_seconds"]
        print(f"| {arm} | {mb / n:.1f} | {1000 * s / n:.1f} | {1000 * s / n / tokens * 1000:.1f} | {mb / s:.0f} |")
    same, across = rows["same node"], rows["across nodes"]
    print(f"\nacross / same node, seconds per transfer: {across['transfer_seconds'] / same['transfer_seconds']:.2f}x")


if __name__ == "__main__":
    main()
