"""Speculative decoding: greedy output token-identical to decoding without it (n-gram, draft = target,
a different smaller draft), with prefix caching, chunked prefill, batches and preemption; the rejection
sampler preserves the target distribution; KV rollback and no leaked blocks."""

from __future__ import annotations

import json
import math
import random
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine import LLM, SamplingParams
from engine.config import EngineConfig
from engine.core.block_pool import BlockPool
from engine.core.kv_cache_manager import KVCacheManager
from engine.core.request import Request
from engine.core.scheduler import Scheduler
from engine.frontend.llm_engine import LLMEngine
from engine.models.builtin import materialize_builtin
from engine.spec_decode.eligibility import can_draft
from engine.spec_decode.ngram_proposer import NgramProposer
from engine.spec_decode.rejection_sampler import accept_greedy, rejection_sample
from tests.conftest import TINY

ENGINE = dict(max_model_len=512, block_size=4, max_num_batched_tokens=64, enable_prefix_caching=True)
GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)


@pytest.fixture(scope="module")
def small_draft(tmp_path_factory) -> Path:
    """pagedserve-tiny's first layer with its embedding and head: a smaller draft that agrees with the
    target on some tokens and not others, so both acceptance and rejection happen."""
    src, dst = materialize_builtin(TINY), tmp_path_factory.mktemp("draft")
    weights = load_file(str(src / "model.safetensors"))
    kept = {k: v for k, v in weights.items() if not k.startswith("model.layers.") or k.split(".")[2] == "0"}
    save_file(kept, str(dst / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps(config | {"num_hidden_layers": 1, "max_position_embeddings": 1024}))
    for f in src.iterdir():
        if f.name not in ("config.json", "model.safetensors"):
            shutil.copy(f, dst / f.name)
    return dst


@pytest.fixture(scope="module")
def baseline() -> LLM:
    return LLM(TINY, **ENGINE)


def _spec(method: str, small_draft: Path, **overrides) -> dict:
    if method == "ngram":
        return {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
    model = TINY if method == "draft_same" else str(small_draft)
    return {"method": "draft_model", "model": model, "num_speculative_tokens": 3} | overrides


def _tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def _pool_is_clean(engine: LLMEngine) -> bool:
    kv = engine.core.scheduler.kv_cache_manager
    pool = kv.block_pool
    return (
        pool.get_num_free_blocks() == pool.num_usable_blocks
        and all(b.ref_cnt == 0 for b in pool.blocks[1:])
        and not kv.req_to_blocks
        and not engine.core.scheduler.requests
    )


def _workload(baseline: LLM, penalty: float = 1.3) -> tuple[list[list[int]], list[SamplingParams]]:
    """Prompts sharing a prefix, a long prompt chunked over several steps, prompts that contain the
    model's own greedy continuation (so n-gram lookup finds matches), and per-request limits."""
    rng = random.Random(3)
    shared = [1] + [rng.randrange(3, 32000) for _ in range(37)]
    seeds = [[1] + [rng.randrange(3, 32000) for _ in range(20)] for _ in range(3)]
    continuations = _tokens(baseline.generate(seeds, SamplingParams(temperature=0, max_tokens=60, ignore_eos=True),
                                              use_tqdm=False))
    prompts = [
        shared + [rng.randrange(3, 32000) for _ in range(5)],
        shared + [rng.randrange(3, 32000) for _ in range(11)],
        [1] + [rng.randrange(3, 32000) for _ in range(200)],  # > max_num_batched_tokens: chunked
        *[s + c + s + c[:25] for s, c in zip(seeds, continuations)],
    ]
    params = [GREEDY] * len(prompts)
    params[1] = SamplingParams(temperature=0, max_tokens=7, ignore_eos=True)  # max_tokens inside a draft run
    params[3] = SamplingParams(temperature=0, max_tokens=33, ignore_eos=True, repetition_penalty=penalty, logprobs=2)
    return prompts, params


@pytest.mark.parametrize("method", ["ngram", "draft_same", "draft_small"])
def test_greedy_output_is_token_identical(baseline, small_draft, method):
    # Drafts ignore penalties (the target applies them at every verified position), so with a penalty
    # even draft = target would see rejections; without one it must accept everything.
    prompts, params = _workload(baseline, penalty=1.0 if method == "draft_same" else 1.3)
    llm = LLM(TINY, **ENGINE, speculative_config=_spec(method, small_draft))
    # The first prompt alone first: the batch then finds its prefix (and, with a draft model, the draft's
    # KV in the same blocks) in the cache.
    assert _tokens(llm.generate(prompts[:1], params[:1], use_tqdm=False)) == _tokens(
        baseline.generate(prompts[:1], params[:1], use_tqdm=False)
    )
    expected = baseline.generate(prompts, params, use_tqdm=False)
    got = llm.generate(prompts, params, use_tqdm=False)
    assert _tokens(got) == _tokens(expected)
    assert [len(t) for t in _tokens(got)] == [p.max_tokens for p in params]
    # Logprobs of accepted drafts come from their own verified positions.
    for a, b in zip(got[3].outputs[0].logprobs, expected[3].outputs[0].logprobs):
        assert a.keys() == b.keys()
        assert all(abs(a[t].logprob - b[t].logprob) < 1e-4 for t in a)
    assert abs(got[3].outputs[0].cumulative_logprob - expected[3].outputs[0].cumulative_logprob) < 1e-3
    stats = llm.llm_engine.get_stats()
    assert stats.spec_decode_num_draft_tokens > 0 and stats.spec_decode_num_accepted_tokens > 0
    if method == "draft_same":
        assert stats.spec_decode_acceptance_rate == 1.0
        assert stats.num_steps < baseline.llm_engine.get_stats().num_steps  # fewer steps for the same tokens
    else:  # some drafts rejected: rollback exercised
        assert stats.spec_decode_acceptance_rate < 1.0
    assert stats.prefix_cache_hits > 0  # the shared prefix was served from cache
    assert _pool_is_clean(llm.llm_engine)


@pytest.mark.parametrize("method", ["ngram", "draft_small"])
def test_preemption_with_few_blocks_keeps_output_identical(baseline, small_draft, method):
    rng = random.Random(11)
    seeds = [[1] + [rng.randrange(3, 32000) for _ in range(rng.randrange(8, 16))] for _ in range(6)]
    continuations = _tokens(baseline.generate(seeds, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
                                              use_tqdm=False))
    prompts = [s + c + s + c[:6] for s, c in zip(seeds, continuations)]  # n-gram lookup finds matches
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    expected = _tokens(baseline.generate(prompts, params, use_tqdm=False))
    llm = LLM(TINY, **(ENGINE | dict(max_model_len=128, num_kv_blocks=40)),
              speculative_config=_spec(method, small_draft))
    assert _tokens(llm.generate(prompts, params, use_tqdm=False)) == expected
    assert llm.llm_engine.core.scheduler.num_preemptions > 0
    assert llm.llm_engine.get_stats().spec_decode_num_draft_tokens > 0
    assert _pool_is_clean(llm.llm_engine)


def test_stops_truncate_accepted_drafts(baseline, small_draft):
    """A stop token, a stop string or max_tokens inside a run of accepted drafts ends the output exactly
    where decoding without drafts ends it."""
    llm = LLM(TINY, **ENGINE, speculative_config=_spec("draft_same", small_draft, num_speculative_tokens=5))
    prompt = [1] + list(range(500, 530))
    free = baseline.generate([prompt], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True), use_tqdm=False)[0]
    tokens, text = free.outputs[0].token_ids, free.outputs[0].text
    cases = [
        SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[tokens[13]]),
        SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[text[len(text) // 2 : len(text) // 2 + 3]]),
        SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[text[len(text) // 3 : len(text) // 3 + 2]],
                       include_stop_str_in_output=True, output_kind="delta"),
        SamplingParams(temperature=0, max_tokens=9, ignore_eos=True),
    ]
    for params in cases:
        want = baseline.generate([prompt], params, use_tqdm=False)[0].outputs[0]
        got = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
        assert (got.token_ids, got.text, got.finish_reason, got.stop_reason) == (
            want.token_ids, want.text, want.finish_reason, want.stop_reason
        )
        assert len(want.token_ids) < 40
    assert llm.llm_engine.get_stats().spec_decode_acceptance_rate == 1.0
    assert _pool_is_clean(llm.llm_engine)


def test_sampled_and_seeded_requests(baseline, small_draft):
    """Non-greedy requests verify drafts by rejection sampling and finish normally; seeded ones get no
    drafts, so they reproduce exactly what the engine samples without speculation."""
    llm = LLM(TINY, **ENGINE, speculative_config=_spec("draft_same", small_draft))
    prompts = [[1] + list(range(100 + 7 * i, 130 + 7 * i)) for i in range(4)]
    sampled = SamplingParams(temperature=0.8, top_k=40, max_tokens=30, ignore_eos=True)
    outs = llm.generate(prompts, sampled, use_tqdm=False)
    assert [len(t) for t in _tokens(outs)] == [30] * 4
    stats = llm.llm_engine.get_stats()
    # Draft = target samples its drafts from the same q the target's p equals: all accepted.
    assert stats.spec_decode_num_draft_tokens > 0 and stats.spec_decode_acceptance_rate > 0.99
    before = stats.spec_decode_num_draft_tokens
    seeded = SamplingParams(temperature=1.0, seed=5, max_tokens=20, ignore_eos=True)
    assert (_tokens(llm.generate(prompts, seeded, use_tqdm=False))
            == _tokens(baseline.generate(prompts, seeded, use_tqdm=False)))
    assert llm.llm_engine.get_stats().spec_decode_num_draft_tokens == before
    assert _pool_is_clean(llm.llm_engine)


def test_min_tokens_and_structured_outputs_get_no_drafts():
    request = Request("r", [1, 2, 3], SamplingParams(min_tokens=3), max_tokens=16, block_size=4)
    assert not can_draft(request)
    for token in (5, 6, 7):
        request.append_output_token(token)
    assert can_draft(request)
    assert not can_draft(Request("s", [1], SamplingParams(temperature=1.0, seed=1), max_tokens=4, block_size=4, seed=1))
    if "structured_outputs" in SamplingParams.model_fields:
        params = SamplingParams(structured_outputs={"choice": ["yes", "no"]})
        assert not can_draft(Request("t", [1], params, max_tokens=4, block_size=4))


def test_scheduler_reserves_draft_slots_within_budget_and_rolls_back():
    """Without a model: draft slots fit the token budget and max_tokens; rejected drafts leave no
    computed tokens, no block hashes and no extra blocks behind."""
    pool = BlockPool(64)
    kv = KVCacheManager(pool, 4)
    sched = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=21, max_model_len=64, num_speculative_tokens=4)
    r0, r1, r2 = [Request(f"r{i}", [1, 2, 3, 4, 5, 6, 7], SamplingParams(max_tokens=m), max_tokens=m, block_size=4)
                  for i, m in enumerate([20, 20, 3])]
    for r in (r0, r1, r2):
        sched.add_request(r)
    sched.update_from_output(sched.schedule(), [10, 11, 12])  # the prompts, whole

    sched.max_num_batched_tokens = 8
    so = sched.schedule()
    assert so.requests == [r0, r1] and so.num_scheduled_tokens == [5, 3]  # 1 + 4, then 1 + what the budget left
    assert len(kv.req_to_blocks["r0"]) == 3  # positions 7..11: the last token and 4 draft slots
    r0.spec_token_ids, r1.spec_token_ids = [20, 21, 22, 23], [30, 31]  # what a proposer would fill in
    sched.update_from_output(so, [99, 98], {0: 1, 1: 2})
    assert r0.output_token_ids == [10, 20, 99] and r0.num_computed_tokens == 9 and r0.spec_token_ids == []
    assert r1.output_token_ids == [11, 30, 31, 98] and r1.num_computed_tokens == 10

    sched.max_num_batched_tokens = 13
    so = sched.schedule()
    assert so.num_scheduled_tokens == [5, 5, 2]  # r2: max_tokens 3 leaves room for one draft
    assert len(kv.req_to_blocks["r0"]) == 4 and len(kv.req_to_blocks["r1"]) == 4
    r0.spec_token_ids, r1.spec_token_ids, r2.spec_token_ids = [50, 51, 52, 53], [], [40]
    so.num_scheduled_tokens[1] = 1  # the drafter trims slots the proposer found no drafts for
    sched.update_from_output(so, [77, 76, 97], {0: 0, 2: 1})
    assert r0.num_computed_tokens == 10 and r0.all_token_ids[-2:] == [99, 77]  # every draft rejected
    assert r1.num_computed_tokens == 11
    # The blocks reserved only for drafts went back; r2 finished at max_tokens and freed everything.
    assert len(kv.req_to_blocks["r0"]) == 3 and len(kv.req_to_blocks["r1"]) == 3
    assert r2.is_finished and r2.output_token_ids == [12, 40, 97]
    assert pool.get_num_free_blocks() == pool.num_usable_blocks - 6
    assert (sched.num_spec_drafts, sched.num_spec_draft_tokens, sched.num_spec_accepted_tokens) == (4, 11, 4)
    # Only blocks of real tokens were ever hashed and cached.
    real = {h for r in (r0, r1, r2) for h in r.block_hashes}
    assert pool.cached_block_hash_to_block and set(pool.cached_block_hash_to_block) <= real
    assert len(r0.block_hashes) == 2 and r0.num_computed_tokens // 4 == 2


def test_ngram_proposer():
    proposer = NgramProposer(prompt_lookup_min=2, prompt_lookup_max=3)
    assert proposer.propose([1, 2, 3, 4, 5, 6, 2, 3], 3) == [4, 5, 6]
    assert proposer.propose([9, 2, 3, 4, 5, 6, 1, 2, 3], 2) == [4, 5]  # the 3-gram 1 2 3 misses, 2 3 hits
    assert proposer.propose([1, 2, 3, 4, 5, 1, 2, 3], 10) == [4, 5, 1, 2, 3]  # up to the end
    assert proposer.propose([1, 2, 3, 4], 3) == []
    assert proposer.propose([7, 7, 7, 7, 7], 0) == []


def test_accept_greedy():
    assert accept_greedy([5, 6, 7], [5, 6, 7, 8]) == [5, 6, 7, 8]  # all accepted, then the bonus
    assert accept_greedy([5, 6, 7], [5, 9, 7, 8]) == [5, 9]  # the correction replaces the first mismatch
    assert accept_greedy([], [4]) == [4]


# --- rejection sampling preserves the target distribution -------------------------------------------


def _chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    keep = expected > 0
    assert counts[~keep].sum() == 0, "a token with zero target probability was emitted"
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


def _critical(df: int, z: float = 3.719) -> float:
    """Chi-square quantile by Wilson-Hilferty; z = 3.719 is the normal's 1 - 1e-4 quantile."""
    c = 2 / (9 * df)
    return df * (1 - c + z * math.sqrt(c)) ** 3


def _dist(values: list[float]) -> torch.Tensor:
    t = torch.tensor(values, dtype=torch.float32)
    return t / t.sum()


P1, P2, P3 = _dist([5, 1, 0, 3, 8, 2]), _dist([1, 1, 6, 0, 2, 4]), _dist([3, 3, 1, 1, 1, 7])
Q1, Q2 = _dist([1, 6, 4, 1, 1, 3]), _dist([2, 0.5, 1, 6, 1, 1])  # far from p, q1 covers p1's zero
N = 60_000


def _run(q1: torch.Tensor | None, q2: torch.Tensor | None, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    if q1 is None:  # point-mass drafts (n-gram): a fixed token per position
        drafts = [[4, 2]] * N
        draft_probs = None
    else:
        first = torch.multinomial(q1, N, replacement=True, generator=gen)
        second = torch.multinomial(q2, N, replacement=True, generator=gen)
        drafts = [[int(a), int(b)] for a, b in zip(first, second)]
        draft_probs = torch.cat([q1, q2]).view(2, -1).repeat(N, 1)
    target = torch.stack([P1, P2, P3]).repeat(N, 1)
    return rejection_sample(target, drafts, draft_probs, gen)


@pytest.mark.parametrize("drafts", ["sampled", "point_mass"])
def test_rejection_sampling_preserves_target_distribution(drafts):
    q1, q2 = (Q1, Q2) if drafts == "sampled" else (None, None)
    emitted = _run(q1, q2, seed=1)
    # Each position's p is that of the context before it; here the contexts are the drafts themselves,
    # so the token after an accepted draft follows the next p.
    first = torch.bincount(torch.tensor([e[0] for e in emitted]), minlength=6).float()
    assert _chi_square(first, P1) < _critical(5)
    second = torch.bincount(torch.tensor([e[1] for e in emitted if len(e) > 1]), minlength=6).float()
    assert second.sum() > 1000 and _chi_square(second, P2) < _critical(5)
    third = torch.bincount(torch.tensor([e[2] for e in emitted if len(e) > 2]), minlength=6).float()
    assert third.sum() > 1000 and _chi_square(third, P3) < _critical(5)
    assert all(1 <= len(e) <= 3 for e in emitted)


def test_the_statistic_detects_a_wrong_sampler():
    """Control: accepting with p(x) alone (ignoring q) skews the output towards q, and the same test
    rejects it, so passing above means something."""
    gen = torch.Generator().manual_seed(2)
    drafts = torch.multinomial(Q1, N, replacement=True, generator=gen)
    accept = torch.rand(N, generator=gen) < P1[drafts]
    residual = torch.multinomial(P1, N, replacement=True, generator=gen)
    emitted = torch.where(accept, drafts, residual)
    assert _chi_square(torch.bincount(emitted, minlength=6).float(), P1) > 10 * _critical(5)


def test_config_errors_name_the_field(small_draft):
    cases = {
        "num_speculative_tokens": {"method": "ngram", "num_speculative_tokens": 0},
        "prompt_lookup_min": {"method": "ngram", "prompt_lookup_min": 5, "prompt_lookup_max": 3},
        "model": {"method": "draft_model"},
        "method": {"method": "medusa"},
    }
    for field, spec in cases.items():
        with pytest.raises(ValueError, match=field):
            EngineConfig(model=TINY, speculative_config=spec)
    with pytest.raises(ValueError, match="speculative_config.model"):
        LLM(TINY, max_model_len=2048, speculative_config={"method": "draft_model", "model": str(small_draft)})
