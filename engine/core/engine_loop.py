"""The engine's step loop, run by AsyncLLM either on a thread of the caller's process or in a process of
its own. A server's process is busy with Python work of its own (Ray messaging, HTTP); on a thread the
engine shares one GIL with it, and every torch call that releases the GIL may wait up to a switch
interval to get it back: measured inside a Ray Serve replica, the loop ran half as many steps per second
as alone. In its own process the loop keeps its GIL, and outputs cross back once per step for all
requests together.

It drives an EngineCore, so only token ids cross: AsyncLLM makes the text (engine/frontend/output_processor.py).
A DP rank's loop (EngineConfig.data_parallel_size) also steps while its group is in a wave without work of its
own, and sleeps on its commands and its wave connection together (engine/distributed/data_parallel.py).

The loop takes commands ("add", PreparedRequest), ("abort", request_id), ("stop", [(request_id, index)]: samples
a stop string ended), ("release_kv", request_id), ("shutdown", None) and emits events:
    ("ready", EngineStats)                                      once the engine is built
    ("outputs", list[EngineCoreOutput], EngineStats, num_adds)  after a step or applied commands
    ("rejected", request_id, ValueError)                        an add the engine refused
    ("cache_summary", bytes)                                    the prefix cache's blocks, when changed
                                                                (at most every SUMMARY_PERIOD_S)
    ("dead", message)                                           a fatal error; the loop has ended (at start,
                                                                a ValueError for a config it cannot run)"""

from __future__ import annotations

import ctypes
import gc
import logging
import time
from collections.abc import Callable
from multiprocessing import connection
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING

from engine.config import EngineConfig
from engine.core.core_output import EngineCoreOutput

if TYPE_CHECKING:  # a frontend names run_engine_process without importing the engine (and torch)
    from transformers import PreTrainedTokenizerBase

    from engine.core.engine_core import EngineCore
    from engine.executor import Rendezvous

logger = logging.getLogger(__name__)

IDLE_POLL_S = 0.5  # an idle loop re-checks for commands this often
SUMMARY_PERIOD_S = 0.5  # the prefix-cache summary for routers is refreshed at most this often
TRIM_PERIOD_S = 10.0  # the engine process hands freed heap memory back to the OS this often

Command = tuple[str, object]
Event = tuple


def run_engine_loop(core: EngineCore, next_command: Callable[[float], Command | None],
                    emit: Callable[[Event], None]) -> None:
    """Step until a "shutdown" command; `next_command(timeout)` returns None when nothing came in time.
    Raises on a fatal engine error (after emitting "dead")."""
    summary_version, summary_time = -1, 0.0
    try:
        while True:
            now = time.monotonic()
            if core.cache_version != summary_version and now - summary_time >= SUMMARY_PERIOD_S:
                summary_version, summary_time = core.cache_version, now
                emit(("cache_summary", core.cache_summary()))
            # Not polling a DP rank's wave connection before the commands: a "shutdown" sent to every rank must win
            # over the broken group that the first rank to stop leaves behind.
            timeout = 0.0 if core.wants_step(poll=False) else IDLE_POLL_S
            outputs: list[EngineCoreOutput] = []
            num_adds = num_commands = 0
            command = next_command(timeout)
            while command is not None:
                num_commands += 1
                kind, payload = command
                if kind == "shutdown":
                    return
                if kind == "add":
                    num_adds += 1
                    try:
                        core.add_request(payload)
                    except ValueError as e:
                        emit(("rejected", payload.request_id, e))
                elif kind == "abort":
                    outputs.extend(core.abort([payload]))
                elif kind == "stop":
                    core.stop(payload)
                elif kind == "release_kv":
                    core.release_kv(payload)
                command = next_command(0.0)
            freed = core.poll_kv_leases()  # blocks held for KV consumers: their stats must show the release
            went_idle = False
            if core.wants_step():  # unfinished requests, or a DP rank's group in a wave (it steps along)
                outputs.extend(core.step())
                went_idle = not core.wants_step()  # a DP rank that only stepped along: its stats once idle
            # A stop or an abort changes the stats without an output.
            if outputs or num_commands or freed or went_idle:
                emit(("outputs", outputs, core.get_stats(), num_adds))
    except BaseException as e:
        if isinstance(e, Exception) and _shutdown_queued(next_command):
            # A DP rank stopped mid-wave: the first of its group to take the shutdown left the others' collectives.
            logger.info("the engine stops on a queued shutdown after %s: %s", type(e).__name__, e)
            return
        logger.exception("fatal engine error")
        emit(("dead", f"the engine died: {type(e).__name__}: {e}"))
        raise


def _shutdown_queued(next_command: Callable[[float], Command | None]) -> bool:
    """Whether a "shutdown" command is waiting (the commands before it are dropped: the engine is going)."""
    try:
        while (command := next_command(0.0)) is not None:
            if command[0] == "shutdown":
                return True
    except Exception:  # noqa: BLE001 - the commands' channel is gone too
        pass
    return False


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
                       events: Connection, tokenizer: PreTrainedTokenizerBase | None = None) -> None:
    """Entry point of the engine process (started by engine/frontend/processes.py's fork server). A multi-rank
    engine's workers were started by the parent (a daemonic process cannot start processes), which
    hands over where they wait."""
    from engine.core.engine_core import EngineCore

    try:
        core = EngineCore.from_config(config, rendezvous, tokenizer)
    except ValueError as e:  # a config the model cannot run: the parent raises it as the ValueError it is
        events.send(("dead", ValueError(str(e))))
        return
    except BaseException as e:  # noqa: BLE001 - reported to the parent, which raises it
        events.send(("dead", f"the engine failed to start: {type(e).__name__}: {e}"))
        return
    gc.collect()
    gc.freeze()  # see AsyncLLM: full collections must not stall the loop
    events.send(("ready", core.get_stats()))

    maybe_trim = heap_trimmer()
    sources = [commands, *core.wait_sources()]  # a DP rank also wakes when another rank starts a wave

    def next_command(timeout: float) -> Command | None:
        maybe_trim(idle=timeout > 0)  # the loop waits only when no request is unfinished
        if len(sources) > 1:
            return commands.recv() if commands in connection.wait(sources, timeout) else None
        return commands.recv() if commands.poll(timeout) else None

    try:
        run_engine_loop(core, next_command, events.send)
    except BaseException:  # noqa: BLE001 - reported as "dead" (or the parent is gone: nobody to tell)
        pass
    finally:
        core.shutdown()
