"""Quantized checkpoints written independently of the engine's loader, each with its oracle: a dense
Hugging Face checkpoint holding the weights the quantized one stands for.

- GPTQ and AWQ: round-to-nearest quantization, packed by transcriptions of the reference packers
  (AutoGPTQ's QuantLinear.pack, v1's stored zero - 1; AutoAWQ's WQLinear_GEMM.from_linear with its
  [0, 2, 4, 6, 1, 3, 5, 7] order); the oracle is built from the integers before packing, so no unpacker is
  shared with the engine (the hand-worked vectors in test_quantization.py pin the packers down).
- compressed-tensors: the `compressed-tensors` package quantizes, packs, writes the config, and
  decompresses the oracle.
- FP8: e4m3 weights with block, per-tensor or per-row scales; the oracle is fp8 * scale."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
          "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj")  # the last: DeepSeek's latent attention
AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]


def _is_linear(name: str) -> bool:
    return ".layers." in name and name.endswith(".weight") and name.split(".")[-2] in LINEAR


def _write(dense: Path, out: Path, tensors: dict[str, torch.Tensor], quantization_config: dict | None) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    for f in dense.iterdir():
        if f.is_file() and not f.name.endswith(".safetensors") and f.name != "config.json":
            shutil.copy(f, out / f.name)
    config = json.loads((dense / "config.json").read_text())
    if quantization_config is not None:
        config["quantization_config"] = quantization_config
    (out / "config.json").write_text(json.dumps(config, indent=2))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"),
              metadata={"format": "pt"})
    return out


def _rtn(w: torch.Tensor, bits: int, g_idx: torch.Tensor, groups: int, sym: bool):
    """Round-to-nearest per (group, row), GPTQ's quantizer: w [N, K] -> q [N, K], scales fp16 [G, N], z [G, N]."""
    maxq = 2**bits - 1
    n = w.shape[0]
    scales, zeros = torch.empty(groups, n), torch.empty(groups, n, dtype=torch.int64)
    for g in range(groups):
        cols = w[:, g_idx == g]
        lo, hi = cols.amin(1).clamp(max=0), cols.amax(1).clamp(min=0)
        if sym:
            hi = torch.maximum(lo.abs(), hi)
            lo = -hi
        scale = ((hi - lo) / maxq).clamp(min=1e-6).half().float()  # stored fp16: quantize with what is stored
        scales[g] = scale
        zeros[g] = torch.full_like(lo, (maxq + 1) // 2, dtype=torch.int64) if sym else torch.round(-lo / scale).long()
    q = torch.clamp(torch.round(w / scales[g_idx].T) + zeros[g_idx].T, 0, maxq).long()
    return q, scales.half(), zeros


def gptq_pack_qweight(intweight: torch.Tensor, bits: int) -> torch.Tensor:
    """AutoGPTQ's pack of intweight [K, N] along K (value j of a word at bits * j)."""
    iw = intweight.numpy().astype(np.uint32)
    qweight = np.zeros((iw.shape[0] // 32 * bits, iw.shape[1]), dtype=np.uint32)
    i = row = 0
    while row < qweight.shape[0]:
        for j in range(i, i + (32 // bits)):
            qweight[row] |= iw[j] << (bits * (j - i))
        i += 32 // bits
        row += 1
    return torch.from_numpy(qweight.view(np.int32))


def gptq_pack_qzeros(zeros: torch.Tensor, bits: int) -> torch.Tensor:
    """AutoGPTQ's pack of zeros [G, N] along N."""
    z = zeros.numpy().astype(np.uint32)
    qzeros = np.zeros((z.shape[0], z.shape[1] // 32 * bits), dtype=np.uint32)
    i = col = 0
    while col < qzeros.shape[1]:
        for j in range(i, i + (32 // bits)):
            qzeros[:, col] |= z[:, j] << (bits * (j - i))
        i += 32 // bits
        col += 1
    return torch.from_numpy(qzeros.view(np.int32))


def awq_pack(intweight: torch.Tensor) -> torch.Tensor:
    """AutoAWQ's GEMM pack of intweight [R, C] (qweight: [K, N]; qzeros: [G, N]) along C, interleaved."""
    iw = intweight.to(torch.int32)
    packed = torch.zeros((iw.shape[0], iw.shape[1] // 8), dtype=torch.int32)
    for col in range(iw.shape[1] // 8):
        for i in range(8):
            packed[:, col] |= iw[:, col * 8 + AWQ_ORDER[i]] << (i * 4)
    return packed


def write_gptq(dense: Path, out: Path, bits: int, group_size: int, sym: bool, desc_act: bool, v1: bool,
               seed: int = 0) -> tuple[Path, Path]:
    """A GPTQ checkpoint of `dense` at `out`, and its oracle at `out`-dense."""
    gen = torch.Generator().manual_seed(seed)
    tensors, oracle = {}, {}
    perms: dict[str, torch.Tensor] = {}  # act-order: one column order per input (q, k, v share theirs)
    for name, w in load_file(str(dense / "model.safetensors")).items():
        if not _is_linear(name):
            tensors[name] = oracle[name] = w
            continue
        prefix = name.removesuffix(".weight")
        n, k = w.shape
        gs = group_size if group_size > 0 else k
        groups = -(-k // gs)
        if desc_act:
            key = prefix.rsplit(".", 1)[0] + ("." + prefix.rsplit(".", 1)[1]
                                              if prefix.endswith(("o_proj", "down_proj")) else "")
            perm = perms.setdefault(key, torch.randperm(k, generator=gen))
            g_idx = torch.empty(k, dtype=torch.int64)
            g_idx[perm] = torch.arange(k) // gs
        else:
            g_idx = torch.arange(k) // gs
        q, scales, zeros = _rtn(w.float(), bits, g_idx, groups, sym)
        tensors[prefix + ".qweight"] = gptq_pack_qweight(q.T.contiguous(), bits)
        tensors[prefix + ".qzeros"] = gptq_pack_qzeros(zeros - 1 if v1 else zeros, bits)
        tensors[prefix + ".scales"] = scales
        tensors[prefix + ".g_idx"] = g_idx.to(torch.int32)
        oracle[name] = (scales.float()[g_idx].T * (q - zeros[g_idx].T)).float()
    config = {"quant_method": "gptq", "bits": bits, "group_size": group_size, "desc_act": desc_act, "sym": sym,
              "checkpoint_format": "gptq" if v1 else "gptq_v2", "damp_percent": 0.01, "true_sequential": True}
    return _write(dense, out, tensors, config), _write(dense, out.with_name(out.name + "-dense"), oracle, None)


def write_awq(dense: Path, out: Path, group_size: int) -> tuple[Path, Path]:
    tensors, oracle = {}, {}
    for name, w in load_file(str(dense / "model.safetensors")).items():
        if not _is_linear(name):
            tensors[name] = oracle[name] = w
            continue
        prefix = name.removesuffix(".weight")
        k = w.shape[1]
        g_idx = torch.arange(k) // group_size
        q, scales, zeros = _rtn(w.float(), 4, g_idx, k // group_size, sym=False)
        tensors[prefix + ".qweight"] = awq_pack(q.T.contiguous())
        tensors[prefix + ".qzeros"] = awq_pack(zeros)
        tensors[prefix + ".scales"] = scales
        oracle[name] = (scales.float()[g_idx].T * (q - zeros[g_idx].T)).float()
    config = {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True, "version": "gemm",
              "modules_to_not_convert": None}
    return _write(dense, out, tensors, config), _write(dense, out.with_name(out.name + "-dense"), oracle, None)


def write_fp8(dense: Path, out: Path, scales: str, block: int = 32) -> tuple[Path, Path]:
    """`scales`: block ([block, block] tiles, weight_scale_inv), tensor (one per tensor) or channel (per row)."""
    tensors, oracle = {}, {}
    for name, w in load_file(str(dense / "model.safetensors")).items():
        if not _is_linear(name):
            tensors[name] = oracle[name] = w
            continue
        prefix = name.removesuffix(".weight")
        n, k = w.shape
        if scales == "block":
            tiles = w.float().abs().reshape(n // block, block, k // block, block).amax((1, 3))
            scale = tiles / 448
            full = scale.repeat_interleave(block, 0).repeat_interleave(block, 1)
            tensors[prefix + ".weight_scale_inv"] = scale
        else:
            scale = w.float().abs().amax() / 448 if scales == "tensor" else w.float().abs().amax(1, keepdim=True) / 448
            full = scale
            tensors[prefix + ".weight_scale"] = scale.reshape(1) if scales == "tensor" else scale
        fp8 = (w.float() / full).to(torch.float8_e4m3fn)
        tensors[name] = fp8
        oracle[name] = fp8.float() * full
    config = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic"}
    if scales == "block":
        config["weight_block_size"] = [block, block]
    return _write(dense, out, tensors, config), _write(dense, out.with_name(out.name + "-dense"), oracle, None)


def write_compressed_tensors(dense: Path, out: Path, bits: int, strategy: str, symmetric: bool,
                             group_size: int | None = None, activations: bool = False) -> tuple[Path, Path]:
    """llm-compressor's path through the compressed-tensors package: schemes applied to an HF model,
    min-max scales (the package's calculate_qparams), compressed, saved; the oracle decompressed by it.
    `activations`: W8A8, int8 activations per token, dynamic (the package then writes the int-quantized
    format; the oracle holds the weights, and rounding the activations is the parity test's part)."""
    from benchmarks.checkpoints import write_compressed_tensors as write

    model, compressor = write(dense, out, bits, strategy, symmetric, group_size, activations)
    compressor.decompress_model(model)
    oracle = load_file(str(dense / "model.safetensors"))
    for name in oracle:
        if _is_linear(name):
            oracle[name] = model.get_submodule(name.removesuffix(".weight")).weight.detach().float().clone()
    return out, _write(dense, out.with_name(out.name + "-dense"), oracle, None)


E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])  # FP4's magnitudes by their 3-bit code


def _mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """MXFP4 from the OCP microscaling definition, on w [..., K]: per block of 32 values the smallest power-of-
    two scale 2^e that brings the block's largest magnitude within e2m1's 6 (e8m0: e + 127), each value rounded
    to the nearest e2m1 (sign bit 3), two codes a byte, the even index in the low nibble. Returns (blocks
    uint8 [..., K / 32, 16], scales uint8 [..., K / 32], the dequantized values)."""
    g = w.float().reshape(*w.shape[:-1], -1, 32)
    e = torch.ceil(torch.log2(g.abs().amax(-1) / 6)).clamp(-127, 127).nan_to_num(-127)
    x = g / torch.exp2(e)[..., None]
    magnitude = (x.abs()[..., None] - E2M1).abs().argmin(-1)
    code = magnitude | ((x < 0).to(torch.int64) << 3)
    dequantized = E2M1[magnitude] * torch.where(x < 0, -1.0, 1.0) * torch.exp2(e)[..., None]
    blocks = (code[..., 0::2] | (code[..., 1::2] << 4)).to(torch.uint8)
    return blocks, (e + 127).to(torch.uint8), dequantized.reshape(w.shape)


def write_mxfp4(dense: Path, out: Path) -> tuple[Path, Path]:
    """gpt-oss's release format: each layer's experts (gate_up_proj [E, H, 2I], down_proj [E, I, H]) as MXFP4
    blocks and scales over their inputs ([E, out, in / 32, ...]); everything else as it was."""
    tensors, oracle = {}, {}
    for name, w in load_file(str(dense / "model.safetensors")).items():
        if not name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            tensors[name] = oracle[name] = w
            continue
        blocks, scales, dequantized = _mxfp4(w.transpose(1, 2))  # quantized along the inputs
        tensors[name + "_blocks"], tensors[name + "_scales"] = blocks, scales
        oracle[name] = dequantized.transpose(1, 2).contiguous()
    config = {"quant_method": "mxfp4",
              "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens",
                                         "lm_head"]}
    return _write(dense, out, tensors, config), _write(dense, out.with_name(out.name + "-dense"), oracle, None)
