"""Rotary position embeddings (neox style, or DeepSeek's interleaved pairs; Llama 3, linear and YaRN frequency
scaling), matched to Hugging Face transformers."""

from __future__ import annotations

import math

import torch
from torch import nn

from ops.cpu import elementwise


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def rope_attention_factor(scaling: dict | None) -> float:
    """What YaRN multiplies cos and sin by (transformers' attention_factor); 1 otherwise."""
    if scaling is None or scaling["rope_type"] != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor, mscale, mscale_all_dim = scaling["factor"], scaling.get("mscale"), scaling.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
    return yarn_mscale(factor)


def _yarn_inv_freq(head_dim: int, theta: float, scaling: dict) -> torch.Tensor:
    """transformers' _compute_yarn_parameters: interpolated frequencies blended into the original ones over
    the dimensions between beta_fast and beta_slow rotations."""
    factor, original = scaling["factor"], scaling["original_max_position_embeddings"]
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return head_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
    extrapolation = 1 - ramp
    return (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return inv_freq
    if scaling["rope_type"] == "linear":  # positions divided by the factor
        return inv_freq / scaling["factor"]
    if scaling["rope_type"] == "yarn":
        return _yarn_inv_freq(head_dim, theta, scaling)
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
    """Neox-style rotary embedding (rotate_half), or with `interleaved` DeepSeek's pairs (whose output is
    laid out as the two halves: q and k rotate alike, so their dot products are the pairs' own), with a
    cos/sin cache indexed by position."""

    def __init__(self, head_dim: int, max_position: int, theta: float, scaling: dict | None,
                 interleaved: bool = False) -> None:
        super().__init__()
        self.interleaved = interleaved
        # Computed on the CPU, then placed where the model is built. On the meta device (ModelSpec's layout
        # check builds every model there) these ops would import torch._dynamo for their reference
        # implementations: 2-3 s of every process that checks a config.
        device = torch.empty(0).device
        with torch.device("cpu"):
            inv_freq = rope_inv_freq(head_dim, theta, scaling)
            freqs = torch.arange(max_position, dtype=torch.float32)[:, None] * inv_freq[None, :]
            factor = rope_attention_factor(scaling)
        self.register_buffer("cos", (freqs.cos() * factor).to(device), persistent=False)
        self.register_buffer("sin", (freqs.sin() * factor).to(device), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.rotate(positions, q), self.rotate(positions, k)

    def rotate(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """x [tokens, heads, head_dim] rotated into a new tensor."""
        if self._on_kernel(positions, x):
            return elementwise.rotary_neox(x, positions, self.cos, self.sin)
        cos, sin = self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)  # [tokens, 1, head_dim / 2]
        return _rotate_pairs(x, cos, sin) if self.interleaved else rotate_neox(x, cos, sin)

    def rotate_(self, positions: torch.Tensor, x: torch.Tensor) -> None:
        """x [tokens, heads, head_dim] rotated in place: q's and k's heads, side by side in the fused QKV output,
        turn in one kernel call (a decode step's dispatches are most of its cost at batch 1)."""
        if self._on_kernel(positions, x) and x.stride(-1) == 1:
            elementwise.rotary_neox(x, positions, self.cos, self.sin, in_place=True)
        else:
            x.copy_(self.rotate(positions, x))

    def _on_kernel(self, positions: torch.Tensor, x: torch.Tensor) -> bool:
        return not self.interleaved and positions.dim() == 1 and elementwise.available(x)


class MRotaryEmbedding(RotaryEmbedding):
    """Qwen-VL's M-RoPE: `positions` [3, tokens] (temporal, height, width); the first section of the rotary
    frequencies turns by the temporal position, the next by the height, the last by the width. Given 1-D
    positions (a step with no image in any of its requests), the three are equal: plain rotary."""

    def __init__(self, head_dim: int, max_position: int, theta: float, scaling: dict | None,
                 section: tuple[int, ...]) -> None:
        super().__init__(head_dim, max_position, theta, scaling)
        axis = [i % 3 for i, size in enumerate(section) for _ in range(size)]  # [head_dim / 2]: 0, 1 or 2
        self.register_buffer("axis", torch.tensor(axis, device=self.cos.device), persistent=False)
        self.register_buffer("freq", torch.arange(len(axis), device=self.cos.device), persistent=False)

    def rotate(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        if positions.dim() == 1:
            return super().rotate(positions, x)
        index = positions[self.axis].T  # [tokens, head_dim / 2]: each frequency's position of each token
        cos, sin = self.cos[index, self.freq].unsqueeze(1), self.sin[index, self.freq].unsqueeze(1)
        return rotate_neox(x, cos, sin)


def rotate_neox(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The torch path (and the reference for ops/cpu/elementwise.cpp)."""
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


def _rotate_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Each pair (x[2i], x[2i+1]) rotated by its frequency; out[i] and out[d/2 + i] hold the pair."""
    x1, x2 = x[..., 0::2].float(), x[..., 1::2].float()
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)
