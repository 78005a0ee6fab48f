"""RMSNorm, numerically matched to Hugging Face transformers."""

from __future__ import annotations

import torch
from torch import nn

from engine.models.layers.direct_call import DirectCall
from ops.cpu import elementwise


class RMSNorm(DirectCall, nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """With `residual`, adds it first and returns (normed, new residual), fusing the two steps."""
        if elementwise.available(x):
            return elementwise.rms_norm(x, self.weight, self.eps, residual)
        return rms_norm(x, self.weight, self.eps, residual)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """The torch path (and the reference for ops/cpu/elementwise.cpp)."""
    if residual is not None:
        x = x + residual
        residual = x
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    h = weight * h.to(dtype)
    return h if residual is None else (h, residual)
