"""Tensor and pipeline parallelism on CPU (gloo, worker processes): greedy tokens equal Hugging Face's
and the single-rank engine's (tests/parity.py), in every scheduler mode of the parity tests; logprobs
within 1e-4 of one rank; KV heads replicated when ranks outnumber them; each rank holds its share of the
weights; the sampling surface, structured outputs and speculative decoding work across ranks.

To keep CI short, one engine per (architecture, layout) runs every scheduler mode: the modes differ only
on the driver (the scheduler and its block pool), so each mode gets a fresh scheduler over the same ranks.
For the same reason the TP=2 x PP=2 engines (four processes each) are built once per module and shared by
the tests that need that layout, each back on the engine's own scheduler configuration when it is done."""

from __future__ import annotations

import json

import pytest

from engine import LLM, SamplingParams, StructuredOutputsParams
from engine.config import resolve_max_num_batched_tokens
from tests.conftest import engines_by_arch
from tests.engine.models.test_hf_parity import GREEDY, NEW_TOKENS, PROMPTS, VARIANTS
from tests.parity import assert_tokens_match, hf_greedy

LAYOUTS = {"tp2": (2, 1), "pp2": (1, 2), "tp2pp2": (2, 2)}
POOL = dict(dtype="float32", num_kv_blocks=512, max_num_seqs=16, max_model_len=400)


def _engine(path: str, tp: int, pp: int, **kwargs) -> LLM:
    return LLM(path, tensor_parallel_size=tp, pipeline_parallel_size=pp, **{**POOL, **kwargs})


def _use_config(llm: LLM, config) -> None:
    """A fresh scheduler (and block pool) configured like an engine built with `config`."""
    llm.llm_engine.step()  # idle: hands the finished requests' ids to the batch builder, which forgets them
    core = llm.llm_engine.core
    core.config = config
    core.max_num_batched_tokens = resolve_max_num_batched_tokens(config, core.max_model_len)
    core.scheduler = core._build_scheduler(config.num_kv_blocks)


def _use_variant(llm: LLM, overrides: dict) -> None:
    """A fresh scheduler (and block pool) configured like an engine built with `overrides`."""
    _use_config(llm, llm.llm_engine.config.model_copy(update=overrides))


def _check_modes(path: str, llm: LLM, variants: list[str]) -> None:
    built_with = llm.llm_engine.config
    try:
        for variant in variants:
            _use_variant(llm, {**POOL, **VARIANTS[variant]})
            outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
            for prompt, out in zip(PROMPTS, outs):
                assert_tokens_match(out.outputs[0].token_ids, *hf_greedy(path, prompt, NEW_TOKENS),
                                    what=f"{variant}, prompt of {len(prompt)} tokens")
            if variant == "preemption":
                assert llm.llm_engine.core.scheduler.num_preemptions > 0
            pool = llm.llm_engine.core.scheduler.kv_cache_manager.block_pool
            assert pool.get_num_free_blocks() == pool.num_usable_blocks
    finally:
        _use_config(llm, built_with)


@pytest.fixture(scope="module")
def four_ranks(hf_checkpoint):
    """arch -> (checkpoint path, its TP=2 x PP=2 engine), built once per module."""
    yield from engines_by_arch(hf_checkpoint, lambda path: _engine(path, 2, 2))


# Every layout for llama and qwen3; the others differ from them inside the layers (mistral: sliding window,
# qwen2: QKV biases, deepseek_v3: latent attention with its heads split and its latent cache whole on each rank,
# gemma3: Gemma's layers and window layers' KV groups, gpt_oss: attention sinks split with the heads and experts
# split by interleaved gate/up features), which only tensor parallelism splits: TP=2 alone.
@pytest.mark.parametrize("arch,layout", [(arch, layout) for arch in ("llama", "qwen3") for layout in LAYOUTS]
                         + [("mistral", "tp2"), ("qwen2", "tp2"), ("deepseek_v3", "tp2"), ("gemma3", "tp2"),
                            ("gpt_oss", "tp2")])
def test_parallel_greedy_parity(arch, layout, hf_checkpoint, four_ranks):
    variants = list(VARIANTS) if arch == "llama" else ["default"]  # the modes are the scheduler's, not the layers
    if layout == "tp2pp2" and arch in ("llama", "qwen3"):  # shared with the tests below
        _check_modes(*four_ranks(arch), variants)
        return
    path = str(hf_checkpoint(arch))
    llm = _engine(path, *LAYOUTS[layout])
    try:
        _check_modes(path, llm, variants)
    finally:
        llm.shutdown()


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_parallel_logprobs_match_one_rank(arch, four_ranks):
    path, llm = four_ranks(arch)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=5, prompt_logprobs=2)
    one = _engine(path, 1, 1).generate(PROMPTS[:3], params, use_tqdm=False)
    outs = llm.generate(PROMPTS[:3], params, use_tqdm=False)
    for ref, out in zip(one, outs):
        assert out.outputs[0].token_ids == ref.outputs[0].token_ids
        for ours, theirs in zip(out.outputs[0].logprobs + out.prompt_logprobs[1:],
                                ref.outputs[0].logprobs + ref.prompt_logprobs[1:]):
            assert ours.keys() == theirs.keys()
            for token, lp in theirs.items():
                assert ours[token].logprob == pytest.approx(lp.logprob, abs=1e-4)


def test_tp4_replicates_kv_heads(hf_checkpoint):
    path = str(hf_checkpoint("llama"))  # 4 attention heads, 2 KV heads: each KV head on 2 ranks
    llm = _engine(path, 4, 1)
    try:
        attn = llm.llm_engine.core.executor.driver_worker.model.attention_layers[0]
        assert (attn.num_heads, attn.num_kv_heads, attn.qkv_proj.num_kv_head_replicas) == (1, 1, 2)
        _check_modes(path, llm, ["default"])
    finally:
        llm.shutdown()


def test_tp2_halves_weight_bytes_per_rank(hf_checkpoint):
    path = str(hf_checkpoint("qwen2"))
    one = _engine(path, 1, 1).llm_engine.core.executor.weight_bytes_per_rank()[0]
    llm = _engine(path, 2, 1)
    try:
        per_rank = llm.llm_engine.core.executor.weight_bytes_per_rank()
    finally:
        llm.shutdown()
    assert len(per_rank) == 2 and max(per_rank.values()) <= 0.55 * one, (per_rank, one)


def test_parallel_sampling_structured_and_speculative(four_ranks):
    """Seeded sampling, penalties, a JSON schema and n-gram speculation behave on TP=2 x PP=2 as on one rank."""
    path, llm = four_ranks("qwen3")
    prompts = PROMPTS[:4]
    sampled = SamplingParams(temperature=0.8, top_p=0.9, top_k=50, seed=7, presence_penalty=0.5, max_tokens=12,
                             ignore_eos=True, n=2)
    # An enum bounds the document: a free integer lets a random-weight model emit digits past max_tokens.
    schema = {"type": "object", "properties": {"a": {"enum": [1, 22, 333]}}, "required": ["a"]}
    constrained = SamplingParams(temperature=0, max_tokens=40, structured_outputs=StructuredOutputsParams(json=schema))
    speculative = {"speculative_config": {"method": "ngram", "num_speculative_tokens": 3}}
    one, one_spec = _engine(path, 1, 1), _engine(path, 1, 1, **speculative)
    spec = _engine(path, 2, 2, **speculative)
    try:
        for a, b in zip(one.generate(prompts, sampled, use_tqdm=False), llm.generate(prompts, sampled, use_tqdm=False)):
            assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
        out = llm.generate(prompts[:1], constrained, use_tqdm=False)[0].outputs[0]
        assert json.loads(out.text)["a"] in (1, 22, 333) and out.finish_reason == "stop"
        assert out.token_ids == one.generate(prompts[:1], constrained, use_tqdm=False)[0].outputs[0].token_ids
        for a, b in zip(one_spec.generate(prompts, GREEDY, use_tqdm=False),
                        spec.generate(prompts, GREEDY, use_tqdm=False)):
            assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert spec.llm_engine.get_stats().spec_decode_num_drafts > 0
    finally:
        spec.shutdown()


def test_unsplittable_models_are_refused_naming_the_field(hf_checkpoint):
    path = str(hf_checkpoint("llama"))  # 4 heads, 2 KV heads, 2 layers
    with pytest.raises(ValueError, match="tensor_parallel_size: 3 does not divide num_attention_heads=4"):
        LLM(path, tensor_parallel_size=3)
    with pytest.raises(ValueError, match="pipeline_parallel_size: 3 stages for a model of 2 layers"):
        LLM(path, pipeline_parallel_size=3)
    with pytest.raises(ValueError, match="distributed_executor_backend: 'uni' runs one rank"):
        LLM(path, tensor_parallel_size=2, distributed_executor_backend="uni")
    with pytest.raises(ValueError, match="distributed_executor_backend: 'ray'"):
        LLM(path, tensor_parallel_size=2, distributed_executor_backend="ray")
