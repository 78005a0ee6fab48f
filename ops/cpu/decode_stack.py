"""A decode step through a stage's decoder layers in one call to decode_stack.cpp (its header says why), and for a
whole model from token ids to logits (`attach_head`). The model (engine/models/llama.py) decides which layers
qualify and hands over their tensors, each linear layer as its quant method describes it (`Projection`); this
builds the C++ stack over our other kernel modules, or returns None where one of them is missing (no compiler)."""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from ops.cpu import load_cpu_kernels, load_decode_stack, load_elementwise_kernels, load_linear_kernels

# decode_stack.cpp's kernels, by the module that exports each one's capsule (`<name>_kernel`)
_LINEAR_KERNELS = ("float32_linear", "bfloat16_linear", "w8a8_linear", "w4a8_linear")
_ELEMENTWISE_KERNELS = ("rms_norm", "rotary_neox", "silu_and_mul")
_ATTENTION_KERNELS = ("store_kv", "paged_decode_attention")


@dataclass(frozen=True)
class Projection:
    """A linear layer as decode_stack.cpp computes it: `kernel`, one of panel_linear.cpp's float32, bfloat16, w8a8
    or w4a8 linear kernels, over `weight` (and `scales`, `group`) as ops/cpu/linear.py and quant_linear.py pack them,
    plus a float32 `bias`."""

    kernel: str
    weight: torch.Tensor
    scales: torch.Tensor | None = None
    group: int = 0
    bias: torch.Tensor | None = None


@dataclass(frozen=True)
class DecodeLayer:
    """One decoder layer: its norms in the model's dtype, its projections, and its KV cache [num_blocks, 2,
    block_size, kv_heads, head_dim]. decode_stack.cpp takes the fields in this order."""

    input_norm: torch.Tensor
    qkv: Projection
    o: Projection
    post_norm: torch.Tensor
    gate_up: Projection
    down: Projection
    kv_cache: torch.Tensor


def _as_tuple(item) -> tuple:
    # not dataclasses.astuple: that deep-copies every tensor
    values = (getattr(item, f.name) for f in fields(item))
    return tuple(_as_tuple(v) if isinstance(v, Projection) else v for v in values)


def build_decode_stack(layers: list[DecodeLayer], cos: torch.Tensor, sin: torch.Tensor, eps: float, scale: float,
                       hidden_size: int, intermediate_size: int, num_heads: int, num_kv_heads: int, head_dim: int):
    """decode_stack.cpp's DecodeStack over `layers` (neox rotary from cos and sin [max_position, head_dim / 2]
    float32), whose forward(x, residual, positions, block_tables, seq_lens, k_rows) returns (x, residual) after
    the last layer; None without the kernels."""
    stack, linear, elementwise, attention = (load_decode_stack(), load_linear_kernels(), load_elementwise_kernels(),
                                             load_cpu_kernels())
    if None in (stack, linear, elementwise, attention) or not layers:
        return None
    kernels = {name: getattr(module, f"{name}_kernel") for module, names in
               ((linear, _LINEAR_KERNELS), (elementwise, _ELEMENTWISE_KERNELS), (attention, _ATTENTION_KERNELS))
               for name in names}
    return stack.DecodeStack(kernels, [_as_tuple(layer) for layer in layers], cos, sin, eps, scale, hidden_size,
                             intermediate_size, num_heads, num_kv_heads, head_dim)


def attach_head(stack, embedding: torch.Tensor, norm: torch.Tensor, eps: float, lm_head: Projection,
                vocab_size: int) -> None:
    """Give `stack` what its logits(input_ids, positions, block_tables, seq_lens, slot_mapping, block_size) adds
    around the layers: the embedding table [rows, hidden], the final RMSNorm's weight and eps (all in the layers'
    dtype), and the LM head, whose first `vocab_size` output columns are the logits."""
    stack.set_head(embedding, norm, eps, _as_tuple(lm_head), vocab_size)
