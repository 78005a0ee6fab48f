"""RMSNorm, numerically matched to Hugging Face transformers."""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """With `residual`, adds it first and returns (normed, new residual), fusing the two steps."""
        if residual is not None:
            x = x + residual
            residual = x
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        h = self.weight * h.to(dtype)
        return h if residual is None else (h, residual)
