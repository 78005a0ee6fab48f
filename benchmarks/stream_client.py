"""The open-loop streaming client every serving benchmark shares (serving.py, peers, auto_tune.py):
requests leave at their scheduled times whatever the server does (a closed loop would slow down with the
server and hide its queueing), each one streamed, and every SSE event timed as it arrives.

Servers speak different dialects; each sender reads how many tokens an event carries: ours from
`continuous_usage_stats` (the tokens so far), llama-server's from its `tokens` list (`return_tokens`).

Metrics (`summarize`): output tokens/s over the run; TTFT (sent -> first token) p50/p95/p99; ITL per
token, where an event carrying k tokens counts as k gaps of (its interval / k), p50/p99; TPOT mean
((e2e - TTFT) / (tokens - 1)); tokens per SSE event and the share of events carrying exactly one."""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import aiohttp
import numpy as np

# (send time in seconds from the start, prompt token ids, output tokens)
Request = tuple[float, list[int], int]


@dataclass
class Result:
    ttft: float = 0.0
    e2e: float = 0.0
    itls: list[float] = field(default_factory=list)  # per token: an event's interval shared by its tokens
    tokens: int = 0
    events: int = 0  # events that carried tokens
    single_token_events: int = 0
    start: float = field(default_factory=time.perf_counter)
    last: float | None = None

    def event(self, new_tokens: int) -> None:
        """A streamed event carrying `new_tokens` tokens arrived now."""
        now = time.perf_counter()
        if not new_tokens:
            return
        self.tokens += new_tokens
        self.events += 1
        self.single_token_events += new_tokens == 1
        if self.last is None:
            self.ttft = now - self.start
        else:
            self.itls.extend([(now - self.last) / new_tokens] * new_tokens)
        self.last = now

    def done(self) -> Result:
        self.e2e = time.perf_counter() - self.start
        return self


def uniform_workload(n: int, rate: float | None, seed: int = 0, prompt_range: tuple[int, int] = (32, 256),
                     output_range: tuple[int, int] = (16, 128)) -> list[Request]:
    """DESIGN.md's peer workload: random-token prompts of 32-256 tokens (BOS first), 16-128 output tokens
    (ignore_eos), Poisson arrivals at `rate` requests/s, or all at t=0 when `rate` is None."""
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        if rate is not None:
            t += rng.expovariate(rate)
        prompt = [1] + [rng.randrange(3, 32000) for _ in range(rng.randint(*prompt_range) - 1)]
        out.append((t, prompt, rng.randint(*output_range)))
    return out


async def run_open_loop(requests: list[Request],
                        send: Callable[[list[int], int], Awaitable[Result]]) -> tuple[list[Result], float]:
    start = time.perf_counter()

    async def one(at: float, prompt: list[int], max_tokens: int) -> Result:
        await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
        return await send(prompt, max_tokens)

    results = await asyncio.gather(*(one(*r) for r in requests))
    return results, time.perf_counter() - start


async def sse_data(response: aiohttp.ClientResponse):
    """The `data:` payloads of a server-sent event stream, split at "\n" only: JSON may carry U+0085,
    U+2028 and U+2029 unescaped (llama-server does, in generated text), and str.splitlines would end a
    line at each."""
    buffer = b""
    async for chunk in response.content.iter_any():
        buffer += chunk
        *lines, buffer = buffer.split(b"\n")
        for line in lines:
            if line.startswith(b"data: "):
                yield line[6:].rstrip(b"\r")


# HTTP errors of a send (a refused connection, an error status, a stream cut short), for callers to catch.
HTTPError = aiohttp.ClientError


def http_client(keepalive: bool = True) -> aiohttp.ClientSession:
    """The client shares the machine with the server it measures, so it must cost little: aiohttp took
    0.08-0.10 ms of CPU per streamed event where httpx took 0.28-0.29 (our app, 64 at once; for llama-server's
    ~4,400 one-token events a burst, httpx's cost was over a second of CPU). `keepalive=False` for servers that
    close idle connections sooner than a client reuses them (llama-server: a reused, already closed connection
    fails the request before a byte comes back)."""
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1000, force_close=not keepalive),
                                 timeout=aiohttp.ClientTimeout(total=600))


async def send_openai(client: aiohttp.ClientSession, url: str, model: str, prompt: list[int],
                      max_tokens: int) -> Result:
    """Our app's /v1/completions (OpenAI's, with vLLM's ignore_eos and continuous usage)."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    result = Result()
    async with client.post(url + "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for data in sse_data(r):
            if data.startswith(b"{"):  # continuous usage: the tokens so far, hence this event's
                result.event(json.loads(data)["usage"]["completion_tokens"] - result.tokens)
    return result.done()


async def send_llamacpp(client: aiohttp.ClientSession, url: str, prompt: list[int], max_tokens: int) -> Result:
    """llama-server's native /completion: token-id prompt, greedy, ignore_eos; `return_tokens` puts each
    event's token ids in it. No prompt cache reuse across requests (ours shares nothing but BOS either)."""
    body = {"prompt": prompt, "n_predict": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
            "return_tokens": True, "cache_prompt": False}
    result = Result()
    async with client.post(url + "/completion", json=body) as r:
        r.raise_for_status()
        async for data in sse_data(r):
            if data.startswith(b"{"):
                result.event(len(json.loads(data).get("tokens") or ()))
    return result.done()


def _pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def summarize(name: str, results: list[Result], duration: float) -> dict:
    tokens = sum(r.tokens for r in results)
    ttft = [r.ttft * 1e3 for r in results]
    itl = [x * 1e3 for r in results for x in r.itls]
    tpot = [(r.e2e - r.ttft) / (r.tokens - 1) * 1e3 for r in results if r.tokens > 1]
    events = sum(r.events for r in results)
    return {"system": name, "throughput": tokens / duration, "tokens": tokens, "duration": duration,
            "ttft_p50": _pct(ttft, 50), "ttft_p95": _pct(ttft, 95), "ttft_p99": _pct(ttft, 99),
            "itl_p50": _pct(itl, 50), "itl_p99": _pct(itl, 99),
            "tpot_mean": statistics.fmean(tpot) if tpot else float("nan"),
            "tokens_per_event": tokens / events if events else float("nan"),
            "single_token_events": sum(r.single_token_events for r in results) / events if events else float("nan"),
            "events_per_request": events / len(results) if results else float("nan")}
