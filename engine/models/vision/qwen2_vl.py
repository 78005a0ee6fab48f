"""Qwen2-VL's and Qwen2.5-VL's vision transformer: an image arrives as the processor's flattened patches
(temporal x spatial, in merge-square order) and its patch grid; 2-D rotary positions (height, then width)
over each head, attention within each image (Qwen2.5-VL: within windows of window_size pixels, except in
the full-attention blocks), and a merger that folds each merge square of patches into one embedding of the
language model's width. Replicated on every rank, like CLIP (engine/models/vision/clip.py)."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from engine.models.config import QwenVisionConfig
from engine.models.layers.rotary import rotate_neox
from engine.models.vision.clip import ACTIVATIONS

Grid = tuple[int, int, int]


class VisionRMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * F.rms_norm(x.float(), x.shape[-1:], eps=self.eps).to(x.dtype)


class VisionAttention(nn.Module):
    def __init__(self, cfg: QwenVisionConfig) -> None:
        super().__init__()
        self.num_heads = cfg.num_heads
        self.qkv = nn.Linear(cfg.hidden_size, 3 * cfg.hidden_size)
        self.proj = nn.Linear(cfg.hidden_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, bounds: list[int]) -> torch.Tensor:
        """`bounds`: where each attention segment (an image's frame, or a window) starts, and the end."""
        n, width = x.shape
        q, k, v = self.qkv(x).view(n, 3, self.num_heads, -1).unbind(1)
        q, k = rotate_neox(q, cos, sin), rotate_neox(k, cos, sin)
        out = torch.empty_like(q)
        for a, b in zip(bounds[:-1], bounds[1:]):
            out[a:b] = F.scaled_dot_product_attention(q[a:b].transpose(0, 1), k[a:b].transpose(0, 1),
                                                      v[a:b].transpose(0, 1)).transpose(0, 1)
        return self.proj(out.reshape(n, width))


class VisionBlock(nn.Module):
    def __init__(self, cfg: QwenVisionConfig) -> None:
        super().__init__()
        h, norm = cfg.hidden_size, (VisionRMSNorm if cfg.gated_mlp else nn.LayerNorm)
        self.norm1, self.norm2 = norm(h, eps=1e-6), norm(h, eps=1e-6)
        self.attn = VisionAttention(cfg)
        self.mlp = nn.Module()
        if cfg.gated_mlp:
            self.mlp.gate_proj, self.mlp.up_proj = (nn.Linear(h, cfg.intermediate_size) for _ in range(2))
            self.mlp.down_proj = nn.Linear(cfg.intermediate_size, h)
        else:
            self.mlp.fc1, self.mlp.fc2 = nn.Linear(h, cfg.intermediate_size), nn.Linear(cfg.intermediate_size, h)
        self.gated, self.act = cfg.gated_mlp, ACTIVATIONS[cfg.hidden_act]

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, bounds: list[int]) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, bounds)
        y, m = self.norm2(x), self.mlp
        y = m.down_proj(self.act(m.gate_proj(y)) * m.up_proj(y)) if self.gated else m.fc2(self.act(m.fc1(y)))
        return x + y


class QwenVisionTower(nn.Module):
    def __init__(self, cfg: QwenVisionConfig) -> None:
        super().__init__()
        self.cfg = cfg
        h, merged = cfg.hidden_size, cfg.hidden_size * cfg.spatial_merge_size**2
        kernel = (cfg.temporal_patch_size, cfg.patch_size, cfg.patch_size)
        self.patch_embed = nn.Module()
        self.patch_embed.proj = nn.Conv3d(cfg.in_channels, h, kernel, kernel, bias=False)
        self.blocks = nn.ModuleList(VisionBlock(cfg) for _ in range(cfg.depth))
        self.merger = nn.Module()
        self.merger.ln_q = VisionRMSNorm(h) if cfg.gated_mlp else nn.LayerNorm(h, eps=1e-6)
        self.merger.mlp = nn.Sequential(nn.Linear(merged, merged), nn.GELU(), nn.Linear(merged, cfg.out_hidden_size))
        quarter = h // cfg.num_heads // 2  # each of height and width turns half the rotary frequencies
        with torch.device("cpu"):
            inv_freq = 1.0 / cfg.rope_theta ** (torch.arange(0, quarter, 2, dtype=torch.float32) / quarter)
        self.register_buffer("inv_freq", inv_freq.to(self.patch_embed.proj.weight.device), persistent=False)

    def forward(self, pixels: torch.Tensor, grids: list[Grid]) -> torch.Tensor:
        """[patches, C * temporal_patch * patch^2] of images with patch grids `grids` -> [patches / merge^2,
        out_hidden_size], image after image."""
        cfg, unit = self.cfg, self.cfg.spatial_merge_size**2
        weight = self.patch_embed.proj.weight
        x = self.patch_embed.proj(pixels.to(weight.device, weight.dtype).view(
            -1, cfg.in_channels, cfg.temporal_patch_size, cfg.patch_size, cfg.patch_size)).flatten(1)
        angles = (torch.from_numpy(_patch_positions(grids, cfg.spatial_merge_size)).to(x.device)[..., None]
                  * self.inv_freq).flatten(1)  # [patches, head_dim / 2]: the height's, then the width's
        frames = _bounds([h * w for t, h, w in grids for _ in range(t)])
        windows = None
        if cfg.window_size:
            order, windows = _window_order(grids, cfg)
            regroup = torch.from_numpy(order).to(x.device)
            x = x.view(-1, unit, x.shape[-1])[regroup].flatten(0, 1)
            angles = angles.view(-1, unit, angles.shape[-1])[regroup].flatten(0, 1)
        cos, sin = angles.cos().unsqueeze(1), angles.sin().unsqueeze(1)
        for i, block in enumerate(self.blocks):
            full = windows is None or i in cfg.fullatt_block_indexes
            x = block(x, cos, sin, frames if full else windows)
        x = self.merger.mlp(self.merger.ln_q(x).view(-1, x.shape[-1] * unit))
        return x if windows is None else x[torch.from_numpy(np.argsort(order)).to(x.device)]


def _bounds(lengths: list[int]) -> list[int]:
    return [0, *np.cumsum(lengths).tolist()]


def _patch_positions(grids: list[Grid], merge: int) -> np.ndarray:
    """Each patch's (row, column) in its image, in the processor's order: merge square after merge square."""
    out = []
    for t, h, w in grids:
        rows, cols = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
        square = (h // merge, merge, w // merge, merge)
        pos = np.stack([rows.reshape(square).transpose(0, 2, 1, 3).ravel(),
                        cols.reshape(square).transpose(0, 2, 1, 3).ravel()], axis=-1)
        out.append(np.tile(pos, (t, 1)))
    return np.concatenate(out)


def _window_order(grids: list[Grid], cfg: QwenVisionConfig) -> tuple[np.ndarray, list[int]]:
    """Qwen2.5-VL's windows: the merge squares regrouped window by window (each window a block of
    window_size pixels, cut short at the image's edge), and where each window starts in that order."""
    side = cfg.window_size // cfg.spatial_merge_size // cfg.patch_size  # a window's side, in merge squares
    order, lengths, first = [], [], 0
    for t, h, w in grids:
        h, w = h // cfg.spatial_merge_size, w // cfg.spatial_merge_size
        squares = np.arange(t * h * w).reshape(t, h, w)
        for frame in squares:
            for r in range(0, h, side):
                for c in range(0, w, side):
                    window = frame[r : r + side, c : c + side].ravel()
                    order.append(window + first)
                    lengths.append(len(window) * cfg.spatial_merge_size**2)
        first += t * h * w
    return np.concatenate(order), _bounds(lengths)
