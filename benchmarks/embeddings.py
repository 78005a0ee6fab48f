"""Embeddings over HTTP: the embedding app (configs/embed.yaml, `serve run` as `make run` starts an app) against
vLLM's CPU backend serving the same checkpoint (its OpenAI server, `--runner pooling`), on the same requests.

    python benchmarks/embeddings.py [--model pagedserve-56m-embed] [--out benchmarks/results/embeddings.md]

Workload (fixed seed): texts decoded from random token ids, 32 to 256 tokens each (retrieval chunks), one text
per POST /v1/embeddings. At each concurrency (1, 8, 64 clients, closed loop: each sends its next request when the
last is answered) both servers get the same requests. Per system and concurrency: embeddings/s, p50 and p99
latency, and the CPU time its processes spent per embedding; then our ratios to vLLM's. Each server runs alone
(the other is stopped), float32, with the same batch limits and --threads (2: the machine's cores) as our
num_threads and vLLM's OMP_NUM_THREADS. The vectors of the two are compared too: the largest difference of one
embedding, which for one checkpoint read the same way should be ~1e-6."""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import time
from pathlib import Path

import aiohttp
import numpy as np

if __package__ in (None, ""):  # run as a script: make `benchmarks.*` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.peers import vllm_cpu
from benchmarks.serve_process import ROOT, ServeApp, load_config, serve_run, with_args
from engine.models.builtin import materialize_builtin

CONCURRENCY = (1, 8, 64)
MAX_MODEL_LEN, BATCH_TOKENS, MAX_SEQS, KV_GB = 512, 2048, 128, 1  # vLLM takes whole GiB


def workload(model_dir: Path, n: int, seed: int) -> list[str]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    rng = random.Random(seed)
    return [tok.decode([rng.randrange(1000, 30000) for _ in range(rng.randint(32, 256))]) for _ in range(n)]


async def _run(url: str, model: str, texts: list[str], concurrency: int) -> tuple[list[float], float, list]:
    """Latencies (s), wall time (s) and the vectors, in request order."""
    latencies, vectors = [0.0] * len(texts), [None] * len(texts)
    queue = iter(range(min(8, len(texts))))  # warm-up first

    async def client(session: aiohttp.ClientSession) -> None:
        for i in queue:
            start = time.perf_counter()
            async with session.post(url + "/v1/embeddings", json={"model": model, "input": texts[i]}) as r:
                body = await r.json()
                if r.status != 200:
                    raise RuntimeError(f"{url}: {r.status} {body}")
            latencies[i] = time.perf_counter() - start
            vectors[i] = body["data"][0]["embedding"]

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600),
                                     connector=aiohttp.TCPConnector(limit=concurrency)) as session:
        await asyncio.gather(*(client(session) for _ in range(2)))
        queue = iter(range(len(texts)))
        start = time.perf_counter()
        await asyncio.gather(*(client(session) for _ in range(concurrency)))
        return latencies, time.perf_counter() - start, vectors


def measure(server: ServeApp, model: str, workloads: dict[int, list[str]]) -> dict[int, dict]:
    out = {}
    for c, texts in workloads.items():
        cpu = sum(server.cpu_seconds().values())
        latencies, wall, vectors = asyncio.run(_run(server.url, model, texts, c))
        cpu = sum(server.cpu_seconds().values()) - cpu  # the warm-up's 8 requests too: a small overcount
        ordered = sorted(latencies)
        out[c] = {"eps": len(texts) / wall, "p50": statistics.median(latencies) * 1e3,
                  "p99": ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))] * 1e3, "vectors": vectors,
                  "cpu_ms": cpu / (len(texts) + 8) * 1e3}
        print(f"  concurrency {c:3d}: {out[c]['eps']:7.1f} embeddings/s, p50 {out[c]['p50']:7.1f} ms, "
              f"p99 {out[c]['p99']:7.1f} ms, {out[c]['cpu_ms']:.0f} CPU-ms per embedding", flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="pagedserve-56m-embed")
    parser.add_argument("--requests", type=int, nargs=3, default=(64, 256, 512), help="per concurrency level")
    parser.add_argument("--port", type=int, default=8350)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2, help="our num_threads; vLLM's OMP_NUM_THREADS")
    parser.add_argument("--out", type=Path, default=None, help="also write the table (markdown) here")
    args = parser.parse_args()
    model_dir = materialize_builtin(args.model)
    workloads = {c: workload(model_dir, n, args.seed + c) for c, n in zip(CONCURRENCY, args.requests)}

    print(f"pagedserve ({args.model}, configs/embed.yaml)", flush=True)
    config = with_args(load_config(ROOT / "configs/embed.yaml"), model=args.model, engine={
        "max_model_len": MAX_MODEL_LEN, "max_num_batched_tokens": BATCH_TOKENS, "max_num_seqs": MAX_SEQS,
        "kv_cache_memory_gb": KV_GB, "num_threads": args.threads, "dtype": "float32"})
    with serve_run(config, port=args.port) as app:
        ours = measure(app, args.model, workloads)
    print("vLLM CPU (OpenAI server, --runner pooling)", flush=True)
    flags = ("--runner", "pooling", "--served-model-name", args.model, "--dtype", "float32", "--max-model-len",
             str(MAX_MODEL_LEN), "--max-num-batched-tokens", str(BATCH_TOKENS), "--max-num-seqs", str(MAX_SEQS))
    with vllm_cpu.serve(model_dir, args.port + 1, flags, kv_cache_gb=KV_GB, threads=args.threads) as server:
        peer = measure(server, args.model, workloads)

    diff = max(float(np.abs(np.array(a) - np.array(b)).max()) for c in CONCURRENCY
               for a, b in zip(ours[c]["vectors"], peer[c]["vectors"]))
    lines = [f"Embeddings over HTTP, {args.model}, one text of 32-256 tokens per request, closed loop; "
             f"vLLM-CPU {vllm_cpu.VLLM_CPU_VERSION}; our num_threads and vLLM's OMP_NUM_THREADS {args.threads}. "
             f"Largest difference of our vectors from vLLM's: {diff:.1e}.", "",
             "| concurrency | requests | ours emb/s | vLLM emb/s | ratio | ours p50 ms | vLLM p50 ms "
             "| ours p99 ms | vLLM p99 ms | p99 ratio (vLLM/ours) | ours CPU-ms/emb | vLLM CPU-ms/emb |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for c in CONCURRENCY:
        o, v = ours[c], peer[c]
        lines.append(f"| {c} | {len(workloads[c])} | {o['eps']:.1f} | {v['eps']:.1f} | {o['eps'] / v['eps']:.2f} | "
                     f"{o['p50']:.1f} | {v['p50']:.1f} | {o['p99']:.1f} | {v['p99']:.1f} | {v['p99'] / o['p99']:.2f} | "
                     f"{o['cpu_ms']:.0f} | {v['cpu_ms']:.0f} |")
    table = "\n".join(lines)
    print("\n" + table)
    if args.out:
        args.out.write_text(f"# Embeddings\n\n`python benchmarks/embeddings.py`\n\n{table}\n")


if __name__ == "__main__":
    main()
