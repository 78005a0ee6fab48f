"""A request is prepared once (validated, tokenized, its prompt's blocks hashed), by whoever receives it,
and taken as it is from there: AsyncLLM does not prepare it again, and the core hands its block hashes to
every sample instead of hashing the prompt once per sample."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest

from engine import AsyncLLM, EngineConfig, LLMEngine, SamplingParams
from engine.core.block_hash import hash_block_chain
from tests.conftest import TINY

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def engine():
    engine = LLMEngine(EngineConfig(model=TINY, max_model_len=512, num_kv_blocks=128))
    yield engine
    engine.shutdown()


def test_preparing_hashes_the_prompt_and_the_samples_share_the_hashes(engine):
    prompt = list(range(3, 3 + 70))  # 4 full blocks of 16
    prepared = engine.prepare_request(prompt, GREEDY.model_copy(update={"n": 3}), cache_salt="s")
    assert prepared.block_hashes == hash_block_chain(prompt, 16, "s")
    engine.add_prepared(prepared)
    children = engine.core._children[prepared.request_id]
    assert all(child.block_hashes is prepared.block_hashes for child in children)
    while engine.has_unfinished_requests():
        engine.step()


def test_hashes_that_do_not_fit_the_prompt_are_computed_again(engine):
    prompt = list(range(3, 3 + 40))
    prepared = replace(engine.prepare_request(prompt, GREEDY), block_hashes=[1, 2, 3, 4, 5])  # one too many
    engine.add_prepared(prepared)
    assert engine.core._children[prepared.request_id][0].block_hashes == hash_block_chain(prompt, 16)
    while engine.has_unfinished_requests():
        engine.step()


def test_async_llm_takes_a_prepared_request_as_it_is():
    llm = AsyncLLM(EngineConfig(model=TINY, max_model_len=512, num_kv_blocks=128))
    try:
        prepared = llm.processor.prepare_request("Tell me a story", GREEDY, "prepared-1")

        def refuse(*args, **kwargs):
            raise AssertionError("prepared again")

        async def run():
            reference = [o async for o in llm.generate("Tell me a story", GREEDY)]
            llm.processor.prepare_request = refuse
            outputs = [o async for o in llm.generate(prepared)]
            with pytest.raises(ValueError, match="prompt: a PreparedRequest carries its own parameters"):
                async for _ in llm.generate(prepared, GREEDY):
                    pass
            return reference, outputs

        reference, outputs = asyncio.run(run())
        assert outputs[-1].request_id == "prepared-1" and outputs[-1].finished
        tokens = [t for o in outputs for t in o.outputs[0].token_ids]
        assert tokens == [t for o in reference for t in o.outputs[0].token_ids]
    finally:
        llm.shutdown()
