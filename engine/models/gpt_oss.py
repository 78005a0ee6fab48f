"""gpt-oss (`GptOssForCausalLM`): the Llama decoder with biased q/k/v/o projections, attention sinks (a learned
logit per head in the softmax's denominator, applied by the attention backend), sliding-window (128) layers
alternating with full ones, YaRN rotary scaling, and experts in every layer.

Its experts differ from the SwiGLU ones fused_moe.py runs: the router has a bias and weighs the top-k by a
softmax over their logits alone; each expert's gate and up projections are one interleaved [H, 2I] matrix
(column 2i the gate's feature i, 2i + 1 the up's) with biases, the activation is clamped (gate <= limit,
|up| <= limit; (up + 1) * gate * sigmoid(alpha * gate), alpha 1.702, limit 7), and the down projection has a
bias. Checkpoints store each layer's experts fused ([E, H, 2I], [E, I, H] and their biases), as here. Under
tensor parallelism each rank holds its slice of every expert's intermediate features (interleaved pairs stay
together) and the down bias is added once, on rank 0, before the all-reduce. MXFP4 expert weights (the release
format, quantization/mxfp4.py) are dequantized as they load: each projection once both its blocks and its
scales are in."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.distributed import get_tp_group
from engine.models.checkpoint import CheckpointTensor
from engine.models.config import ModelConfig
from engine.models.layers import ReplicatedLinear, RotaryEmbedding
from engine.models.layers.linear import copy_checked, divide
from engine.models.layers.quantization import QuantizationConfig
from engine.models.layers.quantization.mxfp4 import BLOCK, dequantize_mxfp4
from engine.models.llama import Attention
from engine.models.moe import MoEDecoderLayer, MoEForCausalLM


class GptOssAttention(Attention):
    def __init__(self, cfg: ModelConfig, rope: RotaryEmbedding, quant_config: QuantizationConfig | None,
                 prefix: str, layer: int) -> None:
        super().__init__(cfg, rope, quant_config, prefix, layer)
        tp = get_tp_group()
        self.sinks = nn.Parameter(torch.zeros(self.num_heads, dtype=torch.float32), requires_grad=False)
        heads, rank = self.num_heads, tp.rank_in_group
        self.sinks.weight_loader = lambda param, loaded, shard_id=None: copy_checked(
            param, loaded.narrow(0, rank * heads, heads))


class GptOssExperts(nn.Module):
    def __init__(self, cfg: ModelConfig, prefix: str, mxfp4: bool = False) -> None:
        super().__init__()
        moe, h = cfg.moe, cfg.hidden_size
        tp = get_tp_group()
        self.tp_rank, self.alpha, self.limit = tp.rank_in_group, moe.swiglu_alpha, moe.swiglu_limit
        i = self.intermediate_size = divide(moe.intermediate_size, tp.size, f"{prefix} intermediate_size")
        e = self.num_experts = moe.num_experts
        # Each parameter's dim of intermediate features (interleaved gate/up pairs in gate_up_proj: 2 per feature).
        shapes = {"gate_up_proj": ((e, h, 2 * i), 2, 2), "gate_up_proj_bias": ((e, 2 * i), 1, 2),
                  "down_proj": ((e, i, h), 1, 1), "down_proj_bias": ((e, h), None, 0)}
        for name, (shape, dim, per_feature) in shapes.items():
            param = nn.Parameter(torch.empty(shape), requires_grad=False)
            param.weight_loader = self._loader(dim, per_feature * i)
            self.register_parameter(name, param)
        if mxfp4:
            if i % BLOCK:
                raise ValueError(f"tensor_parallel_size: {i} intermediate features per rank are not a multiple of "
                                 f"MXFP4's {BLOCK}-value blocks ({prefix}); use another tensor_parallel_size")
            # The checkpoint's [E, out, in / 32, 16] blocks and [E, out, in / 32] scales of each projection,
            # sliced like its rows (gate/up: this rank's interleaved rows) or its blocks of inputs (down).
            packed = {"gate_up_proj": ((e, 2 * i, h // BLOCK), 1, 2 * i),
                      "down_proj": ((e, h, i // BLOCK), 2, i // BLOCK)}
            for name, (shape, dim, size) in packed.items():
                self._parameters[name].optional = True  # what the checkpoint has are the blocks and scales
                for suffix, full in (("_blocks", (*shape, BLOCK // 2)), ("_scales", shape)):
                    param = nn.Parameter(torch.empty(full, dtype=torch.uint8), requires_grad=False)
                    param.weight_loader = self._packed_loader(name, suffix, dim, size)
                    self.register_parameter(name + suffix, param)
        self._loaded: dict[str, set[str]] = {}
        self.expert_load: torch.Tensor | None = None  # tokens routed to each expert (MoEForCausalLM's metrics)

    def _loader(self, dim: int | None, size: int):
        def load(param: torch.Tensor, loaded: CheckpointTensor, shard_id=None) -> None:
            copy_checked(param, loaded if dim is None else loaded.narrow(dim, self.tp_rank * size, size))

        return load

    def _packed_loader(self, name: str, suffix: str, dim: int, size: int):
        def load(param: torch.Tensor, loaded: CheckpointTensor, shard_id=None) -> None:
            copy_checked(param, loaded.narrow(dim, self.tp_rank * size, size))
            done = self._loaded.setdefault(name, set())
            done.add(suffix)
            if done == {"_blocks", "_scales"}:  # [E, out, in] -> the [E, in, out] the forward multiplies by
                blocks, scales = getattr(self, name + "_blocks"), getattr(self, name + "_scales")
                dense = dequantize_mxfp4(blocks.data, scales.data).transpose(1, 2)
                getattr(self, name).data.copy_(dense)
                blocks.data, scales.data = blocks.data.new_empty(0), scales.data.new_empty(0)  # their memory back

        return load

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """This rank's partial sum [T, H] (its intermediate slice; the down bias on rank 0 only)."""
        if self.expert_load is not None:
            flat = ids.reshape(-1)
            self.expert_load.index_add_(0, flat, torch.ones_like(flat))
        out = torch.zeros_like(x)
        for expert in ids.unique().tolist():
            rows, slot = torch.where(ids == expert)
            gate_up = x[rows] @ self.gate_up_proj[expert] + self.gate_up_proj_bias[expert]
            gate, up = gate_up[..., ::2].clamp(max=self.limit), gate_up[..., 1::2].clamp(-self.limit, self.limit)
            y = ((up + 1) * (gate * torch.sigmoid(gate * self.alpha))) @ self.down_proj[expert]
            if self.tp_rank == 0:
                y = y + self.down_proj_bias[expert]
            out.index_add_(0, rows, (y * weights[rows, slot, None]).to(x.dtype))
        return out


class GptOssMoE(nn.Module):
    def __init__(self, cfg: ModelConfig, quant_config: QuantizationConfig | None, prefix: str) -> None:
        super().__init__()
        self.top_k = cfg.moe.top_k
        self.tp_group = get_tp_group()
        self.router = ReplicatedLinear(cfg.hidden_size, cfg.moe.num_experts, bias=True, prefix=f"{prefix}.router")
        self.experts = GptOssExperts(cfg, f"{prefix}.experts", mxfp4=quant_config is not None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        top_logits, ids = torch.topk(self.router(x), self.top_k, dim=-1)
        weights = F.softmax(top_logits, dim=1, dtype=top_logits.dtype)  # over the chosen experts' logits only
        return self.tp_group.all_reduce(self.experts(x, weights, ids))


class GptOssDecoderLayer(MoEDecoderLayer):  # every layer is sparse
    attention_cls = GptOssAttention
    sparse_block_cls = GptOssMoE


class GptOssForCausalLM(MoEForCausalLM):
    decoder_layer_cls = GptOssDecoderLayer

    def __init__(self, cfg: ModelConfig, quant_config: QuantizationConfig | None = None) -> None:
        if quant_config is not None and quant_config.name != "mxfp4":
            raise ValueError(f"quantization: {quant_config.name} is not supported for {cfg.architecture} yet (its "
                             "experts run in float); serve a float or an MXFP4 checkpoint (dequantized at load)")
        if cfg.moe.expert_parallel:
            raise ValueError(f"enable_expert_parallel: {cfg.architecture}'s experts are split by their intermediate "
                             "features under tensor parallelism, not partitioned; leave it off")
        super().__init__(cfg, quant_config)

    @staticmethod
    def checkpoint_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
        """A Hugging Face gpt-oss checkpoint's tensors (float experts, fused per layer)."""
        moe, h, d = cfg.moe, cfg.hidden_size, cfg.head_dim
        e, i = moe.num_experts, moe.intermediate_size
        q, kv = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
        shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg.vocab_size, h)}
        for n in range(cfg.num_hidden_layers):
            a, m = f"model.layers.{n}.self_attn.", f"model.layers.{n}.mlp."
            shapes |= {f"model.layers.{n}.input_layernorm.weight": (h,),
                       f"model.layers.{n}.post_attention_layernorm.weight": (h,),
                       a + "q_proj.weight": (q, h), a + "q_proj.bias": (q,), a + "k_proj.weight": (kv, h),
                       a + "k_proj.bias": (kv,), a + "v_proj.weight": (kv, h), a + "v_proj.bias": (kv,),
                       a + "o_proj.weight": (h, q), a + "o_proj.bias": (h,), a + "sinks": (cfg.num_attention_heads,),
                       m + "router.weight": (e, h), m + "router.bias": (e,),
                       m + "experts.gate_up_proj": (e, h, 2 * i), m + "experts.gate_up_proj_bias": (e, 2 * i),
                       m + "experts.down_proj": (e, i, h), m + "experts.down_proj_bias": (e, h)}
        shapes["model.norm.weight"] = (h,)
        shapes["lm_head.weight"] = (cfg.vocab_size, h)
        return shapes
