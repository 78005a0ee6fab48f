"""Mixture-of-experts decoders: Mixtral, Qwen2-MoE and Qwen3-MoE. Their attention is the Llama family's
(engine/models/llama.py: plain for Mixtral, qkv bias for Qwen2-MoE, q/k norm for Qwen3-MoE); their
feed-forward blocks are sparse: a router picks `top_k` of `num_experts` SwiGLU experts per token
(engine/models/layers/fused_moe.py runs them), and Qwen2-MoE adds a shared expert gated by a sigmoid.
Qwen's `mlp_only_layers` / `decoder_sparse_step` keep some layers dense.

Checkpoints store each expert's projections as separate tensors (`mlp.experts.{e}.gate_proj.weight`,
Mixtral's `block_sparse_moe.experts.{e}.w1.weight`, ...); loading fuses them into the layer's
[E, 2I, H] and [E, H, I] weights, each rank keeping its slice (TP) or its experts (EP)."""

from __future__ import annotations

import re

import torch
from torch import nn

from engine.models.config import ModelConfig
from engine.models.layers import ReplicatedLinear
from engine.models.layers.fused_moe import EXPERT_PROJECTIONS, FusedMoE, route
from engine.models.layers.quantization import QuantizationConfig
from engine.models.llama import MLP, DecoderLayer, LlamaForCausalLM, checkpoint_shapes

# Checkpoint names of an expert's projections (Qwen / DeepSeek style, Mixtral style) -> gate, up, down.
_EXPERT_PROJECTION_NAMES = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down",
                            "w1": "gate", "w3": "up", "w2": "down"}
_EXPERT_TENSOR = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(\w+)\.weight(_scale_inv)?$")  # FP8 tile scales too


class SparseMoeBlock(nn.Module):
    """Router, experts and (Qwen2-MoE) the gated shared expert; one all-reduce of their partial sums (over the
    EP group under data parallelism: engine/models/layers/fused_moe.py)."""

    def __init__(self, cfg: ModelConfig, quant_config: QuantizationConfig | None, prefix: str) -> None:
        super().__init__()
        moe = cfg.moe
        self.moe = moe
        # The router stays dense and whole on every rank (as in vLLM): its top-k decides which weights run.
        self.gate = ReplicatedLinear(cfg.hidden_size, moe.num_experts, prefix=f"{prefix}.gate")
        self.experts = FusedMoE(moe.num_experts, moe.top_k, cfg.hidden_size, moe.intermediate_size,
                                moe.expert_parallel, quant_config, f"{prefix}.experts")
        if moe.shared_expert_intermediate_size:
            self.shared_expert = MLP(cfg, quant_config, f"{prefix}.shared_expert",
                                     intermediate_size=moe.shared_expert_intermediate_size, reduce_results=False)
            self.shared_expert_gate = ReplicatedLinear(cfg.hidden_size, 1, prefix=f"{prefix}.shared_expert_gate")
        else:
            self.shared_expert = self.shared_expert_gate = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = route(self.gate(x), self.moe.top_k, self.moe.renormalize, self.moe.float32_routing_weights)
        shared = None
        if self.shared_expert is not None:
            # Linear in the shared expert's partial sum, so the gate may scale it before the all-reduce.
            shared = torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return self.experts.forward_reduced(x, weights, ids, shared)


class MoEDecoderLayer(DecoderLayer):
    # The sparse feed-forward block of the family (DeepSeek's and gpt-oss's differ); dense layers keep an MLP.
    sparse_block_cls: type[nn.Module] = SparseMoeBlock

    def make_mlp(self, cfg: ModelConfig, quant_config: QuantizationConfig | None, prefix: str) -> nn.Module:
        layer = int(prefix.split(".")[-2])  # model.layers.{layer}.mlp
        if cfg.moe.is_moe_layer(layer):
            return self.sparse_block_cls(cfg, quant_config, prefix)
        return MLP(cfg, quant_config, prefix)


class MoEForCausalLM(LlamaForCausalLM):
    """MixtralForCausalLM, Qwen2MoeForCausalLM and Qwen3MoeForCausalLM: what differs between them is in
    their ModelConfig (router, shared expert, which layers are sparse, attention flags)."""

    decoder_layer_cls = MoEDecoderLayer

    def __init__(self, cfg: ModelConfig, quant_config: QuantizationConfig | None = None) -> None:
        if cfg.moe is None:
            raise ValueError(f"model: {cfg.architecture} has no experts in its config")
        super().__init__(cfg, quant_config)
        # (token, expert) assignments per expert since start, summed over this rank's MoE layers: the load
        # balance the engine's metrics export. Every TP rank routes every token, so any rank's count will do.
        self.expert_load = torch.zeros(cfg.moe.num_experts, dtype=torch.int64)
        for module in self.modules():
            if module is not self and hasattr(module, "expert_load"):  # FusedMoE, gpt-oss's experts
                module.expert_load = self.expert_load

    def checkpoint_to_param(self, name: str) -> tuple[str, object] | None:
        name = name.replace(".block_sparse_moe.", ".mlp.")  # Mixtral's name for the sparse block
        match = _EXPERT_TENSOR.match(name)
        if match and match[3] in _EXPERT_PROJECTION_NAMES:
            projection = _EXPERT_PROJECTION_NAMES[match[3]]
            suffix = match[4] or ""
            return f"{match[1]}.{EXPERT_PROJECTIONS[projection][0]}{suffix}", (int(match[2]), projection)
        return super().checkpoint_to_param(name)

    def _expected_weights(self) -> set[tuple[str, object]]:
        expected = super()._expected_weights()
        for module_name, module in self.named_modules():
            if isinstance(module, FusedMoE):
                for param_name, _ in module.named_parameters(recurse=False):
                    expected.discard((f"{module_name}.{param_name}", None))
                expected |= {(f"{module_name}.{param}", shard) for param, shard in module.expected_shards()}
        return expected

    @staticmethod
    def checkpoint_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
        """The Llama-family tensors, with each sparse layer's dense MLP replaced by router and experts, named
        as the architecture's Hugging Face checkpoints name them."""
        moe, h = cfg.moe, cfg.hidden_size
        mixtral = cfg.architecture == "MixtralForCausalLM"
        block, (gate, up, down) = (("block_sparse_moe", ("w1", "w3", "w2")) if mixtral
                                   else ("mlp", ("gate_proj", "up_proj", "down_proj")))
        i, s = moe.intermediate_size, moe.shared_expert_intermediate_size
        shapes: dict[str, tuple[int, ...]] = {}
        for name, shape in checkpoint_shapes(cfg).items():
            parts = name.split(".")
            if parts[:2] != ["model", "layers"] or parts[3] != "mlp" or not moe.is_moe_layer(int(parts[2])):
                shapes[name] = shape
                continue
            if parts[4] != "gate_proj":  # the sparse block goes where the dense MLP's first tensor was
                continue
            p = f"model.layers.{parts[2]}.{block}."
            shapes[p + "gate.weight"] = (moe.num_experts, h)
            for e in range(moe.num_experts):
                shapes |= {f"{p}experts.{e}.{gate}.weight": (i, h), f"{p}experts.{e}.{up}.weight": (i, h),
                           f"{p}experts.{e}.{down}.weight": (h, i)}
            if s:
                shapes |= {p + "shared_expert.gate_proj.weight": (s, h), p + "shared_expert.up_proj.weight": (s, h),
                           p + "shared_expert.down_proj.weight": (h, s), p + "shared_expert_gate.weight": (1, h)}
        return shapes
