"""RMSNorm, rotary embeddings and SiLU-and-multiply on CPU through elementwise.cpp, one pass each. The layers
(engine/models) call these when `available(x)`, else their torch code, which stays the reference (GPU, other
dtypes, no compiler)."""

from __future__ import annotations

import torch

from ops.cpu import load_elementwise_kernels

_DTYPES = (torch.float32, torch.bfloat16)


def available(x: torch.Tensor) -> bool:
    return x.is_cpu and x.dtype in _DTYPES and load_elementwise_kernels() is not None


def _contiguous(x: torch.Tensor) -> torch.Tensor:
    # a decode step calls these ~30 times: a no-op .contiguous() still costs a dispatch (~1 us), the check does not
    return x if x.is_contiguous() else x.contiguous()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """RMSNorm(x) * weight; with `residual`, of x + residual, returning (normed, x + residual)."""
    x = _contiguous(x)
    out = torch.empty_like(x)
    summed = torch.empty_like(x) if residual is not None else None
    res = _contiguous(residual) if residual is not None else None
    if weight.dtype != x.dtype:
        weight = weight.to(x.dtype)
    load_elementwise_kernels().rms_norm(out, summed, x, res, _contiguous(weight), eps)
    return out if residual is None else (out, summed)


def rotary_neox(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                in_place: bool = False) -> torch.Tensor:
    """x [tokens, heads, head_dim] (any strides but the last) rotated, neox style, into a new tensor or, with
    `in_place`, into x itself; cos and sin [max_position, head_dim / 2] float32."""
    if x.stride(-1) != 1:
        if in_place:
            raise ValueError("rotary_neox: in place needs x's head_dim contiguous")
        x = x.contiguous()
    out = x if in_place else torch.empty(x.shape, dtype=x.dtype)
    if positions.dtype != torch.int64:
        positions = positions.long()
    load_elementwise_kernels().rotary_neox(out, x, _contiguous(positions), cos, sin)
    return out


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [..., 2 I] = [gate, up] -> silu(gate) * up [..., I]."""
    x = _contiguous(x)
    out = torch.empty(*x.shape[:-1], x.shape[-1] // 2, dtype=x.dtype)
    load_elementwise_kernels().silu_and_mul(out, x)
    return out
