"""Rotary position embeddings (neox style; Llama 3 and linear frequency scaling), matched to Hugging Face
transformers."""

from __future__ import annotations

import math

import torch
from torch import nn

from kernels.cpu import elementwise


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return inv_freq
    if scaling["rope_type"] == "linear":  # positions divided by the factor
        return inv_freq / scaling["factor"]
    # Llama 3.1 frequency scaling, as in transformers' _compute_llama3_parameters.
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old_len / high) * ~(wavelen > old_len / low)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """Neox-style rotary embedding (rotate_half), with a cos/sin cache indexed by position."""

    def __init__(self, head_dim: int, max_position: int, theta: float, scaling: dict | None) -> None:
        super().__init__()
        # Computed on the CPU, then placed where the model is built. On the meta device (ModelSpec's layout
        # check builds every model there) these ops would import torch._dynamo for their reference
        # implementations: 2-3 s of every process that checks a config.
        device = torch.empty(0).device
        with torch.device("cpu"):
            inv_freq = rope_inv_freq(head_dim, theta, scaling)
            freqs = torch.arange(max_position, dtype=torch.float32)[:, None] * inv_freq[None, :]
        self.register_buffer("cos", freqs.cos().to(device), persistent=False)
        self.register_buffer("sin", freqs.sin().to(device), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if elementwise.available(q):
            return (elementwise.rotary_neox(q, positions, self.cos, self.sin),
                    elementwise.rotary_neox(k, positions, self.cos, self.sin))
        cos = self.cos[positions].unsqueeze(1)  # [tokens, 1, head_dim / 2]
        sin = self.sin[positions].unsqueeze(1)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The torch path (and the reference for kernels/cpu/elementwise.cpp)."""
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)
