"""Qwen2-VL and Qwen2.5-VL (`Qwen2VLForConditionalGeneration`, `Qwen2_5_VLForConditionalGeneration`): Qwen's
vision transformer (engine/models/vision/qwen2_vl.py) in front of a Qwen2 language model with M-RoPE, whose
three-dimensional positions the driver computes (engine/multimodal/mrope.py).

Checkpoints name the parts `model.*` / `visual.*` / `lm_head.*` (the released layout) or
`model.language_model.*` / `model.visual.*` / `lm_head.*` (transformers 5's own); both load."""

from __future__ import annotations

import re

import numpy as np
import torch

from engine.models.config import ModelConfig
from engine.models.layers.quantization import QuantizationConfig
from engine.models.llama import checkpoint_shapes
from engine.models.vision.qwen2_vl import QwenVisionTower
from engine.models.vision_language import VisionLanguageModel
from engine.multimodal.inputs import MultiModalInput

_LANGUAGE = re.compile(r"^model\.language_model\.")
_VISION = re.compile(r"^(?:model\.)?visual\.")


class Qwen2VLForConditionalGeneration(VisionLanguageModel):
    """Both generations: the config (QwenVisionConfig) says which tower is built."""

    def __init__(self, cfg: ModelConfig, quant_config: QuantizationConfig | None = None) -> None:
        super().__init__(cfg, quant_config)
        self.visual = QwenVisionTower(cfg.vision)

    @torch.inference_mode()
    def embed_images(self, images: list[MultiModalInput]) -> list[torch.Tensor]:
        """Images of any sizes, their patches concatenated: attention never crosses from one to the next."""
        pixels = torch.from_numpy(np.concatenate([image.pixel_values for image in images]))
        embeds = self.visual(pixels, [image.grid_thw for image in images])
        return list(embeds.split([image.length for image in images]))

    def checkpoint_to_param(self, name: str) -> tuple[str, int | None] | None:
        if _VISION.match(name):
            return _VISION.sub("visual.", name), None
        return super().checkpoint_to_param(_LANGUAGE.sub("model.", name))

    @staticmethod
    def checkpoint_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
        """The released layout's names: the language model's as Qwen2's, the tower's under visual."""
        v = cfg.vision
        h, inner, merged = v.hidden_size, v.intermediate_size, v.hidden_size * v.spatial_merge_size**2
        shapes = dict(checkpoint_shapes(cfg))
        shapes["visual.patch_embed.proj.weight"] = (h, v.in_channels, v.temporal_patch_size, v.patch_size, v.patch_size)
        norm = ("weight",) if v.gated_mlp else ("weight", "bias")
        mlp = ({"gate_proj": (inner, h), "up_proj": (inner, h), "down_proj": (h, inner)} if v.gated_mlp
               else {"fc1": (inner, h), "fc2": (h, inner)})
        for i in range(v.depth):
            p = f"visual.blocks.{i}."
            shapes |= {f"{p}{n}.{k}": (h,) for n in ("norm1", "norm2") for k in norm}
            shapes |= {f"{p}attn.qkv.weight": (3 * h, h), f"{p}attn.qkv.bias": (3 * h,),
                       f"{p}attn.proj.weight": (h, h), f"{p}attn.proj.bias": (h,)}
            for name, shape in mlp.items():
                shapes |= {f"{p}mlp.{name}.weight": shape, f"{p}mlp.{name}.bias": (shape[0],)}
        shapes |= {f"visual.merger.ln_q.{k}": (h,) for k in norm}
        shapes |= {"visual.merger.mlp.0.weight": (merged, merged), "visual.merger.mlp.0.bias": (merged,),
                   "visual.merger.mlp.2.weight": (v.out_hidden_size, merged),
                   "visual.merger.mlp.2.bias": (v.out_hidden_size,)}
        return shapes

