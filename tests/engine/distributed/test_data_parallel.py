"""Data parallelism for MoE models (engine/distributed/data_parallel.py, engine/frontend/data_parallel.py): DP
ranks that each run attention for their own requests while the experts are sharded over every rank of every
DP rank. Real checkpoints, real processes (gloo on CPU): greedy tokens at DP=2 equal one engine's (and Hugging
Face's, tie-aware: tests/parity.py) for Mixtral and Qwen3-MoE, and at DP=2 x TP=2; a rank without requests
steps along with dummy steps; an idle group sleeps and a request at either rank wakes the other; a dead
rank fails the whole group; shutdown leaves no process behind; the pairs not supported are refused by name.

One DP=2 engine per architecture serves the tests that need it (each starts two engine processes)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import psutil
import pytest

from engine import LLM, AsyncLLM, EngineConfig, LLMEngine, RequestOutputKind, SamplingParams, StructuredOutputsParams
from engine.distributed.data_parallel import host_store
from engine.errors import WorkerFailedError
from engine.model_spec import check_data_parallel, check_expert_layout
from engine.models.config import ModelConfig
from tests.conftest import _arch_configs, engines_by_arch
from tests.engine.models.test_hf_parity import PROMPTS as PARITY_PROMPTS
from tests.parity import assert_tokens_match, hf_greedy

# One thread per rank: the ranks of a group share two cores here.
POOL = dict(dtype="float32", num_kv_blocks=64, max_num_seqs=8, max_model_len=128, num_threads=1)
NEW_TOKENS = 12
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
PROMPTS = PARITY_PROMPTS[:4]  # 5, 12, 33 and 64 tokens
_one_engine: dict[str, list[list[int]]] = {}


@pytest.fixture(scope="module")
def dp_engines(hf_checkpoint):
    """arch -> (checkpoint path, its DP=2 engine with whole experts partitioned over the 2 ranks)."""
    yield from engines_by_arch(hf_checkpoint, lambda path: LLM(path, **POOL, data_parallel_size=2,
                                                               enable_expert_parallel=True))


def _one_engine_tokens(path: str) -> list[list[int]]:
    """PROMPTS' greedy tokens on one engine of one rank (data_parallel_size=1)."""
    if path not in _one_engine:
        llm = LLM(path, **POOL)
        try:
            _one_engine[path] = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
        finally:
            llm.shutdown()
    return _one_engine[path]


def _assert_like_one_engine(path: str, prompts: list[list[int]], outs, what: str) -> None:
    """Each output equals one engine's tokens, or both agree with Hugging Face's up to a tie."""
    for prompt, out in zip(prompts, outs):
        one = _one_engine_tokens(path)[PROMPTS.index(prompt)]
        ours = out.outputs[0].token_ids if hasattr(out, "outputs") else out
        if ours == one:
            continue
        ref = hf_greedy(path, prompt, NEW_TOKENS, experts_implementation="grouped_mm")
        assert_tokens_match(ours, *ref, what=f"{what}, prompt of {len(prompt)} tokens")
        assert assert_tokens_match(one, *ref, what="one engine") is not None, f"{what}: differs with no tie"


def _new_processes(before: set[int]) -> list[psutil.Process]:
    """This process's descendants not in `before`, but for the fork server (our child that outlives engines by
    design; the processes it forks are its children)."""
    procs = []
    for p in psutil.Process().children(recursive=True):
        try:
            if p.pid not in before and not (p.ppid() == os.getpid() and "forkserver" in " ".join(p.cmdline())):
                procs.append(p)
        except psutil.NoSuchProcess:
            pass
    return procs


def _model_config(arch: str, architecture: str) -> ModelConfig:
    return ModelConfig.from_dict({**_arch_configs()[arch].to_dict(), "architectures": [architecture]})


def _descendants() -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=True)}


def _wait_for_stats(llm: LLM, done, timeout_s: float = 10.0):
    """Rank stats once `done(stats)` holds (a rank sends its stats when it goes idle)."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = llm.llm_engine.rank_stats()
        if done(stats) or time.monotonic() > deadline:
            return stats
        time.sleep(0.05)


@pytest.mark.parametrize("arch", ["mixtral", "deepseek_v3"])  # softmax top-k routing; grouped sigmoid, shared experts
def test_greedy_tokens_at_dp2_equal_one_engine(arch, dp_engines):
    path, llm = dp_engines(arch)
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    _assert_like_one_engine(path, PROMPTS, outs, f"{arch} at DP=2")
    stats = _wait_for_stats(llm, lambda s: sum(r.num_requests_finished for r in s) >= len(PROMPTS))
    assert [r.num_requests_finished for r in stats] == [2, 2]  # spread over the ranks, the least loaded first
    merged = llm.llm_engine.get_stats()
    assert merged.num_requests_finished == 4
    assert sum(merged.expert_tokens) == sum(sum(r.expert_tokens) for r in stats) > 0


def test_structured_outputs_at_dp2(dp_engines):
    """A constrained request waits for its grammar while the other rank decodes: both ranks keep in step."""
    _, llm = dp_engines("mixtral")
    # Bounded: a random-weight model may otherwise write digits until max_tokens.
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}},
              "required": ["n"], "additionalProperties": False}
    constrained = SamplingParams(temperature=0, max_tokens=40, structured_outputs=StructuredOutputsParams(json=schema))
    free, bound = llm.generate(PROMPTS[:2], [GREEDY, constrained], use_tqdm=False)
    assert len(free.outputs[0].token_ids) == NEW_TOKENS
    assert isinstance(json.loads(bound.outputs[0].text)["n"], int), bound.outputs[0].text


def test_a_rank_without_requests_runs_dummy_steps(dp_engines):
    path, llm = dp_engines("mixtral")
    llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)  # the group is up and idle
    before = _wait_for_stats(llm, lambda s: True)
    out = llm.generate(PROMPTS[1:2], GREEDY, use_tqdm=False)  # to rank 0: both ranks are equally loaded (none)
    _assert_like_one_engine(path, PROMPTS[1:2], out, "rank 1 idle")
    after = _wait_for_stats(llm, lambda s: s[1].num_steps >= before[1].num_steps + NEW_TOKENS)
    assert after[0].num_requests_finished == before[0].num_requests_finished + 1
    assert after[1].num_requests_finished == before[1].num_requests_finished
    assert after[1].num_steps >= before[1].num_steps + NEW_TOKENS  # one dummy step per step of rank 0
    assert after[1].expert_tokens == before[1].expert_tokens  # dummy tokens are no load


def test_an_idle_group_sleeps_and_a_request_at_any_rank_wakes_it(dp_engines):
    path, llm = dp_engines("mixtral")
    engine = llm.llm_engine
    llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)
    time.sleep(0.3)  # the wave's last exchange
    ranks = [psutil.Process(p.pid) for p in engine._processes]
    start = [sum(p.cpu_times()[:2]) for p in ranks]
    time.sleep(1.0)
    busy = [sum(p.cpu_times()[:2]) - s for p, s in zip(ranks, start)]
    assert max(busy) < 0.1, f"idle DP ranks used {busy} s of CPU in 1 s: they must sleep in the kernel"

    before = engine.rank_stats()
    prepared = engine.prepare_request(PROMPTS[2], GREEDY)
    assert engine.add_prepared(prepared, data_parallel_rank=1) == 1  # rank 0 learns of it only from rank 1
    deadline = time.monotonic() + 30
    finished = None
    while finished is None:
        assert time.monotonic() < deadline, "the group never finished a request sent to an idle rank"
        finished = next((o for o in engine.step() if o.request_id == prepared.request_id and o.finished), None)
    _assert_like_one_engine(path, PROMPTS[2:3], [finished], "woken by rank 1")
    after = _wait_for_stats(llm, lambda s: s[0].num_steps >= before[0].num_steps + NEW_TOKENS)
    assert after[0].num_steps >= before[0].num_steps + NEW_TOKENS  # rank 0 woke and stepped along
    assert after[0].num_requests_finished == before[0].num_requests_finished


def test_dp2_tp2_equals_one_engine_and_shutdown_leaves_no_process(hf_checkpoint):
    """Four ranks: each DP rank's engine process and its TP worker; the experts over all four (EP group of 4)."""
    path = str(hf_checkpoint("mixtral"))
    before = _descendants()
    llm = LLM(path, **POOL, data_parallel_size=2, tensor_parallel_size=2, enable_expert_parallel=True)
    try:
        running = _new_processes(before)
        assert len(running) == 4, [p.cmdline() for p in running]
        outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        _assert_like_one_engine(path, PROMPTS, outs, "DP=2 x TP=2")
    finally:
        llm.shutdown()
    _, alive = psutil.wait_procs(running, timeout=5)
    assert not alive, f"left behind: {alive}"


def test_a_dead_rank_fails_the_whole_group(hf_checkpoint):
    path = str(hf_checkpoint("qwen3_moe"))
    before = _descendants()
    llm = LLM(path, **POOL, data_parallel_size=2)  # experts sliced across the ranks
    running = _new_processes(before)
    try:
        out = llm.generate(PROMPTS[:2], GREEDY, use_tqdm=False)
        _assert_like_one_engine(path, PROMPTS[:2], out, "qwen3_moe, sliced experts")
        os.kill(llm.llm_engine._processes[1].pid, signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(WorkerFailedError, match="DP rank [01] of the data-parallel group of 2 failed"):
            llm.generate(PROMPTS[:2], GREEDY, use_tqdm=False)
        assert time.monotonic() - start < 15
        with pytest.raises(WorkerFailedError):
            llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)
    finally:
        llm.shutdown()
    _, alive = psutil.wait_procs(running, timeout=5)
    assert not alive, f"left behind: {alive}"


def test_one_async_llm_per_rank_as_the_serving_app_runs_them(hf_checkpoint):
    """Each DP rank behind a frontend of its own (an AsyncLLM with its engine process: a Serve replica per rank)
    at a store someone else hosts: a request reaching rank 1 alone wakes rank 0, which no frontend told."""
    path = str(hf_checkpoint("mixtral"))
    store, address = host_store()
    configs = [EngineConfig(model=path, **POOL, multiprocess=True, enable_expert_parallel=True, data_parallel_size=2,
                            data_parallel_rank=rank, data_parallel_master=address) for rank in range(2)]
    with ThreadPoolExecutor(2) as pool:  # each waits for the other to load
        ranks = list(pool.map(AsyncLLM, configs))
    try:
        params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True,
                                output_kind=RequestOutputKind.FINAL_ONLY)

        async def generate(llm: AsyncLLM, prompt: list[int]):
            return [out async for out in llm.generate(prompt, params)][-1]

        out = asyncio.run(asyncio.wait_for(generate(ranks[1], PROMPTS[3]), 30))
        _assert_like_one_engine(path, PROMPTS[3:], [out], "AsyncLLM of rank 1")
        assert ranks[0].num_in_flight == 0 and ranks[0].is_healthy()
    finally:
        with ThreadPoolExecutor(2) as pool:
            list(pool.map(lambda llm: llm.shutdown(), ranks))


def test_unsupported_pairs_are_refused_by_name(hf_checkpoint):
    with pytest.raises(ValueError, match="data_parallel_size: Qwen3ForCausalLM is dense .* replicas"):
        LLM(str(hf_checkpoint("qwen3")), data_parallel_size=2)
    refused = {
        "pipeline_parallel_size": {"pipeline_parallel_size": 2},
        "speculative_config": {"speculative_config": {"method": "ngram", "num_speculative_tokens": 2}},
        "enable_lora": {"enable_lora": True},
        "kv_transfer_config": {"kv_transfer_config": {"kv_role": "kv_both"}},
        "quantization": {"quantization": "int8"},
        "task": {"task": "embed"},
    }
    for field, kwargs in refused.items():
        with pytest.raises(ValueError, match=f"{field}: not supported with data_parallel_size=2"):
            EngineConfig(model="m", data_parallel_size=2, **kwargs)
    with pytest.raises(ValueError, match="data_parallel_rank: 2 is not below data_parallel_size=2"):
        EngineConfig(model="m", data_parallel_size=2, data_parallel_rank=2)

    gpt_oss = _model_config("gpt_oss", "GptOssForCausalLM")
    with pytest.raises(ValueError, match="data_parallel_size: GptOssForCausalLM's experts"):
        check_data_parallel(EngineConfig(model="m", data_parallel_size=2), gpt_oss, None)
    mixtral = _model_config("mixtral", "MixtralForCausalLM")
    with pytest.raises(ValueError, match=r"data_parallel_size x tensor_parallel_size: 3 x 1 does not divide "
                                         r"num_experts=8"):
        check_expert_layout(EngineConfig(model="m", data_parallel_size=3, enable_expert_parallel=True), mixtral)

    # The ranks step in processes of their own: the in-thread engines refuse; AsyncLLM runs one rank of a
    # group someone else started.
    config = EngineConfig(model=str(hf_checkpoint("mixtral")), data_parallel_size=2)
    with pytest.raises(ValueError, match="data_parallel_size: LLMEngine steps one engine"):
        LLMEngine(config)
    with pytest.raises(ValueError, match="data_parallel_size: AsyncLLM runs one DP rank"):
        AsyncLLM(config)
