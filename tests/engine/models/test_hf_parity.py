"""Greedy parity with Hugging Face transformers on random weights, float32, for every supported
architecture, across the engine's scheduling modes (tests/parity.py: equal tokens, ties excepted)."""

from __future__ import annotations

import random

import pytest

from engine import LLM, SamplingParams
from tests.conftest import ARCHS
from tests.parity import assert_tokens_match, hf_greedy

NEW_TOKENS = 32
PROMPT_LENS = [5, 12, 33, 64, 100, 150, 240, 300]


def _random_prompts(seed: int, lengths: list[int], prefix: list[int] = ()) -> list[list[int]]:
    rng = random.Random(seed)
    return [[1, *prefix] + [rng.randrange(3, 32000) for _ in range(n - 1 - len(prefix))] for n in lengths]


PROMPTS = _random_prompts(0, PROMPT_LENS)
SHARED_PREFIX = _random_prompts(1, [200])[0][1:]
SHARED_PROMPTS = _random_prompts(2, [210, 230, 250, 260, 280, 300, 205, 220], SHARED_PREFIX)


GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)

VARIANTS = {
    "default": {},
    "no_prefix_caching": {"enable_prefix_caching": False},
    "chunked": {"max_num_batched_tokens": 48},
    "preemption": {"num_kv_blocks": 30, "max_model_len": 400},
}


# The scheduler's modes for llama and gemma3 (whose window layers keep KV groups of their own); the other
# architectures differ only inside the layers: the default mode.
@pytest.mark.parametrize("arch,variant", [(arch, variant) for arch in ARCHS
                                          for variant in (VARIANTS if arch in ("llama", "gemma3") else ["default"])])
def test_greedy_parity(arch, variant, hf_checkpoint):
    path = str(hf_checkpoint(arch))
    llm = LLM(path, dtype="float32", **VARIANTS[variant])
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    for prompt, out in zip(PROMPTS, outs):
        assert_tokens_match(out.outputs[0].token_ids, *hf_greedy(path, prompt, NEW_TOKENS),
                            what=f"prompt of {len(prompt)} tokens")
        assert out.outputs[0].finish_reason == "length"
    if variant == "preemption":
        assert llm.llm_engine.core.scheduler.num_preemptions > 0
    pool = llm.llm_engine.core.scheduler.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_usable_blocks


@pytest.mark.parametrize("prefix_caching", [True, False])
@pytest.mark.parametrize("arch", ARCHS)
def test_shared_prefix_parity(arch, prefix_caching, hf_checkpoint):
    path = str(hf_checkpoint(arch))
    llm = LLM(path, dtype="float32", enable_prefix_caching=prefix_caching, max_num_batched_tokens=512)
    first = llm.generate(SHARED_PROMPTS[:1], GREEDY, use_tqdm=False)  # warms the cache with the prefix
    outs = first + llm.generate(SHARED_PROMPTS[1:], GREEDY, use_tqdm=False)
    for prompt, out in zip(SHARED_PROMPTS, outs):
        assert_tokens_match(out.outputs[0].token_ids, *hf_greedy(path, prompt, NEW_TOKENS),
                            what=f"prompt of {len(prompt)} tokens")
    cached = [o.num_cached_tokens for o in outs[1:]]
    if prefix_caching:
        assert all(c >= 192 for c in cached), cached  # the 200-token prefix, in full 16-token blocks
        assert llm.llm_engine.core.scheduler.kv_cache_manager.prefix_cache_hits > 0
    else:
        assert cached == [0] * len(cached)


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3"])
def test_logprob_parity(arch, hf_checkpoint):
    path = str(hf_checkpoint(arch))
    llm = LLM(path, dtype="float32")
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=5)
    outs = llm.generate(PROMPTS[:4], params, use_tqdm=False)
    for prompt, out in zip(PROMPTS[:4], outs):
        tokens, hf_logprobs = hf_greedy(path, prompt, NEW_TOKENS)
        completion = out.outputs[0]
        assert completion.token_ids == tokens
        assert len(completion.logprobs) == NEW_TOKENS
        for token, ours, ref in zip(tokens, completion.logprobs, hf_logprobs):
            assert ours[token].logprob == pytest.approx(ref[token].item(), abs=1e-4)
            assert ours[token].rank == 1  # greedy picks the argmax
            top_values, top_ids = ref.topk(5)
            for tid, value in zip(top_ids.tolist(), top_values.tolist()):
                assert ours[tid].logprob == pytest.approx(value, abs=1e-4)
        assert completion.cumulative_logprob == pytest.approx(sum(lp[t].item() for t, lp in zip(tokens, hf_logprobs)),
                                                              abs=1e-3)


def test_gemma3_multimodal_checkpoint_serves_its_language_model(tmp_path):
    """Gemma3ForConditionalGeneration (the 4B-27B releases) as transformers saves it: the language model's
    weights under model.language_model, a vision tower we skip, text_config nested in config.json."""
    import torch
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, SiglipVisionConfig

    from tests.conftest import _arch_configs, copy_builtin_tokenizer

    vision = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                image_size=28, patch_size=14)
    config = Gemma3Config(text_config=_arch_configs()["gemma3"].to_dict(), vision_config=vision.to_dict(),
                          mm_tokens_per_image=4, image_token_index=31999, boi_token_index=31997,
                          eoi_token_index=31998)
    torch.manual_seed(0)
    model = Gemma3ForConditionalGeneration(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(0.1 * torch.randn_like(p) if "norm" in name else 0.05 * torch.randn_like(p))
    model.save_pretrained(tmp_path)
    copy_builtin_tokenizer(tmp_path)
    path = str(tmp_path)
    llm = LLM(path, dtype="float32")
    prompts = PROMPTS[1:3] + PROMPTS[-1:]
    for prompt, out in zip(prompts, llm.generate(prompts, GREEDY, use_tqdm=False)):
        assert_tokens_match(out.outputs[0].token_ids, *hf_greedy(path, prompt, NEW_TOKENS),
                            what=f"prompt of {len(prompt)} tokens")
