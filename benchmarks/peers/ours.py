"""Our offline engine as the peer benchmark measures it: `LLM.generate` on the requests all at once, in a
spawned process of its own (its torch threads must not linger in the client), optionally beside a process
that busy-waits for a share of a core. A module of its own: spawn pickles the target by its module, which a
`python -m benchmarks.peers` __main__ cannot give."""

from __future__ import annotations

import multiprocessing
import time

from benchmarks.stream_client import Request


def _offline(model: str, engine: dict, requests: list[Request], out) -> None:
    from engine import LLM, SamplingParams

    llm = LLM(model, **{k: v for k, v in engine.items() if k != "multiprocess"})
    prompts = [p for _, p, _ in requests]
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for *_, m in requests]
    # A warm-up batch of the same shapes (the allocator's pools and the KV blocks' pages are then ready: a
    # 4-request warm-up left the first of a run's offline figures up to 2.3x below the last, peers.md run 20),
    # whose prompts share no block with the timed ones (reversed after BOS): the prefix cache must not serve
    # the timed run, as it serves none of the app's burst.
    llm.generate([p[:1] + p[:0:-1] for p in prompts], params, use_tqdm=False)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    duration = time.perf_counter() - start
    out.send(sum(len(o.outputs[0].token_ids) for o in outputs) / duration)


NOISE_PERIOD_S = 0.01  # the serving path wakes in short bursts: an SSE event, a step's outputs, a Ray loop


def _busy(cores: float, stop) -> None:
    """Take `cores` of one core: spin that share of every NOISE_PERIOD_S, sleep the rest."""
    while not stop.is_set():
        until = time.perf_counter() + cores * NOISE_PERIOD_S
        while time.perf_counter() < until:
            pass
        time.sleep((1 - cores) * NOISE_PERIOD_S)


def offline_throughput(model: str, engine: dict, requests: list[Request], noise_cores: float = 0.0) -> float:
    """Output tokens/s of `LLM.generate` on `requests` all at once, in a process of its own (its torch
    threads must not linger in this client); with `noise_cores`, beside a process that busy-waits for that
    share of a core, as the app's serving path and client take it from the app's engine."""
    ctx = multiprocessing.get_context("spawn")
    recv, send = ctx.Pipe(duplex=False)
    stop = ctx.Event()
    noise = ctx.Process(target=_busy, args=(min(noise_cores, 1.0), stop)) if noise_cores else None
    p = ctx.Process(target=_offline, args=(model, engine, requests, send))
    if noise:
        noise.start()
    p.start()
    try:
        return recv.recv()
    finally:
        p.join()
        if noise:
            stop.set()
            noise.join()
