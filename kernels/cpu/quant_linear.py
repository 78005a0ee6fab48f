"""Weight-only int8 and int4 linear layers on the CPU: the compute of quantized linear methods.

Decode batches go through quant_linear.cpp (weights widened to float32 in registers, products and sums in
float32). Larger batches (prefill chunks) are compute-bound: there the weight is widened once per call
and the product goes through torch's float32 matmul, whose blocking beats our microkernel at that size.
Layouts are the ones quant_linear.cpp documents; `pack_int4` / `unpack_int4` convert to and from it."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.cpu import load_quant_kernels

# Rows of x above which a call widens the whole weight and runs a float32 matmul instead (measured on
# 2-core AVX2 machines: the microkernel wins up to batches of a few dozen rows).
KERNEL_MAX_ROWS = 64
INT4_BLOCK = 32  # columns per 16-byte run of the int4 layout; int4 groups are multiples of it


def quant_kernels_available() -> bool:
    return load_quant_kernels() is not None


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """q [N, K] with values 0..15 (K % 32 == 0) -> uint8 [N, K / 2] in quant_linear.cpp's layout."""
    n, k = q.shape
    runs = q.to(torch.uint8).reshape(n, k // INT4_BLOCK, 2, INT4_BLOCK // 2)
    return (runs[:, :, 0] | (runs[:, :, 1] << 4)).reshape(n, k // 2).contiguous()


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of pack_int4: uint8 [N, K / 2] -> uint8 [N, K] with values 0..15."""
    n, half = packed.shape
    runs = packed.reshape(n, half // (INT4_BLOCK // 2), 1, INT4_BLOCK // 2)
    return torch.cat([runs & 0x0F, runs >> 4], dim=2).reshape(n, 2 * half)


def dequantize_int8(weight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return weight.float() * scales[:, None]


def dequantize_int4(packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group: int) -> torch.Tensor:
    q = unpack_int4(packed).float()
    n, k = q.shape
    return (q.view(n, k // group, group) * scales[..., None] + zeros[..., None]).view(n, k)


def int8_linear(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [M, K] @ (scales[:, None] * weight).T + bias; weight int8 [N, K], scales float32 [N]."""
    if x.shape[0] > KERNEL_MAX_ROWS:
        return F.linear(x, dequantize_int8(weight, scales).to(x.dtype), bias)
    out = torch.empty(x.shape[0], weight.shape[0])
    load_quant_kernels().int8_linear(out, x.float().contiguous(), weight, scales)
    return _finish(out, x.dtype, bias)


def int4_linear(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group: int,
                bias: torch.Tensor | None) -> torch.Tensor:
    """x [M, K] @ W.T + bias with W[n, k] = q[n, k] * scales[n, k // group] + zeros[n, k // group]."""
    if x.shape[0] > KERNEL_MAX_ROWS:
        return F.linear(x, dequantize_int4(packed, scales, zeros, group).to(x.dtype), bias)
    out = torch.empty(x.shape[0], packed.shape[0])
    load_quant_kernels().int4_linear(out, x.float().contiguous(), packed, scales, zeros, group)
    return _finish(out, x.dtype, bias)


def _finish(out: torch.Tensor, dtype: torch.dtype, bias: torch.Tensor | None) -> torch.Tensor:
    out = out.to(dtype)
    return out.add_(bias) if bias is not None else out
