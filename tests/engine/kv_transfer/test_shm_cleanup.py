"""Nothing of ours stays in /dev/shm: every file the engine makes there names its owner's pid
(engine/shm_files.py); the step queue's ring is gone once the ranks have mapped it, and gone when they never
connect; what an engine killed outright leaves, the next engine to start on the host sweeps away."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch.distributed as dist

from engine import AsyncLLM, EngineConfig, LLMEngine, SamplingParams
from engine.distributed.message_queue import MessageQueueReader, MessageQueueWriter
from engine.shm_files import SHM_DIR, owned_prefix, sweep


def _ring(name: str) -> Path:
    return Path(SHM_DIR) / f"{owned_prefix('mq')}{name}"


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_sweep_removes_the_files_of_dead_owners_only(tmp_path):
    dead, alive = _dead_pid(), os.getpid()
    names = [f"pagedserve-{kind}-{pid}-x{suffix}" for pid in (dead, alive)
             for kind, suffix in (("kv", ".rank0.kv"), ("rx", ".rank1.tmp"), ("mq", ""))]
    for name in names + [f"other-{dead}-x", f"pagedserve-xx-{dead}-x"]:  # not ours: never touched
        (tmp_path / name).touch()
    assert sorted(sweep(tmp_path)) == sorted(n for n in names if f"-{dead}-" in n)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [n for n in names if f"-{alive}-" in n] + [f"other-{dead}-x", f"pagedserve-xx-{dead}-x"])


def test_ring_is_removed_when_the_ranks_never_connect():
    with pytest.raises(TimeoutError, match="0 of 1 readers connected"):
        MessageQueueWriter(dist.HashStore(), "lonely", num_readers=1, host="127.0.0.1", timeout_s=0.2)
    assert not _ring("lonely").exists()


def test_ring_is_unlinked_once_mapped():
    store, made = dist.HashStore(), {}
    thread = threading.Thread(target=lambda: made.setdefault("writer", MessageQueueWriter(store, "q", 1, "127.0.0.1")))
    thread.start()
    reader = MessageQueueReader(store, "q", 0)
    thread.join()
    writer = made["writer"]
    try:
        assert not _ring("q").exists() and reader.ring is not None
        writer.enqueue({"step": 1})
        assert reader.dequeue() == {"step": 1}  # through the ring, which outlives its name
    finally:
        reader.close()
        writer.close()


def test_a_killed_engine_leaves_nothing_after_the_next_start(tiny_model_path):
    """An engine process killed with its staged KV held: the next engine to start removes those files."""
    config = {"model": str(tiny_model_path), "num_kv_blocks": 64, "max_model_len": 512}

    async def prefill_then_kill() -> tuple[str, int]:
        llm = AsyncLLM(EngineConfig(**config, multiprocess=True, kv_transfer_config={"kv_role": "kv_producer"}))
        try:
            async for out in llm.generate([1, 415, 2936, 9060] * 10, SamplingParams(max_tokens=1), request_id="a",
                                          kv_transfer_params={"do_remote_decode": True}):
                last = out
            pid = llm._process.pid
            os.kill(pid, signal.SIGKILL)
            llm._process.join(5)
            return last.kv_transfer_params["name"], pid
        finally:
            llm.shutdown()

    name, pid = asyncio.run(prefill_then_kill())
    left = [p for p in Path(SHM_DIR).iterdir() if p.name.startswith(name)]
    assert left and f"-{pid}-" in left[0].name  # held, and named after its dead owner
    LLMEngine(EngineConfig(**config, kv_transfer_config={"kv_role": "kv_consumer"})).shutdown()
    assert not any(p.exists() for p in left)
