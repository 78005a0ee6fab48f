"""RMSNorm and rotary embeddings on CPU through elementwise.cpp, one pass each. The layers (engine/models/
layers) call these when `available(x)`, else their torch code, which stays the reference (GPU, other dtypes,
no compiler)."""

from __future__ import annotations

import torch

from ops.cpu import load_elementwise_kernels

_DTYPES = (torch.float32, torch.bfloat16)


def available(x: torch.Tensor) -> bool:
    return x.device.type == "cpu" and x.dtype in _DTYPES and load_elementwise_kernels() is not None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """RMSNorm(x) * weight; with `residual`, of x + residual, returning (normed, x + residual)."""
    x = x.contiguous()
    out = torch.empty_like(x)
    summed = torch.empty_like(x) if residual is not None else None
    res = residual.contiguous() if residual is not None else None
    if weight.dtype != x.dtype:
        weight = weight.to(x.dtype)
    load_elementwise_kernels().rms_norm(out, summed, x, res, weight.contiguous(), eps)
    return out if residual is None else (out, summed)


def rotary_neox(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [tokens, heads, head_dim] (any strides but the last) rotated, neox style; cos and sin
    [max_position, head_dim / 2] float32."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    out = torch.empty(x.shape, dtype=x.dtype)
    load_elementwise_kernels().rotary_neox(out, x, positions.long().contiguous(), cos, sin)
    return out
