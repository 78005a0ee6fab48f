"""Quantized linear layers on the CPU: the compute of quantized linear methods. Weight-only int8 and int4, and
W8A8 (int8 weights times int8 activations quantized per row on entry, integer dot products).

Every batch goes through panel_linear.cpp (weights widened to float32 in registers or in an L1 buffer,
products and sums in float32): from 64 rows up it beat widening the whole weight and running torch's float32
matmul by 1.6-8x (2-core AVX2 machine, 64-2048 rows). Layouts are the ones panel_linear.cpp documents;
`pack_int8` / `pack_int4` convert to them, `unpack_*` back."""

from __future__ import annotations

import torch

from ops.cpu.linear import PANEL, from_panels, from_unit_panels, panel_matmul, to_panels, to_unit_panels


def pack_int8(q: torch.Tensor) -> torch.Tensor:
    """q int8 [N, K] -> int8 [ceil(N / 16), K, 16] in panel_linear.cpp's layout (panels of 16 rows)."""
    return to_panels(q.to(torch.int8))


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """q [N, K] with values 0..15, K even -> uint8 [ceil(N / 16), K / 2, 16] in panel_linear.cpp's layout
    (columns 2i and 2i + 1 of a panel's row in the low and high nibble of one byte)."""
    if q.shape[1] % 2:
        raise ValueError(f"pack_int4: {q.shape[1]} input columns; int4 panels pair columns, so the count must be even")
    panels = to_panels(q.to(torch.uint8))  # [P, K, 16]
    return (panels[:, 0::2] | (panels[:, 1::2] << 4)).contiguous()


def pack_int4_params(scales: torch.Tensor, zeros: torch.Tensor) -> torch.Tensor:
    """scales, zeros float32 [N, G] -> [ceil(N / 16), G, 32]: per panel and group, the 16 rows' scales then their
    zeros (panel_linear.cpp reads them as they are, with no gathering per call)."""
    return torch.cat([to_panels(scales.float()), to_panels(zeros.float())], dim=-1)


def unpack_int4_params(params: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of pack_int4_params: scales, zeros [N, G]."""
    return from_panels(params[..., :PANEL], n), from_panels(params[..., PANEL:], n)


def unpack_int8(packed: torch.Tensor, n: int) -> torch.Tensor:
    """The inverse of pack_int8: int8 [N, K]."""
    return from_panels(packed, n)


def unpack_int4(packed: torch.Tensor, n: int) -> torch.Tensor:
    """The inverse of pack_int4: uint8 [N, K] with values 0..15."""
    p, pairs, width = packed.shape
    return from_panels(torch.stack([packed & 0x0F, packed >> 4], dim=2).view(p, 2 * pairs, width), n)


def dequantize_int8(weight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """float32 [N, K] from pack_int8's layout and scales [N]."""
    return unpack_int8(weight, scales.numel()).float() * scales[:, None]


def dequantize_int4(packed: torch.Tensor, params: torch.Tensor, group: int, n: int) -> torch.Tensor:
    """float32 [N, K] from pack_int4's and pack_int4_params' layouts."""
    scales, zeros = unpack_int4_params(params, n)
    q = unpack_int4(packed, n).float()
    n, k = q.shape
    return (q.view(n, k // group, group) * scales[..., None] + zeros[..., None]).view(n, k)


def int8_linear(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [M, K] @ (scales[:, None] * q).T + bias; weight: q int8 [N, K] packed by pack_int8, scales float32 [N]."""
    return panel_matmul("int8_linear", x, scales.numel(), bias, weight, scales)


def int4_linear(x: torch.Tensor, packed: torch.Tensor, params: torch.Tensor, group: int, n: int,
                bias: torch.Tensor | None) -> torch.Tensor:
    """x [M, K] @ W.T + bias with W[n, k] = q[n, k] * scales[n, k // group] + zeros[n, k // group], n output
    features; packed and params from pack_int4 and pack_int4_params."""
    return panel_matmul("int4_linear", x, n, bias, packed, params, group)


def pack_w8a8(q: torch.Tensor) -> torch.Tensor:
    """q [N, K] with values in [-128, 127] -> uint8 [ceil(N / 16), ceil(K / 4), 16, 4]: q + 128 in
    panel_linear.cpp's W8A8 layout."""
    return to_unit_panels((q.to(torch.int16) + 128).to(torch.uint8), 4)


def unpack_w8a8(packed: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """The inverse of pack_w8a8: int8 [N, K]."""
    return (from_unit_panels(packed, n, k).to(torch.int16) - 128).to(torch.int8)


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The W8A8 kernel's quantization of x [M, K] (float32), as an oracle: symmetric per row, scale = max|x| / 127
    (1 for a zero row), q = round(x / scale) half to even, |q| <= 127. Returns (q int8, scales [M])."""
    absmax = x.abs().amax(dim=-1)
    scales = torch.where(absmax > 0, absmax / 127, torch.ones_like(absmax))
    return torch.round(x / scales[:, None]).clamp(-127, 127).to(torch.int8), scales


def w8a8_linear(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [M, K] @ (scales[:, None] * q).T + bias with x quantized per row (quantize_activations) inside: float32
    scales [N], packed by pack_w8a8."""
    return panel_matmul("w8a8_linear", x, scales.numel(), bias, packed, scales)


def pack_w4a8(q: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q [N, K] with values in [-8, 7] (K a multiple of 8), scales float32 [N, K / group] -> (uint8 [ceil(N / 16),
    K / 8, 16, 4]: q + 8 as nibbles in panel_linear.cpp's W4A8 layout, float32 [ceil(N / 16), K / group, 16])."""
    if q.shape[1] % 8:
        raise ValueError(f"pack_w4a8: {q.shape[1]} input columns; W4A8 panels take them 8 at a time")
    units = to_unit_panels((q + 8).to(torch.uint8), 4)  # [P, K / 4, 16, 4]
    return (units[:, 0::2] | (units[:, 1::2] << 4)).contiguous(), to_panels(scales.float())


def unpack_w4a8(packed: torch.Tensor, n: int) -> torch.Tensor:
    """The inverse of pack_w4a8's nibbles: int8 [N, K] in [-8, 7]."""
    p, pairs, width, per_unit = packed.shape
    units = torch.stack([packed & 0x0F, packed >> 4], dim=2).view(p, 2 * pairs, width, per_unit)
    return (from_unit_panels(units, n, 8 * pairs).to(torch.int16) - 8).to(torch.int8)


def w4a8_linear(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, group: int, n: int,
                bias: torch.Tensor | None) -> torch.Tensor:
    """x [M, K] @ W.T + bias with W[n, k] = q[n, k] * scales[n, k // group] and x quantized per row
    (quantize_activations) inside; packed and scales from pack_w4a8."""
    return panel_matmul("w4a8_linear", x, n, bias, packed, scales, group)
