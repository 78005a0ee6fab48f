"""Weight-only int8 and int4 linear layers on the CPU: the compute of quantized linear methods.

Every batch goes through quant_linear.cpp (weights widened to float32 in registers or in an L1 buffer,
products and sums in float32): from 64 rows up it beat widening the whole weight and running torch's float32
matmul by 1.6-8x, and oneDNN's prepacked float32 matmul by up to 1.2x (2-core AVX2 machine, 64-2048 rows).
Layouts are the ones quant_linear.cpp documents; `pack_int8` / `pack_int4` convert to them, `unpack_*` back."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.cpu import load_quant_kernels

# Rows of x per kernel call: every 16 output rows re-read a chunk of all the call's rows of x, which at 512
# rows (512 KiB) still comes from L2 (2,048 rows in one call: 0.75x the speed).
ROW_BLOCK = 512
PANEL = 16  # output rows per panel of the weight layouts


def quant_kernels_available() -> bool:
    return load_quant_kernels() is not None


def pack_int8(q: torch.Tensor) -> torch.Tensor:
    """q int8 [N, K] -> int8 [ceil(N / 16), K, 16] in quant_linear.cpp's layout (panels of 16 rows)."""
    return _panels(q.to(torch.int8)).contiguous()


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """q [N, K] with values 0..15 -> uint8 [ceil(N / 16), K, 8] in quant_linear.cpp's layout."""
    panels = _panels(q.to(torch.uint8))  # [P, K, 16]
    return (panels[..., :PANEL // 2] | (panels[..., PANEL // 2:] << 4)).contiguous()


def unpack_int8(packed: torch.Tensor, n: int) -> torch.Tensor:
    """The inverse of pack_int8: int8 [N, K]."""
    return _rows(packed, n)


def unpack_int4(packed: torch.Tensor, n: int) -> torch.Tensor:
    """The inverse of pack_int4: uint8 [N, K] with values 0..15."""
    return _rows(torch.cat([packed & 0x0F, packed >> 4], dim=-1), n)


def _panels(q: torch.Tensor) -> torch.Tensor:
    n, k = q.shape
    padded = F.pad(q, (0, 0, 0, -n % PANEL))
    return padded.view(-1, PANEL, k).transpose(1, 2)


def _rows(panels: torch.Tensor, n: int) -> torch.Tensor:
    return panels.transpose(1, 2).reshape(-1, panels.shape[1])[:n]


def dequantize_int8(weight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """float32 [N, K] from pack_int8's layout and scales [N]."""
    return unpack_int8(weight, scales.numel()).float() * scales[:, None]


def dequantize_int4(packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group: int) -> torch.Tensor:
    """float32 [N, K] from pack_int4's layout and scales, zeros [N, K / group]."""
    q = unpack_int4(packed, scales.shape[0]).float()
    n, k = q.shape
    return (q.view(n, k // group, group) * scales[..., None] + zeros[..., None]).view(n, k)


def int8_linear(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [M, K] @ (scales[:, None] * weight).T + bias; weight int8 [N, K], scales float32 [N]."""
    return _run(load_quant_kernels().int8_linear, x, scales.numel(), bias, weight, scales)


def int4_linear(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group: int,
                bias: torch.Tensor | None) -> torch.Tensor:
    """x [M, K] @ W.T + bias with W[n, k] = q[n, k] * scales[n, k // group] + zeros[n, k // group]."""
    return _run(load_quant_kernels().int4_linear, x, scales.shape[0], bias, packed, scales, zeros, group)


def _run(kernel, x: torch.Tensor, n: int, bias: torch.Tensor | None, *weight) -> torch.Tensor:
    x32 = x.float().contiguous()
    out = torch.empty(x.shape[0], n)
    for start in range(0, x.shape[0], ROW_BLOCK):
        kernel(out[start:start + ROW_BLOCK], x32[start:start + ROW_BLOCK], *weight)
    out = out.to(x.dtype)
    return out.add_(bias) if bias is not None else out
