"""Gemma 3 (`Gemma3ForCausalLM`, and the language model of `Gemma3ForConditionalGeneration`, served text
only): the Llama decoder with Gemma's RMSNorm (scales by 1 + weight, in float32), embeddings scaled by
sqrt(hidden_size), q/k norms, a norm after attention and one before and after the MLP, a GELU-tanh gate,
and sliding-window layers (5 to each global one) that rotate with a base of their own (ModelConfig's
local_rope_theta). Attention scores scale by query_pre_attn_scalar ** -0.5 (the backend's scale)."""

from __future__ import annotations

import torch
from torch import nn

from engine.models.config import ModelConfig
from engine.models.layers import RotaryEmbedding
from engine.models.layers.quantization import QuantizationConfig
from engine.models.llama import Attention, DecoderLayer, LlamaForCausalLM, LlamaModel, checkpoint_shapes
from ops.attention import AttentionBackend

# Where the multimodal checkpoints keep the language model: transformers 5 saves `model.language_model.*`,
# the released files `language_model.model.*` (and `language_model.lm_head.*`).
_LANGUAGE_MODEL = (("model.language_model.", "model."), ("language_model.model.", "model."),
                   ("language_model.lm_head.", "lm_head."))
_VISION = ("vision_tower", "multi_modal_projector")


class GemmaRMSNorm(nn.Module):
    """x / rms(x) * (1 + weight), computed in float32 as Hugging Face's Gemma3RMSNorm is."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """With `residual`, adds it first and returns (normed, new residual), as RMSNorm does."""
        if residual is not None:
            x = x + residual
            residual = x
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps) * (1.0 + self.weight.float())
        h = h.to(x.dtype)
        return h if residual is None else (h, residual)


class Gemma3Attention(Attention):
    norm_cls = GemmaRMSNorm


class Gemma3DecoderLayer(DecoderLayer):
    attention_cls = Gemma3Attention
    norm_cls = GemmaRMSNorm

    def __init__(self, cfg: ModelConfig, rope: RotaryEmbedding, quant_config: QuantizationConfig | None,
                 prefix: str, layer: int) -> None:
        super().__init__(cfg, rope, quant_config, prefix, layer)
        self.pre_feedforward_layernorm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, positions, x, residual, backend: AttentionBackend):
        # Hugging Face: h += post_attn_norm(attn(input_norm(h))); h += post_ff_norm(mlp(pre_ff_norm(h))). Here
        # the second addition is left to the next layer's (or the final) norm, as the Llama layers do.
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.post_attention_layernorm(self.self_attn(positions, x, backend))
        x, residual = self.pre_feedforward_layernorm(x, residual)
        return self.post_feedforward_layernorm(self.mlp(x)), residual


class Gemma3Model(LlamaModel):
    norm_cls = GemmaRMSNorm

    def __init__(self, cfg: ModelConfig, quant_config: QuantizationConfig | None, prefix: str = "model",
                 layer_cls: type[DecoderLayer] = Gemma3DecoderLayer) -> None:
        super().__init__(cfg, quant_config, prefix, layer_cls)
        self.embed_scale = cfg.hidden_size**0.5

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        return x * torch.tensor(self.embed_scale, dtype=x.dtype)  # rounded to the model's dtype, as Hugging Face does


class Gemma3ForCausalLM(LlamaForCausalLM):
    decoder_layer_cls = Gemma3DecoderLayer
    model_cls = Gemma3Model

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        logits = super().compute_logits(hidden)
        cap = self.config.final_logit_softcapping
        if logits is not None and cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits

    def checkpoint_to_param(self, name: str) -> tuple[str, int | None] | None:
        if any(part in name for part in _VISION):
            return None
        for prefix, ours in _LANGUAGE_MODEL:
            if name.startswith(prefix):
                name = ours + name.removeprefix(prefix)
                break
        return super().checkpoint_to_param(name)

    @staticmethod
    def checkpoint_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
        shapes = checkpoint_shapes(cfg)
        for n in range(cfg.num_hidden_layers):
            for norm in ("pre_feedforward_layernorm", "post_feedforward_layernorm"):
                shapes[f"model.layers.{n}.{norm}.weight"] = (cfg.hidden_size,)
        return shapes
