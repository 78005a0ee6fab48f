"""DeepSeek-V3's multi-token prediction (MTP) layer, run as a draft model (speculative_config method "mtp",
engine/spec_decode/mtp_proposer.py).

The checkpoint ships it after the decoder's layers, as `model.layers.{num_hidden_layers}`. At position p it
takes the target's final hidden state h_p and the embedding of token p + 1, each normed (hnorm, enorm),
projects them together (eh_proj), runs one more DeepSeek decoder layer (latent attention, experts) and
predicts token p + 2 through its own norm and head (shared_head). DeepSeek shares the main model's embedding
and LM head with it and stores copies under the layer: the copies load when present, the main model's
tensors otherwise. Later drafts feed the layer its own output as the next position's hidden state."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from engine.models.checkpoint import CheckpointTensor
from engine.models.config import ModelConfig
from engine.models.deepseek import DeepseekDecoderLayer, DeepseekForCausalLM
from engine.models.layers import ParallelLMHead, ReplicatedLinear, RMSNorm, RotaryEmbedding, VocabParallelEmbedding
from engine.models.layers.quantization import QuantizationConfig
from engine.models.moe import MoEForCausalLM
from ops.attention import AttentionBackend


class DeepseekMTPLayer(DeepseekDecoderLayer):
    def __init__(self, cfg: ModelConfig, rope: RotaryEmbedding, quant_config: QuantizationConfig | None,
                 prefix: str, layer: int) -> None:
        super().__init__(cfg, rope, quant_config, prefix, layer)
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, h)
        self.enorm, self.hnorm = RMSNorm(h, eps), RMSNorm(h, eps)
        self.eh_proj = ReplicatedLinear(2 * h, h, prefix=f"{prefix}.eh_proj")  # unquantized in FP8 releases too
        self.shared_head = nn.Module()
        self.shared_head.norm = RMSNorm(h, eps)
        self.shared_head.head = ParallelLMHead(cfg.vocab_size, h)

    def predict(self, positions: torch.Tensor, input_ids: torch.Tensor, previous_hidden: torch.Tensor,
                backend: AttentionBackend) -> torch.Tensor:
        x = torch.cat([self.enorm(self.embed_tokens(input_ids)), self.hnorm(previous_hidden)], dim=-1)
        x, residual = super().forward(positions, self.eh_proj(x), None, backend)
        return x + residual


class DeepseekMTP(DeepseekForCausalLM):
    """The MTP layer alone, under the checkpoint's names (model.layers.{N}.*), so that it loads as the
    decoder's layers do (fused projections, experts, FP8 scales)."""

    def __init__(self, cfg: ModelConfig, quant_config: QuantizationConfig | None = None) -> None:
        nn.Module.__init__(self)  # none of the decoder's layers: the MTP layer only (engine/model_spec.py checks it)
        self.config = cfg
        if quant_config is not None:
            quant_config.fused_modules = self.fused_modules()
        n = self.layer_index = cfg.num_hidden_layers
        rope = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling,
                               cfg.rope_interleaved)
        self.model = nn.Module()
        self.model.layers = nn.ModuleDict({str(n): DeepseekMTPLayer(cfg, rope, quant_config, f"model.layers.{n}", n)})
        self.mtp = self.model.layers[str(n)]
        self.expert_load = torch.zeros(cfg.moe.num_experts, dtype=torch.int64)  # kept apart from the target's
        for module in self.modules():
            if module is not self and hasattr(module, "expert_load"):
                module.expert_load = self.expert_load

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, backend: AttentionBackend,
                previous_hidden: torch.Tensor) -> torch.Tensor:
        """The layer's output at each position (what the next draft position takes as its hidden state)."""
        return self.mtp.predict(positions, input_ids, previous_hidden, backend)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        return self.mtp.shared_head.head.compute_logits(self.mtp.shared_head.norm(hidden))

    @property
    def attention_layers(self) -> list:
        return [self.mtp.self_attn]

    def checkpoint_to_param(self, name: str) -> tuple[str, object] | None:
        prefix = f"model.layers.{self.layer_index}."
        if name.startswith(prefix):
            return MoEForCausalLM.checkpoint_to_param(self, name)
        return None  # the decoder's own tensors (the shared embedding and head: load_weights)

    def load_weights(self, weights: Iterable[tuple[str, CheckpointTensor]]) -> None:
        prefix = f"model.layers.{self.layer_index}."
        # The main model's copies stand in for the layer's own, which come first when the checkpoint has them.
        shared = {"model.embed_tokens.weight": [prefix + "embed_tokens.weight"],
                  "lm_head.weight": [prefix + "shared_head.head.weight"]}
        if self.config.tie_word_embeddings:
            shared["model.embed_tokens.weight"].append(prefix + "shared_head.head.weight")
        fallback: dict[str, CheckpointTensor] = {}
        seen: set[str] = set()

        def layer_first() -> Iterable[tuple[str, CheckpointTensor]]:
            for name, tensor in weights:
                for target in shared.get(name, ()):
                    fallback[target] = tensor
                if name not in shared:
                    seen.add(name)
                    yield name, tensor
            yield from ((name, tensor) for name, tensor in fallback.items() if name not in seen)

        super().load_weights(layer_first())

    def _on_other_stage(self, param_name: str) -> bool:
        return False

    @staticmethod
    def checkpoint_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
        return DeepseekForCausalLM.checkpoint_shapes(cfg)
