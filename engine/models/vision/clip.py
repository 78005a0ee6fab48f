"""CLIP's vision transformer (LLaVA's tower): patches by a strided convolution, a class embedding and learned
positions, pre-norm encoder layers with full attention over an image's positions. SigLIP's is the same
transformer without the class embedding and the pre-norm, its patch convolution with a bias. Images are few and short
(hundreds of positions), so it runs in plain torch on every rank, replicated under tensor parallelism; only
the layers up to the deepest hidden state the features take are built and run."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.models.config import VisionConfig

ACTIVATIONS = {"quick_gelu": lambda x: x * torch.sigmoid(1.702 * x), "gelu": F.gelu, "silu": F.silu,
               "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}


class CLIPAttention(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.num_heads = cfg.num_attention_heads
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = (nn.Linear(h, h) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, h = x.shape
        q, k, v = (p(x).view(b, n, self.num_heads, -1).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        return self.out_proj(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n, h))


class CLIPEncoderLayer(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.layer_norm1 = nn.LayerNorm(h, eps=cfg.layer_norm_eps)
        self.self_attn = CLIPAttention(cfg)
        self.layer_norm2 = nn.LayerNorm(h, eps=cfg.layer_norm_eps)
        self.mlp = nn.Module()
        self.mlp.fc1, self.mlp.fc2 = nn.Linear(h, cfg.intermediate_size), nn.Linear(cfg.intermediate_size, h)
        self.act = ACTIVATIONS[cfg.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp.fc2(self.act(self.mlp.fc1(self.layer_norm2(x))))


class CLIPVisionTower(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.cfg = cfg
        h = cfg.hidden_size
        self.clip = cfg.tower == "clip"
        self.embeddings = nn.Module()
        self.embeddings.patch_embedding = nn.Conv2d(cfg.num_channels, h, cfg.patch_size, cfg.patch_size,
                                                    bias=not self.clip)
        self.embeddings.position_embedding = nn.Embedding((cfg.image_size // cfg.patch_size) ** 2 + self.clip, h)
        if self.clip:
            self.embeddings.class_embedding = nn.Parameter(torch.empty(h))
            self.pre_layrnorm = nn.LayerNorm(h, eps=cfg.layer_norm_eps)  # sic: CLIP's checkpoint name
        self.encoder = nn.Module()
        self.encoder.layers = nn.ModuleList(CLIPEncoderLayer(cfg) for _ in range(cfg.num_layers_run))

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[images, C, H, W] -> the selected hidden states, [images, tokens_per_image, hidden x layers]."""
        cfg, emb = self.cfg, self.embeddings
        patches = emb.patch_embedding(pixel_values.to(emb.patch_embedding.weight.dtype)).flatten(2).transpose(1, 2)
        if self.clip:
            x = torch.cat([emb.class_embedding.expand(patches.shape[0], 1, -1), patches], dim=1)
            x = self.pre_layrnorm(x + emb.position_embedding.weight)
        else:
            x = patches + emb.position_embedding.weight
        hidden = [x]
        for layer in self.encoder.layers:
            hidden.append(layer(hidden[-1]))
        n = cfg.num_hidden_layers
        features = torch.cat([hidden[i if i >= 0 else n + 1 + i] for i in cfg.feature_layers], dim=-1)
        return features[:, 1:] if cfg.select_strategy == "default" else features  # CLIP's class position first
