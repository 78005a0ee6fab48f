"""Sliding-window layers keep KV blocks of their own (engine/core/kv_cache_groups.py): a request holds only
the blocks its window still reaches there, the pool of those layers is sized for that, and nothing leaks.
Token parity with Hugging Face in every scheduling mode, prefix-cache hits included, is checked with the
other families (tests/engine/models/test_hf_parity.py, gemma3)."""

from __future__ import annotations

import random

import pytest

from engine import LLM, SamplingParams
from engine.core.block_pool import BlockPool
from engine.core.kv_cache_groups import KVCacheGroups, window_pool_ceiling
from engine.core.kv_cache_manager import KVCacheManager
from engine.core.request import Request
from engine.models.config import ModelConfig

WINDOW, BLOCK = 32, 16  # tests/conftest.py's gemma3: 5 layers over 32 tokens, 1 global


@pytest.fixture(scope="module")
def gemma3(hf_checkpoint) -> str:
    return str(hf_checkpoint("gemma3"))


def test_a_long_prompt_holds_only_its_window_on_the_sliding_layers(gemma3):
    llm = LLM(gemma3, dtype="float32", max_num_batched_tokens=64)  # the 8x-window prompt in 4 chunks
    engine, kv = llm.llm_engine, llm.llm_engine.core.scheduler.kv_cache_manager
    prompt = [1] + [random.Random(0).randrange(3, 32000) for _ in range(8 * WINDOW - 1)]
    engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    held = []
    while engine.has_unfinished_requests():
        engine.step()
        for request in engine.core.scheduler.running:
            held.append((request.num_computed_tokens, *kv.num_held_blocks(request)))
    decoding = [h for h in held if h[0] > len(prompt)]  # (the step after the prefill hands the chunk's back)
    assert decoding and all(full >= -(-computed // BLOCK) for computed, full, _ in decoding)
    assert max(window for *_, window in decoding) <= WINDOW // BLOCK + 1
    assert max(window for *_, window in held) <= (WINDOW + 64) // BLOCK + 2  # a chunk's blocks, then its window's
    for manager in (kv, *kv.window_groups):  # everything handed back
        assert manager.block_pool.get_num_free_blocks() == manager.block_pool.num_usable_blocks


def test_the_sliding_layers_pool_is_what_their_windows_can_use(gemma3):
    llm = LLM(gemma3, dtype="float32", kv_cache_memory_gb=0.005, max_num_seqs=16, max_num_batched_tokens=128)
    kv = llm.llm_engine.core.scheduler.kv_cache_manager
    [window_group] = kv.window_groups
    assert window_group.window == WINDOW
    assert window_group.block_pool.num_blocks == window_pool_ceiling(WINDOW, BLOCK, 16, 128) < kv.block_pool.num_blocks
    # The budget holds more full-context blocks than it would if every layer kept the whole context: the
    # window layers' pool is bounded by what 16 windows and a step use, the rest goes to the global layer.
    groups = KVCacheGroups.of(ModelConfig.from_pretrained(gemma3))
    per_layer = 2 * 2 * 32 * BLOCK * 4  # K and V of 2 KV heads of 32, float32: one layer's block
    assert groups.windows == (None, WINDOW) and groups.layer_groups == (1, 1, 1, 1, 1, 0)
    everything_full = int(0.005 * 2**30 // (6 * per_layer))
    window_bytes = window_group.block_pool.num_blocks * 5 * per_layer
    assert kv.block_pool.num_blocks == int((0.005 * 2**30 - window_bytes) // per_layer) > 1.8 * everything_full
    outs = llm.generate([[1, *range(5, 5 + n)] for n in (40, 300, 700)],
                        SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [8, 8, 8]


def test_layer_groups_follow_each_family(gemma3):
    gemma = ModelConfig.from_pretrained(gemma3)
    assert KVCacheGroups.of(gemma).has_window_groups
    mistral = ModelConfig.from_dict({"architectures": ["MistralForCausalLM"], "vocab_size": 8, "hidden_size": 8,
                                     "intermediate_size": 8, "num_hidden_layers": 2, "num_attention_heads": 2,
                                     "sliding_window": 4096})
    assert KVCacheGroups.of(mistral).windows == (4096,)  # every layer windowed: one group, itself the primary
    qwen = ModelConfig.from_dict({"architectures": ["Qwen2ForCausalLM"], "vocab_size": 8, "hidden_size": 8,
                                  "intermediate_size": 8, "num_hidden_layers": 4, "num_attention_heads": 2,
                                  "sliding_window": 64, "use_sliding_window": False})
    assert KVCacheGroups.of(qwen).windows == (None,)


def test_refused_with_what_does_not_support_windows_yet(gemma3, tiny_model_path):
    with pytest.raises(ValueError, match="speculative_config"):
        LLM(gemma3, speculative_config={"method": "draft_model", "model": str(tiny_model_path),
                                        "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="kv_transfer_config"):
        LLM(gemma3, kv_transfer_config={"kv_role": "kv_producer"})


def _hybrid(num_blocks: int, block_size: int, window: int) -> KVCacheManager:
    primary = KVCacheManager(BlockPool(num_blocks), block_size)
    primary.window_groups = [KVCacheManager(BlockPool(num_blocks), block_size, window)]
    return primary


def _request(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=4, ignore_eos=True), max_tokens=4, block_size=4)


def test_a_prefix_hit_needs_the_window_blocks_at_its_end():
    kv = _hybrid(num_blocks=40, block_size=4, window=6)
    [window_group] = kv.window_groups
    owner = _request("owner", list(range(100, 141)))  # 41 tokens: 10 full blocks
    for n in (16, 16, 9):  # three chunks: the window group hands blocks back as the owner goes
        assert kv.allocate_slots(owner, n)
        owner.num_computed_tokens += n
        kv.cache_computed_blocks(owner)
    # The last step's allocation (32 computed) handed back blocks 0-5 of the window group: its queries from
    # position 32 on read from 27 on. What the next step would no longer read goes at its allocation.
    assert kv.num_held_blocks(owner) == [11, 5]
    kv.free(owner)

    reader = _request("reader", list(range(100, 141)) + [7, 8, 9])
    hit = kv.get_computed_blocks(reader)
    assert len(hit) == 10  # 40 tokens; the window's blocks at its end (positions 35..39: blocks 8, 9) cached
    [window_hit] = hit.window_hits
    null = window_group.block_pool.null_block
    assert window_hit[:8] == [null] * 8 and null not in window_hit[8:]

    # The window group lost block 9: a 10-block prefix cannot be used, a 9-block one (window blocks 7, 8) can.
    del window_group.block_pool.cached_block_hash_to_block[reader.block_hashes[9]]
    hit = kv.get_computed_blocks(reader)
    assert len(hit) == 9 and hit.window_hits[0][:7] == [null] * 7
    assert kv.allocate_slots(reader, reader.num_tokens - 36, hit)
    assert kv.num_held_blocks(reader) == [11, 4]  # blocks 7..10 in the window group
