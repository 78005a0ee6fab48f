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
from multiprocessing.context import BaseContext

# Everything an engine process or a rank runs; a failed import only means the child imports it itself.
_PRELOAD = ["engine.core.engine_loop", "engine.core.engine_core", "engine.executor.worker"]


def process_context() -> BaseContext:
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(_PRELOAD)  # read when the fork server starts, i.e. at the first child
    return context
