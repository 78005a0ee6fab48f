"""How the engine starts its processes: the engine core of an `AsyncLLM` and the ranks of a multi-rank engine.

Never forked from the caller, which holds torch's thread pools (and, in a Serve replica, Ray's threads). A
spawned child is safe but imports torch and the engine afresh, about 3 s of CPU each. So children come from
a fork server: a clean process, started once per caller and holding no threads, that imports the engine
before its first fork and forks each child from itself. The first child costs about what a spawn costs; the
rest (an engine's other ranks, the next engine this process starts) start in milliseconds. The fork server
only imports: it never initializes a GPU, so its children may. Children read their settings from their
arguments, never from the caller's environment, which the fork server does not follow after it starts."""

from __future__ import annotations

import multiprocessing
from multiprocessing.connection import Connection
from multiprocessing.context import BaseContext
from multiprocessing.process import BaseProcess
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from engine.config import EngineConfig
    from engine.executor import Rendezvous

# Everything an engine process or a rank runs; a failed import only means the child imports it itself.
_PRELOAD = ["engine.core.engine_loop", "engine.core.engine_core", "engine.executor.worker"]


def process_context() -> BaseContext:
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(_PRELOAD)  # read when the fork server starts, i.e. at the first child
    return context


def start_engine_process(config: EngineConfig, rendezvous: Rendezvous | None, tokenizer: PreTrainedTokenizerBase,
                         name: str) -> tuple[BaseProcess, Connection, Connection]:
    """An engine process running the engine loop (engine/core/engine_loop.py: run_engine_process), and its command
    and event pipes: (process, where commands go, where events come from). The tokenizer goes along: the engine
    process needs it (grammars, EOS) and loading another costs seconds."""
    from engine.core.engine_loop import run_engine_process

    ctx = process_context()
    commands_in, commands_out = ctx.Pipe(duplex=False)
    events_in, events_out = ctx.Pipe(duplex=False)
    process = ctx.Process(target=run_engine_process, args=(config, rendezvous, commands_in, events_out, tokenizer),
                          name=name, daemon=True)
    process.start()
    commands_in.close()
    events_out.close()
    return process, commands_out, events_in
