"""Prefix-affinity routing on the live app: three engine replicas of the built-in model on this machine,
a multi-tenant workload (llm-d's shape, scaled down: many tenants, each a long shared system prompt,
short questions and answers), `router: prefix` against `router: pow2` (Ray Serve's default).

    python benchmarks/routing_live.py [--num-requests 300] [--rate 4]

The KV cache of each replica is sized so that all tenants' prompts fill ~70% of the cluster's KV blocks
together but not one replica: routing decides whether each replica's working set fits. Reported per
router: the prefix-cache hit rate (from the replicas' own counters: cached prompt tokens over prompt
tokens), TTFT p50/p99 and output throughput; then the ratios."""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time

import httpx
import numpy as np

MODEL = "pagedserve-56m"


def workload(n: int, rate: float, tenants: int, prefix_tokens: int, seed: int):
    rng = random.Random(seed)
    prefixes = [[1] + [rng.randrange(3, 32000) for _ in range(prefix_tokens - 1)] for _ in range(tenants)]
    t, out = 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        tenant = rng.randrange(tenants)
        question = [rng.randrange(3, 32000) for _ in range(rng.randint(16, 48))]
        out.append((t, prefixes[tenant] + question, rng.randint(8, 24)))
    return out


async def run(url: str, requests) -> tuple[list[float], float, int]:
    start = time.perf_counter()

    async def one(client, at, prompt, max_tokens):
        await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
        t0 = time.perf_counter()
        ttft, tokens = None, 0
        body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}
        async with client.stream("POST", url + "/v1/completions", json=body) as r:
            r.raise_for_status()
            async for line in r.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                if ttft is None and chunk["choices"] and chunk["choices"][0]["text"]:
                    ttft = time.perf_counter() - t0
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
        return ttft, tokens

    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=1000)) as client:
        results = await asyncio.gather(*(one(client, *r) for r in requests))
    duration = time.perf_counter() - start
    return [r[0] for r in results if r[0] is not None], duration, sum(r[1] for r in results)


def bench(router: str, args, requests) -> dict:
    from ray import serve

    from serve_app.app import build_app
    from serve_app.app_args import AppArgs

    engine = {"max_model_len": 1024, "num_kv_blocks": args.kv_blocks, "num_threads": 1, "max_num_seqs": 32}
    app = AppArgs(model=MODEL, num_replicas=3, router=router, engine=engine)
    serve.run(build_app(app), name=f"routing-{router}", route_prefix="/")
    handle = serve.get_deployment_handle("LLMServer", app_name=f"routing-{router}")
    url = f"http://127.0.0.1:{args.port}"
    asyncio.run(run(url, requests[:3]))  # warm-up (and the kernels' first use)
    before = handle.broadcast("stats").results()
    ttfts, duration, tokens = asyncio.run(run(url, requests))
    after = handle.broadcast("stats").results()
    serve.delete(f"routing-{router}")
    queries = sum(a.prefix_cache_queries for a in after) - sum(b.prefix_cache_queries for b in before)
    hits = sum(a.prefix_cache_hits for a in after) - sum(b.prefix_cache_hits for b in before)
    ms = np.array(ttfts) * 1e3
    return {"router": router, "hit_rate": hits / queries if queries else 0.0, "ttft_p50": float(np.percentile(ms, 50)),
            "ttft_p99": float(np.percentile(ms, 99)), "throughput": tokens / duration}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-requests", type=int, default=300)
    ap.add_argument("--rate", type=float, default=4.0)
    ap.add_argument("--tenants", type=int, default=12)
    ap.add_argument("--prefix-tokens", type=int, default=400)
    ap.add_argument("--kv-blocks", type=int, default=140, help="KV blocks per replica (block size 16)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--port", type=int, default=8000)
    args = ap.parse_args()
    import ray
    from ray import serve

    requests = workload(args.num_requests, args.rate, args.tenants, args.prefix_tokens, args.seed)
    working_set = args.tenants * -(-args.prefix_tokens // 16)
    print(f"{len(requests)} requests at {args.rate}/s; {args.tenants} tenants x {args.prefix_tokens}-token prefixes = "
          f"{working_set} blocks = {working_set / (3 * args.kv_blocks):.0%} of the cluster's KV "
          f"({working_set / args.kv_blocks:.0%} of one replica's)", flush=True)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": args.port})
    try:
        rows = [bench(router, args, requests) for router in ("prefix", "pow2")]
    finally:
        serve.shutdown()
        ray.shutdown()
    print()
    print("| router | prefix-cache hit rate | TTFT p50 ms | TTFT p99 ms | output tok/s |")
    print("|---|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['router']} | {r['hit_rate']:.1%} | {r['ttft_p50']:.0f} | {r['ttft_p99']:.0f} | "
              f"{r['throughput']:.0f} |")
    prefix, pow2 = rows
    print()
    print(f"hit rate prefix / pow2: {prefix['hit_rate'] / max(pow2['hit_rate'], 1e-9):.2f}x (target >= 2x)")
    print(f"TTFT p99 prefix / pow2: {prefix['ttft_p99'] / pow2['ttft_p99']:.2f} (target < 1)")


if __name__ == "__main__":
    main()
