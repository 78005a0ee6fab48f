"""Does a huge prompt stall everyone else? Short streamed requests at a steady rate, alone and then while
one 4 MiB text arrives every few seconds: as a /v1/completions prompt, as a chat message and to /tokenize
(all too long for any tokenization of max_model_len tokens: refused before tokenizing); and a text as
large as max_model_len's bound allows (tokenized, in a worker thread off the ingress's event loop).

    python benchmarks/tokenizer_stall.py [--rate 2] [--duration 60] [--every 5] [--mib 4] [--port 8202]

Starts Ray and the app (built-in pagedserve-tiny, one engine replica, HTTP through Serve). Prints, per
arm, the short requests' TTFT p50/p99 and the ratio of its p99 to the arm without large texts (target:
<= 2x), and the large texts' statuses and latency.

A model with a long context (128k tokens) allows prompts of megabytes; those are tokenized off the loop too,
but their CPU time is real: on two cores it competes with the engine whatever the ingress does.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from collections import Counter

if __package__ in (None, ""):  # run as a script: make `benchmarks.*` importable
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np

from benchmarks import live_app
from benchmarks.stream_client import http_client, run_open_loop, send_openai, uniform_workload

ENGINE = {"max_model_len": 2048, "num_kv_blocks": 1024, "num_threads": 2}
MODEL = "pagedserve-tiny"
ARMS = {  # name -> (route, body of a large text)
    "no large texts": None,
    "4 MiB /v1/completions prompt": ("/v1/completions", lambda text: {"model": MODEL, "prompt": text, "max_tokens": 4}),
    "4 MiB chat message": ("/v1/chat/completions",
                           lambda text: {"model": MODEL, "messages": [{"role": "user", "content": text}],
                                         "max_tokens": 4}),
    "4 MiB /tokenize": ("/tokenize", lambda text: {"model": MODEL, "prompt": text}),
    "largest tokenizable prompt": ("/tokenize", lambda text: {"model": MODEL, "prompt": text[:LARGEST_CHARS]}),
}
LARGEST_CHARS = ENGINE["max_model_len"] * 16  # the built-in tokenizer's bound: 16 characters per token


def _pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def large_text(mib: float, seed: int) -> str:
    rng = random.Random(seed)
    words = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9))) for _ in range(5000)]
    out, size = [], 0
    while size < mib * 2**20:
        word = rng.choice(words)
        out.append(word)
        size += len(word) + 1
    return " ".join(out)


async def run_arm(url: str, arm: str, args, text: str) -> dict:
    requests = uniform_workload(int(args.rate * args.duration), args.rate, seed=args.seed, prompt_range=(32, 128),
                                output_range=(16, 32))
    large: list[tuple[int, float]] = []  # (status, seconds)

    async with http_client() as client:
        async def send_large(route: str, body: dict) -> None:
            start = time.perf_counter()
            response = await client.post(url + route, json=body)
            large.append((response.status_code, time.perf_counter() - start))

        async def large_loop() -> None:
            if ARMS[arm] is None:
                return
            route, make_body = ARMS[arm]
            body = make_body(text)
            tasks = []
            deadline = time.perf_counter() + args.duration
            while time.perf_counter() < deadline:
                tasks.append(asyncio.create_task(send_large(route, body)))
                await asyncio.sleep(args.every)
            await asyncio.gather(*tasks)

        await send_openai(client, url, MODEL, requests[0][1], 4)  # warm-up
        (results, _), _ = await asyncio.gather(
            run_open_loop(requests, lambda p, m: send_openai(client, url, MODEL, p, m)), large_loop())
    ttft = [r.ttft * 1e3 for r in results]
    return {"arm": arm, "short": len(results), "ttft_p50": _pct(ttft, 50), "ttft_p99": _pct(ttft, 99),
            "large": len(large), "large_status": dict(Counter(s for s, _ in large)),
            "large_p50_s": _pct([s for _, s in large], 50)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", type=float, default=2.0, help="short requests per second")
    parser.add_argument("--duration", type=float, default=60.0, help="seconds per arm")
    parser.add_argument("--every", type=float, default=5.0, help="seconds between large texts")
    parser.add_argument("--mib", type=float, default=4.0, help="size of a large text")
    parser.add_argument("--port", type=int, default=8202)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    text = large_text(args.mib, args.seed)
    url = live_app.start(args.port, ENGINE, num_replicas=1)
    try:
        rows = [asyncio.run(run_arm(url, arm, args, text)) for arm in ARMS]
    finally:
        live_app.stop()
    base = rows[0]["ttft_p99"]
    print(f"short requests: {args.rate}/s for {args.duration:.0f} s per arm; "
          f"a {args.mib} MiB text every {args.every} s\n")
    print(f"{'arm':<32}{'short':>7}{'TTFT p50':>10}{'TTFT p99':>10}{'p99 ratio':>11}{'large':>7}  "
          f"{'large statuses':<18}{'large p50 s':>12}")
    for r in rows:
        statuses = ", ".join(f"{k}: {v}" for k, v in sorted(r["large_status"].items())) or "-"
        print(f"{r['arm']:<32}{r['short']:>7}{r['ttft_p50']:>10.1f}{r['ttft_p99']:>10.1f}{r['ttft_p99'] / base:>10.2f}x"
              f"{r['large']:>7}  {statuses:<18}{r['large_p50_s']:>12.2f}")
    worst = max(r["ttft_p99"] / base for r in rows)
    print(f"\nworst TTFT p99 ratio: {worst:.2f}x (target <= 2x)")


if __name__ == "__main__":
    main()
