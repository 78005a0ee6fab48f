"""No KV leak: whatever mix of finished and aborted requests, the pool ends entirely free."""

from __future__ import annotations

import random

import pytest

from engine import LLM, SamplingParams
from engine.frontend.llm_engine import LLMEngine
from tests.conftest import TINY


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    return LLM(TINY, max_model_len=256, num_kv_blocks=24, max_num_batched_tokens=128, max_num_seqs=8).llm_engine


def _pool_is_free(engine: LLMEngine) -> bool:
    pool = engine.core.scheduler.kv_cache_manager.block_pool
    return (pool.get_num_free_blocks() == pool.num_usable_blocks
            and not engine.core.scheduler.kv_cache_manager.req_to_blocks)


def test_mixed_finish_and_abort_frees_everything(engine):
    rng = random.Random(5)
    shared = [rng.randrange(3, 32000) for _ in range(40)]
    ids = []
    for i in range(30):
        prompt = [1] + (shared if i % 3 == 0 else []) + [rng.randrange(3, 32000) for _ in range(rng.randrange(1, 120))]
        params = SamplingParams(temperature=rng.choice([0, 1.0]), max_tokens=rng.randrange(1, 60), ignore_eos=True)
        ids.append(engine.add_request(prompt, params))
    finished, aborted, steps = set(), set(), 0
    while engine.has_unfinished_requests():
        finished.update(o.request_id for o in engine.step() if o.finished)
        steps += 1
        if steps % 3 == 0:  # abort one running and one waiting request now and then
            for queue in (engine.core.scheduler.running, list(engine.core.scheduler.waiting)):
                if queue:
                    victim = rng.choice(queue)
                    aborted.update(o.request_id for o in engine.abort_request(victim.external_id))
        assert steps < 2000
    assert finished | aborted == set(ids) and not finished & aborted
    assert aborted and finished
    assert engine.core.scheduler.num_preemptions > 0  # the small pool forced some
    assert _pool_is_free(engine)


def test_abort_unknown_or_finished_request_is_a_no_op(engine):
    request_id = engine.add_request([1, 2, 3], SamplingParams(max_tokens=2, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.abort_request([request_id, "never-existed"]) == []
    assert _pool_is_free(engine)


def test_aborted_request_reports_abort(engine):
    request_id = engine.add_request([1, 2, 3, 4], SamplingParams(max_tokens=50, ignore_eos=True))
    engine.step()
    engine.step()
    [out] = engine.abort_request(request_id)
    assert out.finished and out.outputs[0].finish_reason == "abort"
    assert len(out.outputs[0].token_ids) == 2
    assert _pool_is_free(engine)
