"""Weight-only int8 and int4 linear layers on the CPU: the compute of quantized linear methods.

Every batch goes through panel_linear.cpp (weights widened to float32 in registers or in an L1 buffer,
products and sums in float32): from 64 rows up it beat widening the whole weight and running torch's float32
matmul by 1.6-8x (2-core AVX2 machine, 64-2048 rows). Layouts are the ones panel_linear.cpp documents;
`pack_int8` / `pack_int4` convert to them, `unpack_*` back."""

from __future__ import annotations

import torch

from kernels.cpu.linear import PANEL, from_panels, panel_matmul, to_panels


def pack_int8(q: torch.Tensor) -> torch.Tensor:
    """q int8 [N, K] -> int8 [ceil(N / 16), K, 16] in panel_linear.cpp's layout (panels of 16 rows)."""
    return to_panels(q.to(torch.int8))


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """q [N, K] with values 0..15 -> uint8 [ceil(N / 16), K, 8] in panel_linear.cpp's layout."""
    panels = to_panels(q.to(torch.uint8))  # [P, K, 16]
    return (panels[..., :PANEL // 2] | (panels[..., PANEL // 2:] << 4)).contiguous()


def unpack_int8(packed: torch.Tensor, n: int) -> torch.Tensor:
    """The inverse of pack_int8: int8 [N, K]."""
    return from_panels(packed, n)


def unpack_int4(packed: torch.Tensor, n: int) -> torch.Tensor:
    """The inverse of pack_int4: uint8 [N, K] with values 0..15."""
    return from_panels(torch.cat([packed & 0x0F, packed >> 4], dim=-1), n)


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
    return panel_matmul("int8_linear", x, scales.numel(), bias, weight, scales)


def int4_linear(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group: int,
                bias: torch.Tensor | None) -> torch.Tensor:
    """x [M, K] @ W.T + bias with W[n, k] = q[n, k] * scales[n, k // group] + zeros[n, k // group]."""
    return panel_matmul("int4_linear", x, scales.shape[0], bias, packed, scales, zeros, group)
