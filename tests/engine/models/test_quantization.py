"""Quantized weights: GPTQ, AWQ, compressed-tensors and FP8 checkpoints written independently of our
loader (tests/engine/models/quantized_checkpoints.py), and online int8 / int4, each against Hugging Face on a
dense model holding the checkpoint's own dequantized weights (tests/parity.py's tie rule).

Stated tolerance: our logprobs of the chosen tokens are within LOGPROB_TOL of HF's on the dequantized
oracle (float32; the kernels sum in another order, nothing else differs), so a token may differ only where
HF's top-2 gap is below TIE = 2 * LOGPROB_TOL (both sides may move by LOGPROB_TOL). Schemes that round
activations to int8 (W8A8, W4A8) get ROUNDED_LOGPROB_TOL: an activation within float rounding of a half step
rounds either way on the two sides, one step of its row's scale times its weights (2.7e-3 seen on an AVX2 host,
whose float sums run 8 lanes wide where AVX-512's run 16)."""

from __future__ import annotations

import json

import pytest
import torch

from engine import LLM, SamplingParams
from engine.models.layers.quantization import resolve_quant_config
from engine.models.layers.quantization.awq import unpack_awq
from engine.models.layers.quantization.online import int4_group_size, quantize_int8
from engine.models.layers.quantization.weight_only import unpack_int32
from ops.cpu.linear import from_panels
from ops.cpu.quant_linear import dequantize_int4, dequantize_int8, unpack_int4_params, unpack_w4a8, unpack_w8a8
from tests.engine.models.quantized_checkpoints import (
    LINEAR,
    awq_pack,
    gptq_pack_qweight,
    gptq_pack_qzeros,
    write_awq,
    write_compressed_tensors,
    write_fp8,
    write_gptq,
    write_mxfp4,
)
from tests.parity import assert_tokens_match, hf_greedy

LOGPROB_TOL = 2e-3
TIE = 2 * LOGPROB_TOL
ROUNDED_LOGPROB_TOL = 5e-3
NEW_TOKENS = 12
PROMPTS = [[1, *range(300, 340)], [1, 7, 99, 4000, 12, 555], [1, *range(300, 330), 9, 9, 9]]  # 1 and 3 share 31 tokens
ENGINE = dict(dtype="float32", num_kv_blocks=64, max_model_len=256)  # a small KV pool: engines start fast
PARAMS = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=1)


def _check_parity(llm: LLM, oracle: str, what: str) -> None:
    """W8A8 engines against the oracle with its decoder projections' inputs rounded to int8 per token."""
    experts = {getattr(m, "expert_compute", None) for m in _modules(llm)}
    rounded = (*LINEAR, "experts") if {"w8a8", "w4a8"} & (_computes(llm) | experts) else ()
    tol = ROUNDED_LOGPROB_TOL if rounded else LOGPROB_TOL
    outs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    for prompt, out in zip(PROMPTS, outs):
        tokens, logprobs = hf_greedy(oracle, prompt, NEW_TOKENS, quantize_inputs_of=rounded)
        ours = out.outputs[0]
        tie = assert_tokens_match(ours.token_ids, tokens, logprobs, 2 * tol, what)
        for i, (token, lp) in enumerate(zip(ours.token_ids[:tie], ours.logprobs)):
            assert abs(lp[token].logprob - float(logprobs[i][token])) < tol, (what, i)


def _modules(llm: LLM):
    return llm.llm_engine.core.executor.driver_worker.model.modules()


def _computes(llm: LLM) -> set[str]:
    return {getattr(m, "compute", None) for m in _modules(llm) if hasattr(m, "quant_method")} - {None}


@pytest.fixture(scope="module")
def quantized(hf_checkpoint, tmp_path_factory):
    """(format case) -> (checkpoint, oracle), written once per module."""
    cache = {}

    def get(case: str):
        if case not in cache:
            arch, writer, kwargs, _ = CASES[case]
            cache[case] = writer(hf_checkpoint(arch), tmp_path_factory.mktemp(case) / "ckpt", **kwargs)
        return tuple(map(str, cache[case]))

    return get


# (arch, writer, kwargs, the compute forms the layers must end up in)
CASES = {
    "gptq4_sym_v1": ("llama", write_gptq, dict(bits=4, group_size=32, sym=True, desc_act=False, v1=True), {"int4"}),
    # act-order, asymmetric, v2; Qwen2's qkv bias; down_proj's 160 inputs in groups of 32 -> int4 after sorting
    "gptq4_actorder_v2": ("qwen2", write_gptq, dict(bits=4, group_size=32, sym=False, desc_act=True, v1=False),
                          {"int4"}),
    "gptq8_channel": ("mistral", write_gptq, dict(bits=8, group_size=-1, sym=True, desc_act=False, v1=True), {"int8"}),
    "gptq8_grouped": ("qwen3", write_gptq, dict(bits=8, group_size=32, sym=True, desc_act=False, v1=True), {"dense"}),
    "awq": ("llama", write_awq, dict(group_size=32), {"int4"}),
    "ct_w4a16_asym_group": ("qwen3", write_compressed_tensors, dict(bits=4, strategy="group", symmetric=False,
                                                                     group_size=32), {"int4"}),
    "ct_w8a16_channel": ("llama", write_compressed_tensors, dict(bits=8, strategy="channel", symmetric=True), {"int8"}),
    # W8A8 as llm-compressor writes it (int-quantized; the package's symmetric scale is max|w| / 127.5, so -128
    # occurs); Qwen2's qkv bias added after the integer product.
    "ct_w8a8_channel": ("qwen2", write_compressed_tensors, dict(bits=8, strategy="channel", symmetric=True,
                                                                activations=True), {"w8a8"}),
    "ct_w8a8_tensor": ("llama", write_compressed_tensors, dict(bits=8, strategy="tensor", symmetric=True,
                                                               activations=True), {"w8a8"}),
    "fp8_block": ("llama", write_fp8, dict(scales="block"), {None}),
    "fp8_tensor": ("qwen2", write_fp8, dict(scales="tensor"), {None}),
    "fp8_channel": ("mistral", write_fp8, dict(scales="channel"), {None}),
    # DeepSeek-V3's release format: attention, dense MLP, shared and routed experts in FP8 tiles (8 x 8 here:
    # the toy model's 40-wide latent projection), the router in float.
    "fp8_block_deepseek_v3": ("deepseek_v3", write_fp8, dict(scales="block", block=8), {None}),
    # gpt-oss's release format: its experts in MXFP4 (packed by the test from the format's definition).
    "mxfp4_gpt_oss": ("gpt_oss", write_mxfp4, {}, {None}),
}


@pytest.mark.parametrize("case", CASES)
def test_checkpoint_formats_match_their_dequantized_weights(case, quantized):
    path, oracle = quantized(case)
    computes = CASES[case][3]
    fmt = json.loads(open(f"{path}/config.json").read())["quantization_config"]["quant_method"]
    llm = LLM(path, **ENGINE, quantization=fmt if case.endswith("v1") else None)
    assert _computes(llm) == (computes - {None})  # fp8 layers compute dense (no compute attribute)
    _check_parity(llm, oracle, case)
    if case == "gptq4_sym_v1":  # prefix caching on quantized weights: a cached prompt decodes the same
        first, again = (llm.generate(PROMPTS[2:], PARAMS, use_tqdm=False)[0] for _ in range(2))
        assert again.num_cached_tokens >= 32 and again.outputs[0].token_ids == first.outputs[0].token_ids


def _int4_by_definition(w: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The online int4 scheme from its definition, not from the quantizer: per group of `group` inputs, low =
    min(min(w), 0), high = max(max(w), 0), scale = (high - low) / 15, zero = round(-low / scale), q = round(w /
    scale) + zero in 0..15. Returns scale and zero [N, K / group] and the dequantized weight (q - zero) * scale."""
    groups = w.float().view(w.shape[0], -1, group)
    low, high = groups.amin(-1).clamp(max=0), groups.amax(-1).clamp(min=0)
    scale = (high - low) / 15
    assert bool((scale > 0).all()), "a group of zeros: the definition leaves its scale open"
    zero = torch.round(-low / scale)
    q = (torch.round(groups / scale[..., None]) + zero[..., None]).clamp(0, 15)
    return scale, zero, ((q - zero[..., None]) * scale[..., None]).view_as(w)


def _w4a8_by_definition(w: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """W4A8's weights from their definition: per group of `group` inputs, scale = max|w| / 7, q = round(w / scale)
    in [-7, 7]. Returns the scale [N, K / group] and the dequantized weight q * scale."""
    groups = w.float().view(w.shape[0], -1, group)
    scale = groups.abs().amax(-1) / 7
    assert bool((scale > 0).all()), "a group of zeros: the definition leaves its scale open"
    return scale, (torch.round(groups / scale[..., None]).clamp(-7, 7) * scale[..., None]).view_as(w)


def _oracle_online(dense, out, scheme: str):
    """Our online scheme's weights by their definition (int8 and w8a8: quantize_int8, whose scale the tests check;
    int4: _int4_by_definition; w4a8: _w4a8_by_definition) on whole tensors -> dense oracle (the activations of
    w8a8 and w4a8: _check_parity's part)."""
    from safetensors.torch import load_file

    from tests.engine.models.quantized_checkpoints import _is_linear, _write

    oracle = {}
    for name, w in load_file(str(dense / "model.safetensors")).items():
        if _is_linear(name) or (".experts." in name and name.endswith(".weight")):  # routers stay dense
            if scheme in ("int8", "w8a8"):
                w = quantize_int8(w).dequantize()
            elif scheme == "w4a8":
                w = _w4a8_by_definition(w, int4_group_size(w.shape[1]))[1]
            else:
                w = _int4_by_definition(w, int4_group_size(w.shape[1]))[2]
        oracle[name] = w
    return _write(dense, out, oracle, None)


@pytest.mark.parametrize("arch,scheme", [("llama", "int8"), ("qwen2", "int8"), ("qwen3", "int4"), ("qwen2", "w8a8"),
                                         ("llama", "w4a8")])
def test_online_quantization_matches_its_dequantized_weights(arch, scheme, hf_checkpoint, tmp_path):
    dense = hf_checkpoint(arch)
    oracle = str(_oracle_online(dense, tmp_path / "oracle", scheme))
    llm = LLM(str(dense), **ENGINE, quantization=scheme)
    assert _computes(llm) == {scheme}
    model = llm.llm_engine.core.executor.driver_worker.model
    assert model.lm_head.quant_method.__class__.__name__ == "DenseLinearMethod"
    _check_parity(llm, oracle, f"{arch} {scheme}")


@pytest.mark.parametrize("arch,scheme,experts", [("qwen3_moe", "int8", "int8"), ("mixtral", "int4", "int4"),
                                                 ("qwen3_moe", "w8a8", "w8a8")])
def test_online_quantization_of_experts_matches_its_dequantized_weights(arch, scheme, experts, hf_checkpoint, tmp_path):
    """Every expert's projections quantized by the scheme and run through the quantized kernels (Mixtral's down
    projections have 48 inputs: int4 groups of 16)."""
    from engine.models.layers.fused_moe import FusedMoE

    dense = hf_checkpoint(arch)
    oracle = str(_oracle_online(dense, tmp_path / "oracle", scheme))
    llm = LLM(str(dense), **ENGINE, quantization=scheme)
    model = llm.llm_engine.core.executor.driver_worker.model
    assert {m.expert_compute for m in model.modules() if isinstance(m, FusedMoE)} == {experts}
    _check_parity(llm, oracle, f"{arch} {scheme}")


def test_quantized_moe_checkpoints_are_refused_naming_the_layer(hf_checkpoint, tmp_path):
    path, _ = write_gptq(hf_checkpoint("qwen3_moe"), tmp_path / "gptq", bits=4, group_size=32, sym=True, desc_act=False,
                         v1=True)
    with pytest.raises(ValueError, match=r"gptq has no method for MoE experts \(model.layers.0.mlp.experts\)"):
        LLM(str(path), **ENGINE)


def test_online_quantization_error_within_the_scheme_bound(hf_checkpoint):
    """Every decoder projection of the built model, widened back from its kernel form, is within half a
    quantization step of the checkpoint's weight (int8 and w8a8: per row; int4 and w4a8: per group), with the
    scale (and int4's zero point) the scheme defines, computed here from the weight."""
    from safetensors.torch import load_file

    dense = hf_checkpoint("qwen3")
    weights = load_file(str(dense / "model.safetensors"))
    for scheme in ("int8", "int4", "w8a8", "w4a8"):
        llm = LLM(str(dense), **ENGINE, quantization=scheme)
        layer = llm.llm_engine.core.executor.driver_worker.model.model.layers[0]
        for fused, names in (("self_attn.qkv_proj", ["q_proj", "k_proj", "v_proj"]), ("mlp.down_proj", ["down_proj"])):
            module = layer.get_submodule(fused)
            parent = fused.rsplit(".", 1)[0]
            w = torch.cat([weights[f"model.layers.0.{parent}.{n}.weight"] for n in names])
            if scheme in ("int8", "w8a8"):  # w8a8's weights are int8's
                q = (dequantize_int8(module.int8_weight, module.weight_scales) if scheme == "int8" else
                     unpack_w8a8(module.w8a8_weight, *w.shape).float() * module.weight_scales[:, None])
                got, step = q, module.weight_scales[:, None]
                assert torch.equal(step[:, 0], w.abs().amax(1) / 127)
            elif scheme == "w4a8":
                g = module.w4a8_group
                q = unpack_w4a8(module.w4a8_weight, module.out_features).float()
                got = q * from_panels(module.w4a8_scales, module.out_features).repeat_interleave(g, 1)
                scale, _ = _w4a8_by_definition(w, g)
                step = scale.repeat_interleave(g, 1)
            else:
                g = module.group_size
                assert g == int4_group_size(w.shape[1])
                got = dequantize_int4(module.int4_weight, module.int4_params, g, module.out_features)
                scale, zero, _ = _int4_by_definition(w, g)
                scales, offsets = unpack_int4_params(module.int4_params, module.out_features)  # w = q * s + offset
                assert torch.equal(scales, scale) and torch.equal(offsets, -zero * scale), fused
                step = scale.repeat_interleave(g, 1)
            assert bool(((got - w).abs() <= step / 2 + 1e-6).all()), (scheme, fused)


def test_packing_hand_worked_vectors():
    """The reference packers (and our unpackers) on vectors worked out by hand."""
    word = lambda t: t.flatten()[0].item() & 0xFFFFFFFF  # noqa: E731 (the reference packers take 32 rows/columns)
    column = torch.cat([torch.arange(1, 9), torch.zeros(24, dtype=torch.long)]).view(32, 1)  # q[k, n=0] = 1..8, 0...
    assert word(gptq_pack_qweight(column, 4)) == 0x87654321  # value k at bits 4k
    assert (unpack_int32(torch.tensor([[0x87654321 - 2**32]], dtype=torch.int32), 4, 0).flatten().tolist()
            == list(range(1, 9)))
    zeros = torch.full((1, 32), 8)  # symmetric 4-bit: z = 8, stored by v1 as 7
    assert word(gptq_pack_qzeros(zeros - 1, 4)) == 0x77777777
    column8 = torch.cat([torch.tensor([255, 1, 128, 0]), torch.zeros(28, dtype=torch.long)]).view(32, 1)
    assert word(gptq_pack_qweight(column8, 8)) == 0x008001FF
    row = torch.arange(1, 9).view(1, 8)  # q[k=0, n=0..7] = 1..8: nibbles hold columns 0, 2, 4, 6, 1, 3, 5, 7
    assert word(awq_pack(row)) == 0x86427531
    assert unpack_awq(torch.tensor([[0x86427531 - 2**32]], dtype=torch.int32)).flatten().tolist() == list(range(1, 9))


@pytest.mark.parametrize("case", ["gptq4_actorder_v2", "online_int8", "online_int8_experts"])
def test_tensor_parallel_equals_one_rank(case, quantized, hf_checkpoint):
    """TP=2 gives the one-rank engine's tokens and logprobs: act-order GPTQ (g_idx sliced per rank against
    replicated scales; down_proj's groups straddle the ranks, so it is dequantized there) and online int8
    (row maxima all-reduced across the ranks of row-parallel layers and of the experts' down projections)."""
    if case.startswith("online_int8"):
        model, quantization = str(hf_checkpoint("qwen3_moe" if case.endswith("experts") else "qwen2")), "int8"
    else:
        model, quantization = quantized(case)[0], None
    one = LLM(model, **ENGINE, quantization=quantization).generate(PROMPTS, PARAMS, use_tqdm=False)
    llm = LLM(model, **ENGINE, quantization=quantization, tensor_parallel_size=2)
    try:
        two = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    finally:
        llm.shutdown()
    for a, b in zip(one, two):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for token, x, y in zip(a.outputs[0].token_ids, a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert x[token].logprob == pytest.approx(y[token].logprob, abs=1e-4)


def test_tensor_parallel_int8_activations_quantize_each_ranks_slice(hf_checkpoint, tmp_path):
    """W8A8 at TP=2 quantizes the activations each rank holds: a row-parallel rank (o_proj, down_proj) its slice
    of each token, with its own scale, as vLLM does (no collective per layer for one shared scale). The oracle
    rounds those inputs in two slices likewise; column-parallel layers see whole tokens. W4A8 does the same
    where its groups fit the ranks; on this model's 64 inputs (one group of 64) a rank's 32 would split a group,
    which is refused naming the layer."""
    dense = hf_checkpoint("qwen2")
    with pytest.raises(ValueError, match=r"'w4a8' groups model.layers.0.self_attn.o_proj's 64 inputs by 64"):
        LLM(str(dense), **ENGINE, quantization="w4a8", tensor_parallel_size=2)
    scheme = "w8a8"
    oracle = str(_oracle_online(dense, tmp_path / "oracle", scheme))
    llm = LLM(str(dense), **ENGINE, quantization=scheme, tensor_parallel_size=2)
    try:
        outs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    finally:
        llm.shutdown()
    for prompt, out in zip(PROMPTS, outs):
        tokens, logprobs = hf_greedy(oracle, prompt, NEW_TOKENS, quantize_inputs_of=LINEAR, row_parallel_ranks=2)
        tie = assert_tokens_match(out.outputs[0].token_ids, tokens, logprobs, 2 * ROUNDED_LOGPROB_TOL,
                                  f"{scheme} TP=2")
        for i, (token, lp) in enumerate(zip(out.outputs[0].token_ids[:tie], out.outputs[0].logprobs)):
            assert abs(lp[token].logprob - float(logprobs[i][token])) < ROUNDED_LOGPROB_TOL, i


BAD_CONFIGS = [
    ({"quant_method": "bitsandbytes"}, "quant_method='bitsandbytes' is not supported"),
    ({"quant_method": "gptq", "bits": 3}, "bits=3 \\(gptq\\)"),
    ({"quant_method": "gptq", "bits": 4, "checkpoint_format": "marlin"}, "checkpoint_format='marlin'"),
    ({"quant_method": "gptq", "bits": 4, "dynamic": {"-:.*": {}}}, "quantization_config.dynamic"),
    ({"quant_method": "awq", "bits": 4, "version": "gemv"}, "version='gemv'"),
    ({"quant_method": "awq", "bits": 4, "zero_point": False}, "zero_point=false"),
    ({"quant_method": "fp8", "fmt": "e5m2"}, "fmt='e5m2'"),
    ({"quant_method": "fp8", "kv_cache_scheme": {"num_bits": 8}}, "kv_cache_scheme"),
    ({"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {"group_0": {
        "targets": ["Linear"], "weights": {"num_bits": 8, "type": "float", "strategy": "tensor"}}}},
     "format='float-quantized'"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"group_0": {
        "targets": ["Linear"], "weights": {"num_bits": 8, "type": "int", "strategy": "channel"},
        "input_activations": {"num_bits": 8, "type": "int", "dynamic": True}}}},
     "format='pack-quantized' .* with input_activations; int-quantized is"),
    ({"quant_method": "compressed-tensors", "format": "int-quantized", "config_groups": {"group_0": {
        "targets": ["Linear"], "weights": {"num_bits": 8, "type": "int", "strategy": "channel"},
        "input_activations": {"num_bits": 8, "type": "int", "strategy": "tensor", "dynamic": False,
                              "symmetric": True}}}}, "input_activations = .*'dynamic': False.* per token"),
    ({"quant_method": "compressed-tensors", "format": "int-quantized", "config_groups": {"group_0": {
        "targets": ["Linear"], "weights": {"num_bits": 8, "type": "int", "strategy": "channel", "symmetric": False},
        "input_activations": {"num_bits": 8, "type": "int", "strategy": "token", "dynamic": True,
                              "symmetric": True}}}}, "symmetric=False .* W8A8 takes 8-bit symmetric"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"group_0": {
        "targets": ["Linear"], "weights": {"num_bits": 4, "type": "int", "strategy": "tensor"}}}}, "strategy='tensor'"),
]


@pytest.mark.parametrize("raw,message", BAD_CONFIGS)
def test_unsupported_formats_and_options_fail_naming_them(raw, message):
    with pytest.raises(ValueError, match=message):
        resolve_quant_config(None, raw)


def test_engine_quantization_is_checked_against_the_checkpoint(hf_checkpoint, quantized):
    dense = str(hf_checkpoint("llama"))
    with pytest.raises(ValueError, match="quantization: 'gptq' was asked for, but the checkpoint is not quantized"):
        LLM(dense, quantization="gptq")
    gptq = quantized("gptq4_sym_v1")[0]
    with pytest.raises(ValueError, match="quantization: 'awq' was asked for, but the checkpoint is in 'gptq'"):
        LLM(gptq, quantization="awq")
    with pytest.raises(ValueError, match="quantization: 'int8' quantizes a dense checkpoint"):
        LLM(gptq, quantization="int8")
    with pytest.raises(ValueError, match="load_format: 'dummy'"):
        LLM(gptq, load_format="dummy")
    with pytest.raises(ValueError, match="quantization"):
        LLM(dense, quantization="nf4")
