"""Mixture-of-experts models (Mixtral, Qwen2-MoE, Qwen3-MoE): configs in every spelling, the fused expert
layer against a per-token reference, greedy tokens equal Hugging Face's in every scheduler mode of the
parity tests (tests/parity.py, HF's `grouped_mm` experts pinned), logprobs within 1e-4 in float32,
speculative decoding and a JSON schema, expert parallelism on 2 ranks (gloo) equal to slicing, the load
counted per expert, and the built-in MoE models.

One engine per architecture runs every scheduler mode (tests/engine/executor/test_parallel.py's `_use_variant`)."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from engine import LLM, EngineConfig, SamplingParams, StructuredOutputsParams
from engine.model_spec import check_expert_layout
from engine.models.config import ModelConfig
from engine.models.layers.fused_moe import FusedMoE, grouped_mm_available, route
from ops.cpu import load_moe_kernels, missing_toolchain
from tests.conftest import MOE_ARCHS, engines_by_arch
from tests.engine.executor.test_parallel import POOL as PARALLEL_POOL
from tests.engine.executor.test_parallel import _use_variant
from tests.engine.models.test_hf_parity import GREEDY, NEW_TOKENS, PROMPTS, SHARED_PROMPTS, VARIANTS
from tests.parity import assert_tokens_match, hf_greedy

# Hugging Face's default experts implementation on CPU, pinned: its float sums are the reference's.
HF_EXPERTS = {"experts_implementation": "grouped_mm"}
# One thread per engine: tiny models gain nothing from more, and OpenMP threads of concurrent processes
# spinning against each other slowed these tests 50x on a shared 2-core host.
POOL = {**PARALLEL_POOL, "num_threads": 1}
_MOE_LAYERS = {"mixtral": 2, "qwen2_moe": 1, "qwen3_moe": 2,  # Qwen2-MoE's layer 1 is in mlp_only_layers
               "deepseek_v2": 3, "deepseek_v3": 2,  # V3's first layer is dense (first_k_dense_replace)
               "gpt_oss": 4}


def _reference(path: str, prompt: list[int], n: int = NEW_TOKENS):
    return hf_greedy(path, prompt, n, **HF_EXPERTS)


# --- configs -------------------------------------------------------------------------------------------------

_ATTENTION = dict(vocab_size=32000, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2)


def test_hub_and_transformers_configs_resolve_alike():
    # Qwen3-30B-A3B's hub config says num_experts; transformers 5 writes num_local_experts.
    qwen3 = {**_ATTENTION, "architectures": ["Qwen3MoeForCausalLM"], "intermediate_size": 6144,
             "moe_intermediate_size": 768, "num_experts_per_tok": 8, "norm_topk_prob": True, "decoder_sparse_step": 1,
             "mlp_only_layers": [], "use_sliding_window": False, "sliding_window": None}
    hub = ModelConfig.from_dict({**qwen3, "num_experts": 128})
    written = ModelConfig.from_dict({**qwen3, "num_local_experts": 128})
    assert hub == written and hub.qk_norm and hub.sliding_window is None
    assert (hub.moe.num_experts, hub.moe.top_k, hub.moe.intermediate_size) == (128, 8, 768)
    assert hub.moe.renormalize and not hub.moe.float32_routing_weights
    assert all(hub.moe.is_moe_layer(i) for i in range(4))

    mixtral = ModelConfig.from_dict({**_ATTENTION, "architectures": ["MixtralForCausalLM"], "intermediate_size": 14336,
                                     "num_local_experts": 8, "num_experts_per_tok": 2, "sliding_window": None})
    assert (mixtral.moe.num_experts, mixtral.moe.intermediate_size) == (8, 14336)
    assert mixtral.moe.renormalize and mixtral.moe.float32_routing_weights  # always, whatever the config says

    # Qwen1.5-MoE-A2.7B style: shared expert, no renormalisation, qkv bias, a window only with use_sliding_window.
    qwen2 = {**_ATTENTION, "architectures": ["Qwen2MoeForCausalLM"], "intermediate_size": 5632,
             "moe_intermediate_size": 1408, "shared_expert_intermediate_size": 5632, "num_experts": 60,
             "num_experts_per_tok": 4, "use_sliding_window": False, "sliding_window": 32768}
    cfg = ModelConfig.from_dict(qwen2)
    assert cfg.moe.shared_expert_intermediate_size == 5632 and not cfg.moe.renormalize
    assert cfg.qkv_bias and not cfg.o_proj_bias and cfg.sliding_window is None
    sparse = ModelConfig.from_dict({**qwen2, "decoder_sparse_step": 2, "mlp_only_layers": [3]}).moe
    assert [sparse.is_moe_layer(i) for i in range(4)] == [False, True, False, False]
    assert not ModelConfig.from_dict({**qwen2, "num_experts": 0}).moe.is_moe_layer(0)

    with pytest.raises(ValueError, match="needs one expert count"):
        ModelConfig.from_dict({**qwen3, "num_experts": 128, "num_local_experts": 64})


def test_expert_layouts_are_checked_naming_the_field(hf_checkpoint):
    qwen2 = ModelConfig.from_dict({**_ATTENTION, "architectures": ["Qwen2MoeForCausalLM"], "intermediate_size": 5632,
                                   "moe_intermediate_size": 1408, "shared_expert_intermediate_size": 5632,
                                   "num_experts": 60, "num_experts_per_tok": 4})
    check_expert_layout(EngineConfig(model="m", tensor_parallel_size=4, enable_expert_parallel=True), qwen2)
    with pytest.raises(ValueError, match=r"tensor_parallel_size: 8 does not divide num_experts=60 \(expert parallel\)"):
        check_expert_layout(EngineConfig(model="m", tensor_parallel_size=8, enable_expert_parallel=True), qwen2)
    with pytest.raises(ValueError, match="tensor_parallel_size: 3 does not divide the experts' intermediate size 1408"):
        check_expert_layout(EngineConfig(model="m", tensor_parallel_size=3), qwen2)
    with pytest.raises(ValueError, match="enable_expert_parallel: Qwen3ForCausalLM has no experts"):
        LLM(str(hf_checkpoint("qwen3")), enable_expert_parallel=True)


# --- the fused expert layer ----------------------------------------------------------------------------------


def _per_token_reference(x, w13, w2, weights, ids):
    """Each token through each of its experts, one at a time (Hugging Face's eager loop, per token)."""
    out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float64)
    for t in range(x.shape[0]):
        for w, e in zip(weights[t].tolist(), ids[t].tolist()):
            gate, up = F.linear(x[t].double(), w13[e].double()).chunk(2)
            out[t] += w * F.linear(F.silu(gate) * up, w2[e].double())
    return out


# float32: every compute path lands within 1e-6 of the float64 sums, about 2 ulps of the largest outputs (~4.5):
# summation order only. atol covers the outputs that cancel to near 0, rtol the large ones (1e-2 hid 100x that).
_FUSED_MOE_TOLERANCE = {torch.float32: dict(atol=1e-6, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=1e-2)}


@pytest.mark.parametrize("compute", ["cpu_kernel", "grouped_mm", "loop"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 13, 40])
def test_fused_moe_matches_a_per_token_reference(compute, dtype, tokens):
    """`cpu_kernel`: the loader's own choice, the CPU kernel of the dtype (bfloat16's: vdpbf16ps)."""
    if compute == "cpu_kernel" and missing_toolchain():  # with a toolchain, a kernel that fails to build fails here
        pytest.skip(f"CPU kernels not compiled: {missing_toolchain()}")
    if compute == "cpu_kernel" and dtype == torch.bfloat16:
        if not load_moe_kernels().bfloat16_experts():
            pytest.skip("bfloat16 experts need AVX512_BF16")
        compute = "cpu_kernel_bf16"
    torch.manual_seed(0)
    num_experts, top_k, hidden, inter = 6, 2, 32, 48
    layer = FusedMoE(num_experts, top_k, hidden, inter, prefix="experts").to(dtype)
    w13, w2 = torch.randn(num_experts, 2 * inter, hidden) * 0.2, torch.randn(num_experts, hidden, inter) * 0.2
    with torch.no_grad():
        layer.w13_weight.copy_(w13)
        layer.w2_weight.copy_(w2)
    layer.quant_method.process_weights_after_loading(layer, tokens)
    if not compute.startswith("cpu_kernel"):  # the loader's choice is the kernel where it runs; force the others
        layer.expert_compute = compute
        layer.w13_weight.data, layer.w2_weight.data = w13.to(dtype), w2.to(dtype)
        if compute == "grouped_mm" and not grouped_mm_available(dtype, "cpu"):
            pytest.skip("grouped_mm does not run here")
    assert layer.expert_compute == compute
    x = torch.randn(tokens, hidden, dtype=dtype)
    logits = torch.randn(tokens, num_experts, dtype=dtype)
    logits[min(3, tokens - 1)] = 0  # a token whose experts tie: topk's choice is the reference's choice too
    for renormalize, float32_weights in [(True, True), (False, False)]:
        weights, ids = route(logits, top_k, renormalize, float32_weights)
        assert weights.dtype == (torch.float32 if float32_weights else dtype)
        with torch.no_grad():
            out = layer(x, weights, ids)
        ref = _per_token_reference(x, w13.to(dtype), w2.to(dtype), weights.float(), ids)
        assert out.dtype == dtype
        torch.testing.assert_close(out.double(), ref, **_FUSED_MOE_TOLERANCE[dtype])


# --- parity with Hugging Face, every scheduler mode, one engine per architecture --------------------------------


@pytest.fixture(scope="module")
def moe_engine(hf_checkpoint):
    """arch -> (checkpoint path, single-rank engine), built once per module."""
    yield from engines_by_arch(hf_checkpoint, lambda path: LLM(path, **POOL))


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_moe_greedy_parity_in_every_mode(arch, moe_engine):
    path, llm = moe_engine(arch)
    # The scheduler's modes where the KV differs (deepseek_v3's latent cache, gpt_oss's window layers) and for
    # mixtral; the other architectures differ only inside the layers: the default mode.
    for variant in VARIANTS if arch in ("mixtral", "deepseek_v3", "gpt_oss") else ["default"]:
        _use_variant(llm, {**POOL, **VARIANTS[variant]})
        outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        for prompt, out in zip(PROMPTS, outs):
            assert_tokens_match(out.outputs[0].token_ids, *_reference(path, prompt),
                                what=f"{arch} {variant}, prompt of {len(prompt)}")
        if variant == "preemption":
            assert llm.llm_engine.core.scheduler.num_preemptions > 0
        pool = llm.llm_engine.core.scheduler.kv_cache_manager.block_pool
        assert pool.get_num_free_blocks() == pool.num_usable_blocks
    for prefix_caching in (True, False):
        _use_variant(llm, {**POOL, "enable_prefix_caching": prefix_caching, "max_num_batched_tokens": 512})
        outs = (llm.generate(SHARED_PROMPTS[:1], GREEDY, use_tqdm=False)
                + llm.generate(SHARED_PROMPTS[1:], GREEDY, use_tqdm=False))
        for prompt, out in zip(SHARED_PROMPTS, outs):
            assert_tokens_match(out.outputs[0].token_ids, *_reference(path, prompt), what=f"{arch} shared prefix")
        assert all((o.num_cached_tokens >= 192) == prefix_caching for o in outs[1:])


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_moe_logprobs_and_expert_load(arch, moe_engine):
    """Logprobs within 1e-4 of Hugging Face's; each computed token counted top_k times per MoE layer."""
    path, llm = moe_engine(arch)
    _use_variant(llm, {**POOL, "enable_prefix_caching": False})
    before = llm.llm_engine.get_stats().expert_tokens
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=3)
    outs = llm.generate(PROMPTS[:3], params, use_tqdm=False)
    for prompt, out in zip(PROMPTS[:3], outs):
        tokens, ref_logprobs = _reference(path, prompt)
        assert out.outputs[0].token_ids == tokens[:8]
        for token, ours, ref in zip(tokens, out.outputs[0].logprobs, ref_logprobs):
            assert ours[token].logprob == pytest.approx(ref[token].item(), abs=1e-4)
            top_values, top_ids = ref.topk(3)
            for tid, value in zip(top_ids.tolist(), top_values.tolist()):
                assert ours[tid].logprob == pytest.approx(value, abs=1e-4)
    after = llm.llm_engine.get_stats().expert_tokens
    moe = ModelConfig.from_pretrained(path).moe
    computed = sum(len(p) + 8 - 1 for p in PROMPTS[:3])  # the last sampled token is never fed back
    assert len(after) == moe.num_experts
    assert sum(after) - sum(before) == computed * moe.top_k * _MOE_LAYERS[arch]


def test_moe_speculative_decoding_and_json_schema(moe_engine, hf_checkpoint):
    path, llm = moe_engine("qwen3_moe")
    _use_variant(llm, POOL)
    # Bounded: a random-weight model may otherwise write digits until max_tokens.
    schema = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99}},
              "required": ["a"]}
    constrained = SamplingParams(temperature=0, max_tokens=40, structured_outputs=StructuredOutputsParams(json=schema))
    out = llm.generate(PROMPTS[:1], constrained, use_tqdm=False)[0].outputs[0]
    assert isinstance(json.loads(out.text)["a"], int)
    spec = LLM(path, **POOL, speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    try:
        for prompt, out in zip(PROMPTS[:4], spec.generate(PROMPTS[:4], GREEDY, use_tqdm=False)):
            assert_tokens_match(out.outputs[0].token_ids, *_reference(path, prompt), what="ngram speculation")
        assert spec.llm_engine.get_stats().spec_decode_num_drafts > 0
    finally:
        spec.shutdown()


# --- expert parallelism on 2 ranks ------------------------------------------------------------------------------


def test_expert_parallel_equals_sliced_experts(hf_checkpoint):
    """Qwen2-MoE (shared expert, a dense layer): experts partitioned across 2 ranks give the tokens of experts
    sliced across them and of Hugging Face; each rank holds half the experts."""
    path = str(hf_checkpoint("qwen2_moe"))
    sliced = LLM(path, **POOL, tensor_parallel_size=2)
    try:
        sliced_outs = sliced.generate(PROMPTS, GREEDY, use_tqdm=False)
        sliced_bytes = sliced.llm_engine.core.executor.weight_bytes_per_rank()
    finally:
        sliced.shutdown()
    ep = LLM(path, **POOL, tensor_parallel_size=2, enable_expert_parallel=True)
    try:
        experts = ep.llm_engine.core.executor.driver_worker.model.model.layers[0].mlp.experts
        assert (experts.num_local_experts, experts.expert_start, experts.intermediate_size_per_partition) == (4, 0, 48)
        assert experts.w13_weight.numel() == 4 * 2 * 48 * experts.hidden_size
        for variant in ("default", "chunked"):
            _use_variant(ep, {**POOL, **VARIANTS[variant]})
            for prompt, a, b in zip(PROMPTS, sliced_outs, ep.generate(PROMPTS, GREEDY, use_tqdm=False)):
                ref = _reference(path, prompt)
                tie_sliced = assert_tokens_match(a.outputs[0].token_ids, *ref, what="experts sliced")
                tie_ep = assert_tokens_match(b.outputs[0].token_ids, *ref, what=f"experts partitioned, {variant}")
                if tie_sliced is None and tie_ep is None:
                    assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert sum(ep.llm_engine.get_stats().expert_tokens) > 0
        ep_bytes = ep.llm_engine.core.executor.weight_bytes_per_rank()
    finally:
        ep.shutdown()
    # Same bytes per rank either way (half of every expert, or every half of the experts).
    assert ep_bytes == sliced_bytes


# --- built-in models -------------------------------------------------------------------------------------------


def test_builtin_tiny_moe_matches_hugging_face():
    from engine.models.builtin import materialize_builtin

    path = str(materialize_builtin("pagedserve-tiny-moe"))
    cfg = ModelConfig.from_pretrained(path)
    assert cfg.architecture == "MixtralForCausalLM" and (cfg.moe.num_experts, cfg.moe.top_k) == (8, 2)
    llm = LLM("pagedserve-tiny-moe", dtype="float32", num_kv_blocks=64, max_model_len=256)
    prompts = PROMPTS[:2]
    for prompt, out in zip(prompts, llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                                                 use_tqdm=False)):
        assert_tokens_match(out.outputs[0].token_ids, *_reference(path, prompt, 8), what="pagedserve-tiny-moe")
