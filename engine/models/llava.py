"""LLaVA (`LlavaForConditionalGeneration`): a CLIP or SigLIP vision tower (engine/models/vision/clip.py) whose
chosen hidden states a two-layer projector maps into the language model's embedding space, in place of each
image's placeholder tokens; the language model is one of our dense decoders (text_config), unchanged.

Checkpoints name the parts `language_model.model.*` / `language_model.lm_head.*` (the released layout) or
`model.language_model.*` / `lm_head.*` (transformers 5's own), and the tower `vision_tower.vision_model.*` or
`vision_tower.*`; all load. The tower's layers past the deepest selected hidden state, and its post-norm,
are never run and not loaded."""

from __future__ import annotations

import re

import numpy as np
import torch
from torch import nn

from engine.models.config import ModelConfig
from engine.models.layers.quantization import QuantizationConfig
from engine.models.llama import checkpoint_shapes
from engine.models.vision.clip import ACTIVATIONS, CLIPVisionTower
from engine.models.vision_language import VisionLanguageModel
from engine.multimodal.inputs import MultiModalInput

_LANGUAGE = re.compile(r"^(?:language_model\.model\.|model\.language_model\.)")
_HEAD = re.compile(r"^(?:language_model\.)?lm_head\.")
_VISION = re.compile(r"^(?:model\.)?vision_tower\.(?:vision_model\.)?")
_PROJECTOR = re.compile(r"^(?:model\.)?multi_modal_projector\.")


class LlavaProjector(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        v = cfg.vision
        self.linear_1 = nn.Linear(v.hidden_size * len(v.feature_layers), cfg.hidden_size, bias=v.projector_bias)
        self.linear_2 = nn.Linear(cfg.hidden_size, cfg.hidden_size, bias=v.projector_bias)
        self.act = ACTIVATIONS[v.projector_hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(x)))


class LlavaForConditionalGeneration(VisionLanguageModel):
    def __init__(self, cfg: ModelConfig, quant_config: QuantizationConfig | None = None) -> None:
        super().__init__(cfg, quant_config)
        # Whole on every rank and in float32-or-model dtype: small next to the language model.
        self.vision_tower = CLIPVisionTower(cfg.vision)
        self.multi_modal_projector = LlavaProjector(cfg)

    @torch.inference_mode()
    def embed_images(self, images: list[MultiModalInput]) -> list[torch.Tensor]:
        """Images of one size ([C, H, W] each, as CLIP's processor makes them): encoded as one batch."""
        pixels = torch.from_numpy(np.stack([image.pixel_values for image in images]))
        pixels = pixels.to(self.multi_modal_projector.linear_1.weight.device)
        return list(self.multi_modal_projector(self.vision_tower(pixels)))

    def checkpoint_to_param(self, name: str) -> tuple[str, int | None] | None:
        if _VISION.match(name):
            local = _VISION.sub("", name)
            if local.startswith(("post_layernorm.", "head.")):  # SigLIP's pooling head: features come before it
                return None
            layer = re.match(r"encoder\.layers\.(\d+)\.", local)
            if layer and int(layer[1]) >= self.config.vision.num_layers_run:
                return None  # past the deepest hidden state the features take: never run
            return f"vision_tower.{local}", None
        if _PROJECTOR.match(name):
            return _PROJECTOR.sub("multi_modal_projector.", name), None
        name = _HEAD.sub("lm_head.", _LANGUAGE.sub("model.", name))
        return super().checkpoint_to_param(name)

    @staticmethod
    def checkpoint_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
        """The released layout's names: the language model's under language_model., the tower, the projector."""
        v, h = cfg.vision, cfg.hidden_size
        shapes = {("language_model." + k if k.startswith(("model.", "lm_head.")) else k): s
                  for k, s in checkpoint_shapes(cfg).items()}
        t, clip = "vision_tower.vision_model.", v.tower == "clip"
        shapes |= {t + "embeddings.patch_embedding.weight": (v.hidden_size, v.num_channels, v.patch_size, v.patch_size),
                   t + "embeddings.position_embedding.weight": ((v.image_size // v.patch_size) ** 2 + clip,
                                                                v.hidden_size)}
        if clip:
            shapes |= {t + "embeddings.class_embedding": (v.hidden_size,),
                       t + "pre_layrnorm.weight": (v.hidden_size,), t + "pre_layrnorm.bias": (v.hidden_size,)}
        else:
            shapes[t + "embeddings.patch_embedding.bias"] = (v.hidden_size,)
        for i in range(v.num_hidden_layers):
            p = f"{t}encoder.layers.{i}."
            for norm in ("layer_norm1", "layer_norm2"):
                shapes |= {f"{p}{norm}.weight": (v.hidden_size,), f"{p}{norm}.bias": (v.hidden_size,)}
            for proj in ("q_proj", "k_proj", "v_proj", "out_proj"):
                shapes |= {f"{p}self_attn.{proj}.weight": (v.hidden_size, v.hidden_size),
                           f"{p}self_attn.{proj}.bias": (v.hidden_size,)}
            shapes |= {f"{p}mlp.fc1.weight": (v.intermediate_size, v.hidden_size),
                       f"{p}mlp.fc1.bias": (v.intermediate_size,),
                       f"{p}mlp.fc2.weight": (v.hidden_size, v.intermediate_size), f"{p}mlp.fc2.bias": (v.hidden_size,)}
        features = v.hidden_size * len(v.feature_layers)
        shapes |= {"multi_modal_projector.linear_1.weight": (h, features),
                   "multi_modal_projector.linear_2.weight": (h, h)}
        if v.projector_bias:
            shapes |= {"multi_modal_projector.linear_1.bias": (h,), "multi_modal_projector.linear_2.bias": (h,)}
        return shapes
