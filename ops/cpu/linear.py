"""The dense linear method's CPU path, and the 16-row weight panels that panel_linear.cpp computes with.

float32 weights are repacked once into panels (`to_panels`) and multiplied by panel_linear.cpp: on our
2-core AVX2 machines it ran 1.1-1.4x oneDNN's prepacked matmul from 1 to 64 rows of x (decode batches) and
1.2x at prefill sizes. bfloat16 weights go into panels of column pairs (`to_unit_panels`) where the CPU has
AVX512_BF16 but not AMX (vdpbf16ps; benchmarks/quantized.py measures it beside oneDNN's bfloat16), and where
oneDNN cannot pack bfloat16 at all (AVX2 without AVX_NE_CONVERT: the panels widened to float32 in registers), else
are prepacked for oneDNN, as is float32 where no compiler built the kernels. Same math, same dtype: only the
summation order differs (bfloat16 products are exact in float32, and the sums are float32 in every path)."""

from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F

from ops.cpu import cpu_flags, linear_kernels_available, load_linear_kernels

logger = logging.getLogger(__name__)

PANEL = 16  # output rows per panel
# Rows of x per kernel call: every panel re-reads a chunk of all the call's rows of x, which at 512 rows
# (512 KiB) still comes from L2 (2,048 rows in one call: 0.75x the speed).
ROW_BLOCK = 512


def to_panels(w: torch.Tensor) -> torch.Tensor:
    """[N, K] -> [ceil(N / 16), K, 16]: rows in panels of 16 (the last padded with zeros), each column-major."""
    n, k = w.shape
    return F.pad(w, (0, 0, 0, -n % PANEL)).view(-1, PANEL, k).transpose(1, 2).contiguous()


def to_unit_panels(w: torch.Tensor, per_unit: int) -> torch.Tensor:
    """[N, K] -> [ceil(N / 16), ceil(K / per_unit), 16, per_unit]: panels of 16 rows whose units hold each row's
    `per_unit` consecutive columns (K padded with zero columns): bfloat16 pairs, int8 quads."""
    n, k = w.shape
    w = F.pad(w, (0, -k % per_unit, 0, -n % PANEL))
    return w.view(-1, PANEL, w.shape[1] // per_unit, per_unit).transpose(1, 2).contiguous()


def from_unit_panels(panels: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """The inverse of to_unit_panels: [N, K]."""
    p, units, _, per_unit = panels.shape
    return panels.transpose(1, 2).reshape(p * PANEL, units * per_unit)[:n, :k]


def from_panels(panels: torch.Tensor, n: int) -> torch.Tensor:
    """The inverse of to_panels: [N, K]."""
    return panels.transpose(1, 2).reshape(-1, panels.shape[1])[:n]


def panel_matmul(kernel: str, x: torch.Tensor, n: int, bias: torch.Tensor | None, *weight,
                 x_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """x [..., K] times a panel weight through panel_linear.cpp's `kernel` (its weight arguments `weight`),
    n output features: x in `x_dtype` inside, float32 sums (plus bias) rounded once to x's dtype, which the
    kernel writes itself (float32 or bfloat16). A decode step calls this for every layer: it does no more
    in Python than it must (about 5 us a call; the kernel of a small layer takes 3)."""
    x2 = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])  # a decode step's x is 2-D: no op to dispatch
    if x2.dtype != x_dtype:  # each no-op .to() / .contiguous() would still cost a microsecond or two
        x2 = x2.to(x_dtype)
    if not x2.is_contiguous():
        x2 = x2.contiguous()
    rows = x2.shape[0]
    direct = x.dtype in (torch.float32, torch.bfloat16)
    out = torch.empty(rows, n, dtype=x.dtype if direct else torch.float32)
    if bias is not None and bias.dtype != torch.float32:
        bias = bias.float()
    run = getattr(load_linear_kernels(), kernel)
    if rows <= ROW_BLOCK:
        run(out, x2, *weight, bias)
    else:
        for start in range(0, rows, ROW_BLOCK):
            run(out[start:start + ROW_BLOCK], x2[start:start + ROW_BLOCK], *weight, bias)
    out = out if direct else out.to(x.dtype)
    return out if x.dim() == 2 else out.view(*x.shape[:-1], n)


def bfloat16_linear(x: torch.Tensor, panels: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., K] times bfloat16 [P, K / 2, 16, 2] panels (to_unit_panels(w, 2)), x in bfloat16: vdpbf16ps."""
    return panel_matmul("bfloat16_linear", x, panels.shape[0] * PANEL, bias, panels, x_dtype=torch.bfloat16)


@functools.cache
def instruction_sets() -> dict[str, bool]:
    """The dot-product instructions the linear kernels were built with (avx512_bf16, avx512_vnni); all False
    where nothing compiled."""
    kernels = load_linear_kernels()
    return dict(kernels.instruction_sets()) if kernels else {"avx512_bf16": False, "avx512_vnni": False}


@functools.cache
def bfloat16_panels_preferred() -> bool:
    """Whether bfloat16 weights go to our panels rather than to oneDNN: where the CPU has AVX512_BF16 but not AMX
    (vdpbf16ps). With AMX tiles (Sapphire Rapids and later) oneDNN's bfloat16 matmul ran 2.4x / 5.8x / 10x our
    panels at 16 / 64 / 256 rows of a 2048 x 1536 layer (0.82x at 1 row; benchmarks/quantized.py's rates). And
    where oneDNN cannot pack bfloat16 (its bfloat16 matmul needs AVX512BW or AVX_NE_CONVERT): the panels widened
    to float32 in registers read half of float32's bytes, where torch's plain bfloat16 matmul on an AVX2 host ran
    0.2x float32 at 16 rows and 0.8-1.2x at 1 (benchmarks/results/quantized.md run 16)."""
    if not linear_kernels_available():
        return False
    if instruction_sets()["avx512_bf16"]:
        return "amx_bf16" not in cpu_flags()
    return not onednn_packs(torch.bfloat16)


def pack_weight(weight: torch.Tensor, batch_size_hint: int) -> torch.Tensor | None:
    """`weight` [out, in] packed once for `packed_linear`: float32 panels or bfloat16 pair panels (when `out`
    fills them: the panels then say the output size), or oneDNN's blocked layout for batches of about
    `batch_size_hint` rows; None where neither takes it (the caller keeps the plain weight)."""
    out_features, in_features = weight.shape
    with torch.no_grad():
        if out_features % PANEL == 0 and linear_kernels_available():
            if weight.dtype == torch.float32:
                return to_panels(weight.detach())
            if weight.dtype == torch.bfloat16 and in_features % 2 == 0 and bfloat16_panels_preferred():
                return to_unit_panels(weight.detach(), 2)
        if not onednn_packs(weight.dtype):
            return None
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), batch_size_hint)


# oneDNN builds (JIT-compiles) a matmul primitive per input shape and keeps it in its primitive cache (up to
# ONEDNN_PRIMITIVE_CACHE_CAPACITY = 1024 by default, ~0.25 MiB each). A serving engine's batches have every
# row count from 1 to max_num_batched_tokens, so that cache filled over tens of thousands of requests: the
# engine process's memory grew for as long (benchmarks/soak.py: +300 MiB live, still rising after 4,000
# requests), and every new row count paid a primitive build (milliseconds). Rows are padded to a bucket:
# exact up to EXACT_ROWS (decode batches), then 8 buckets per power of two (at most 12.5% padded rows), so
# a weight sees ~100 shapes, not thousands.
EXACT_ROWS = 64


def bucket_rows(num_rows: int) -> int:
    """The row count `num_rows` is padded to: itself up to EXACT_ROWS, then the next multiple of 1/8 of
    its power of two (65 -> 72, 129 -> 144, 1000 -> 1024)."""
    if num_rows <= EXACT_ROWS:
        return num_rows
    step = 1 << (num_rows.bit_length() - 4)
    return -(-num_rows // step) * step


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    if packed.dim() == 3:  # float32 panels
        return panel_matmul("float32_linear", x, packed.shape[0] * PANEL, bias, packed)
    if packed.dim() == 4:  # bfloat16 pair panels
        return bfloat16_linear(x, packed, bias)
    rows = x.shape[0] if x.dim() == 2 else 0
    padded = bucket_rows(rows)
    if padded == rows:  # bucketed already, or not a 2-D batch of rows
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    x = F.pad(x, (0, 0, 0, padded - rows))
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")[:rows]


@functools.cache
def onednn_packs(dtype: torch.dtype) -> bool:
    """Whether oneDNN packs weights of `dtype` on this CPU (and this torch build) and computes with them correctly."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        weight, x = torch.randn(4, 8, dtype=dtype), torch.randn(3, 8, dtype=dtype)
        with torch.no_grad():
            packed = torch.ops.mkldnn._reorder_linear_weight(weight, 3)  # not pack_weight: it asks this
            return torch.allclose(packed_linear(x, packed, None).float(), F.linear(x, weight).float(), atol=0.05)
    except (RuntimeError, AttributeError) as e:  # a torch built without oneDNN, a CPU it lacks, a changed private op
        logger.warning("oneDNN cannot pack %s linear weights here (%s); those go to our panels or plain matmuls",
                       dtype, e)
        return False
