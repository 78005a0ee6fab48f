"""DeepSeek's multi-head latent attention (engine/models/deepseek.py): a latent KV cache of latent_dim values
per token and layer, and the absorbed decode equal to the up-projected form on the same cache. Parity with
Hugging Face in every scheduling mode is in tests/engine/models/test_moe.py, TP=2 in test_parallel.py."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.models.config import ModelConfig

LATENT = 32 + 8  # the test configs' kv_lora_rank + qk_rope_head_dim (576 for the released models)


@pytest.fixture(scope="module")
def v3(hf_checkpoint) -> tuple[str, LLM]:
    path = str(hf_checkpoint("deepseek_v3"))
    return path, LLM(path, dtype="float32", num_kv_blocks=64, max_model_len=400)


def test_a_block_holds_latents_not_keys_and_values(v3):
    path, llm = v3
    cfg = ModelConfig.from_pretrained(path)
    assert cfg.mla.latent_dim == LATENT
    worker = llm.llm_engine.core.executor.driver_worker
    block = llm.llm_engine.config.block_size
    # One latent per token and layer, float32: no K and V, no factor 2. Per-head K and V of the same model
    # would take 2 x heads x (qk_head_dim + v_head_dim) / 2 = 4 x (24 + 16) values a token.
    assert worker.kv_bytes_per_block() == [cfg.num_hidden_layers * block * LATENT * 4]
    assert llm.llm_engine.get_stats().kv_bytes_per_token == cfg.num_hidden_layers * LATENT * 4  # the metric
    assert all(a.kv_cache.shape == (64, block, LATENT) for a in worker.model.attention_layers)


def test_the_absorbed_decode_equals_the_up_projected_form_on_the_same_cache(v3):
    _, llm = v3
    engine, context = llm.llm_engine, 55
    engine.add_request(list(range(5, 5 + context)), SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    engine.step()  # the prefill: the prompt's latents are in every layer's cache
    [request] = engine.core.scheduler.running
    table = torch.tensor(engine.core.scheduler.kv_cache_manager.get_block_ids(request), dtype=torch.int32)
    layer = engine.core.executor.driver_worker.model.attention_layers[1]
    gen = torch.Generator().manual_seed(0)
    q_nope = torch.randn(1, layer.num_heads, layer.mla.qk_nope_head_dim, generator=gen)
    q_pe = torch.randn(1, layer.num_heads, layer.mla.qk_rope_head_dim, generator=gen)
    with torch.no_grad():
        absorbed = layer._decode(q_nope, q_pe, table[None], torch.tensor([context], dtype=torch.int32), context)
        naive = layer._prefill(q_nope, q_pe, table, context)  # one query at the last position: sees every latent
    while engine.has_unfinished_requests():
        engine.step()
    assert absorbed.abs().max() > 0
    torch.testing.assert_close(absorbed, naive, atol=1e-5, rtol=1e-5)


def test_what_mla_does_not_support_is_refused_by_name(hf_checkpoint):
    path = str(hf_checkpoint("deepseek_v3"))
    with pytest.raises(ValueError, match="quantization"):
        LLM(path, quantization="int8")
    with pytest.raises(ValueError, match="enable_lora"):
        LLM(path, enable_lora=True)
    with pytest.raises(ValueError, match="kv_transfer_config"):
        LLM(path, kv_transfer_config={"kv_role": "kv_producer"})
    raw = {"architectures": ["DeepseekV2ForCausalLM"], "vocab_size": 8, "hidden_size": 8, "intermediate_size": 8,
           "num_hidden_layers": 1, "num_attention_heads": 2, "n_routed_experts": 4, "num_experts_per_tok": 2,
           "moe_intermediate_size": 4, "kv_lora_rank": 4, "qk_nope_head_dim": 2, "qk_rope_head_dim": 2,
           "v_head_dim": 2, "topk_method": "noaux_tc_v9"}
    with pytest.raises(ValueError, match="topk_method"):
        ModelConfig.from_dict(raw)
