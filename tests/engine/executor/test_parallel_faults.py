"""A multi-rank engine fails fast and says why: a worker that dies or hangs is a fatal engine error
(WorkerFailedError offline; EngineDeadError on every stream of AsyncLLM, which turns unhealthy), never a
wait without end; a checkpoint every rank refuses fails the constructor as it would on one rank."""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import signal
import time

import pytest
from safetensors.torch import load_file, save_file

from engine import LLM, AsyncLLM, EngineConfig, EngineDeadError, SamplingParams
from engine.errors import WorkerFailedError

PARAMS = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
PROMPT = [[1, 415, 2936, 9060, 285, 1142]]


def _worker_pids(llm: LLM) -> list[int]:
    return [p.pid for p in llm.llm_engine.core.executor.launcher.processes]


def test_dead_worker_fails_the_next_step(tiny_model_path):
    llm = LLM(str(tiny_model_path), tensor_parallel_size=2, num_kv_blocks=64, max_num_seqs=4, max_model_len=512)
    try:
        assert len(llm.generate(PROMPT, PARAMS, use_tqdm=False)[0].outputs[0].token_ids) == 8
        os.kill(_worker_pids(llm)[0], signal.SIGKILL)
        time.sleep(0.5)
        assert llm.llm_engine.check_health() is not None
        start = time.monotonic()
        with pytest.raises(WorkerFailedError, match="rank 1"):
            llm.generate(PROMPT, PARAMS, use_tqdm=False)
        assert time.monotonic() - start < 10
    finally:
        llm.shutdown()


def test_hung_worker_fails_after_the_step_timeout(tiny_model_path):
    llm = LLM(str(tiny_model_path), pipeline_parallel_size=2, num_kv_blocks=64, max_num_seqs=4, max_model_len=512,
              step_timeout_s=3)
    pid = _worker_pids(llm)[0]
    try:
        llm.generate(PROMPT, PARAMS, use_tqdm=False)
        os.kill(pid, signal.SIGSTOP)
        start = time.monotonic()
        with pytest.raises(WorkerFailedError):
            llm.generate(PROMPT, PARAMS, use_tqdm=False)
        assert 2.5 < time.monotonic() - start < 30
    finally:
        os.kill(pid, signal.SIGKILL)
        llm.shutdown()


def test_checkpoint_refused_by_every_rank_fails_construction(hf_checkpoint, tmp_path):
    folder = tmp_path / "broken"
    folder.mkdir()
    for f in hf_checkpoint("mistral").iterdir():
        (folder / f.name).write_bytes(f.read_bytes())
    tensors = load_file(str(folder / "model.safetensors"))
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    start = time.monotonic()
    with pytest.raises(ValueError, match=r"model.layers.1.mlp.gate_up_proj.weight\[1\]"):
        LLM(str(folder), tensor_parallel_size=2)
    assert time.monotonic() - start < 120


def test_async_engine_dies_with_its_worker(tiny_model_path):
    async def run() -> None:
        llm = AsyncLLM(EngineConfig(model=str(tiny_model_path), tensor_parallel_size=2, multiprocess=True,
                                    num_kv_blocks=64, max_num_seqs=4, max_model_len=512))
        try:
            stream = llm.generate(PROMPT[0], SamplingParams(temperature=0, max_tokens=1000, ignore_eos=True))
            await stream.__anext__()
            assert llm.is_healthy()
            os.kill(llm._launcher.processes[0].pid, signal.SIGKILL)
            with pytest.raises(EngineDeadError, match="rank"):
                async for _ in stream:
                    pass
            assert not llm.is_healthy()
            with pytest.raises(EngineDeadError):
                async for _ in llm.generate(PROMPT[0], PARAMS):
                    pass
        finally:
            llm.shutdown()

    asyncio.run(asyncio.wait_for(run(), 120))



def _rank_processes() -> list:
    return [p for p in multiprocessing.active_children() if p.name.startswith("pagedserve-rank-")]


def test_failure_after_launch_leaves_no_worker(tiny_model_path, tmp_path):
    # The workers never load the tokenizer: a multi-rank AsyncLLM that cannot must not leave the worker
    # processes it launched waiting at the rendezvous (for INIT_TIMEOUT, half an hour).
    before = _rank_processes()
    start = time.monotonic()
    with pytest.raises(ValueError, match="tokenizer: cannot load a tokenizer"):
        AsyncLLM(EngineConfig(model=str(tiny_model_path), tokenizer=str(tmp_path), tensor_parallel_size=2,
                              multiprocess=True, num_kv_blocks=64, max_model_len=512))
    assert time.monotonic() - start < 30
    deadline = time.monotonic() + 5
    while _rank_processes() != before and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _rank_processes() == before


def test_draft_model_failing_to_load_stops_the_workers(tiny_model_path, tmp_path):
    # The draft's config is checked before the workers start; its weights load on the driver's device,
    # after they have started: a draft whose weights are missing must stop them.
    draft = tmp_path / "draft"
    draft.mkdir()
    (draft / "config.json").write_bytes((tiny_model_path / "config.json").read_bytes())
    before = _rank_processes()
    with pytest.raises(ValueError, match=r"model: no \*\.safetensors weights"):
        LLM(str(tiny_model_path), tensor_parallel_size=2, num_kv_blocks=64, max_num_seqs=4, max_model_len=512,
            speculative_config={"method": "draft_model", "model": str(draft), "num_speculative_tokens": 2})
    assert _rank_processes() == before
