"""The engine's step loop, run by AsyncLLM either on a thread of the caller's process or in a process of
its own. A server's process is busy with Python work of its own (Ray messaging, HTTP); on a thread the
engine shares one GIL with it, and every torch call that releases the GIL may wait up to a switch
interval to get it back: measured inside a Ray Serve replica, the loop ran half as many steps per second
as alone. In its own process the loop keeps its GIL, and outputs cross back once per step for all
requests together.

The loop takes commands ("add", PreparedRequest), ("abort", request_id), ("release_kv", request_id),
("stop", None) and emits events:
    ("ready", EngineStats)                                      once the engine is built
    ("outputs", list[RequestOutput], EngineStats, num_adds)     after a step or applied commands
    ("rejected", request_id, ValueError)                        an add the engine refused
    ("cache_summary", bytes)                                    the prefix cache's blocks, when changed
                                                                (at most every SUMMARY_PERIOD_S)
    ("dead", message)                                           a fatal error; the loop has ended"""

from __future__ import annotations

import ctypes
import gc
import logging
import time
from collections.abc import Callable
from multiprocessing.connection import Connection

from engine.config import EngineConfig
from engine.executor import Rendezvous
from engine.frontend.llm_engine import LLMEngine
from engine.outputs import RequestOutput

logger = logging.getLogger(__name__)

IDLE_POLL_S = 0.5  # an idle loop re-checks for commands this often
SUMMARY_PERIOD_S = 0.5  # the prefix-cache summary for routers is refreshed at most this often
TRIM_PERIOD_S = 10.0  # the engine process hands freed heap memory back to the OS this often

Command = tuple[str, object]
Event = tuple


def run_engine_loop(engine: LLMEngine, next_command: Callable[[float], Command | None],
                    emit: Callable[[Event], None]) -> None:
    """Step until a "stop" command; `next_command(timeout)` returns None when nothing came in time.
    Raises on a fatal engine error (after emitting "dead")."""
    summary_version, summary_time = -1, 0.0
    try:
        while True:
            now = time.monotonic()
            if engine.cache_version != summary_version and now - summary_time >= SUMMARY_PERIOD_S:
                summary_version, summary_time = engine.cache_version, now
                emit(("cache_summary", engine.cache_summary()))
            timeout = 0.0 if engine.has_unfinished_requests() else IDLE_POLL_S
            outputs: list[RequestOutput] = []
            num_adds = 0
            command = next_command(timeout)
            while command is not None:
                kind, payload = command
                if kind == "stop":
                    return
                if kind == "add":
                    num_adds += 1
                    try:
                        engine.add_prepared(payload)
                    except ValueError as e:
                        emit(("rejected", payload.request_id, e))
                elif kind == "abort":
                    outputs.extend(engine.abort_request(payload))
                elif kind == "release_kv":
                    engine.release_kv(payload)
                command = next_command(0.0)
            freed = engine.poll_kv_leases()  # blocks held for KV consumers: their stats must show the release
            if engine.has_unfinished_requests():
                outputs.extend(engine.step())
            if outputs or num_adds or freed:
                emit(("outputs", outputs, engine.get_stats(), num_adds))
    except BaseException as e:
        logger.exception("fatal engine error")
        emit(("dead", f"the engine died: {type(e).__name__}: {e}"))
        raise


def heap_trimmer(period_s: float = TRIM_PERIOD_S, idle_gap_s: float = 1.0) -> Callable[[bool], None]:
    """`maybe_trim(idle)`, to call once per loop turn: runs glibc's malloc_trim(0) when the loop goes idle (at
    most every `idle_gap_s`) and every `period_s` under load. The loop's tensors of ever-varying sizes leave
    glibc's main heap fragmented, and freed memory there stays resident: under a soak (benchmarks/soak.py,
    concurrency 64) the engine process grew ~50% over 7,000 requests while its live memory stayed flat.
    A trim costs ~20 ms per 200 MiB it returns. A no-op off glibc."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return lambda idle: None
    last, was_busy = float("-inf"), False

    def maybe_trim(idle: bool) -> None:
        nonlocal last, was_busy
        went_idle, was_busy = idle and was_busy, not idle
        if time.monotonic() - last >= (idle_gap_s if went_idle else period_s):
            trim(0)
            last = time.monotonic()

    return maybe_trim


def run_engine_process(config: EngineConfig, rendezvous: Rendezvous | None, commands: Connection,
                       events: Connection) -> None:
    """Entry point of the engine process (started by engine/frontend/processes.py's fork server). A multi-rank
    engine's workers were started by the parent (a daemonic process cannot start processes), which
    hands over where they wait."""
    try:
        engine = LLMEngine(config, rendezvous)
    except BaseException as e:  # noqa: BLE001 - reported to the parent, which raises it
        events.send(("dead", f"the engine failed to start: {type(e).__name__}: {e}"))
        return
    gc.collect()
    gc.freeze()  # see AsyncLLM: full collections must not stall the loop
    events.send(("ready", engine.get_stats()))

    maybe_trim = heap_trimmer()

    def next_command(timeout: float) -> Command | None:
        maybe_trim(idle=timeout > 0)  # the loop waits only when no request is unfinished
        return commands.recv() if commands.poll(timeout) else None

    try:
        run_engine_loop(engine, next_command, lambda event: events.send(_without_prompts(event)))
    except BaseException:  # noqa: BLE001 - reported as "dead" (or the parent is gone: nobody to tell)
        pass
    finally:
        engine.shutdown()


def _without_prompts(event: Event) -> Event:
    """Outputs leave the engine process without their prompt and its token ids: AsyncLLM has both (it put
    them on the stream), and a step's outputs would otherwise carry every running prompt again. At 64
    requests of 4k-token prompts that was 0.8 MB a step, 2 ms to pickle here and 6 ms to load there."""
    if event[0] == "outputs":
        for output in event[1]:
            output.prompt = output.prompt_token_ids = None
    return event
