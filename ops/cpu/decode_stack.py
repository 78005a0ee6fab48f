"""A decode step through a stage's decoder layers in one call to decode_stack.cpp (its header says why). The model
(engine/models/llama.py) decides which layers qualify and hands over their tensors; this builds the C++ stack over
our other kernel modules, or returns None where one of them is missing (no compiler)."""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from ops.cpu import load_cpu_kernels, load_decode_stack, load_elementwise_kernels, load_linear_kernels


@dataclass(frozen=True)
class DecodeLayer:
    """One decoder layer's tensors: weights as ops/cpu/linear.py packs them (float32 panels [P, K, 16] or bfloat16
    pair panels [P, K / 2, 16, 2], every output feature a panel row), float32 biases, norms in the model's dtype,
    and the layer's KV cache [num_blocks, 2, block_size, kv_heads, head_dim]. decode_stack.cpp takes the fields in
    this order."""

    input_norm: torch.Tensor
    qkv: torch.Tensor
    qkv_bias: torch.Tensor | None
    o: torch.Tensor
    o_bias: torch.Tensor | None
    post_norm: torch.Tensor
    gate_up: torch.Tensor
    gate_up_bias: torch.Tensor | None
    down: torch.Tensor
    down_bias: torch.Tensor | None
    kv_cache: torch.Tensor


def build_decode_stack(layers: list[DecodeLayer], cos: torch.Tensor, sin: torch.Tensor, eps: float, scale: float,
                       num_heads: int, num_kv_heads: int, head_dim: int):
    """decode_stack.cpp's DecodeStack over `layers` (neox rotary from cos and sin [max_position, head_dim / 2]
    float32), whose forward(x, residual, positions, block_tables, seq_lens, k_rows) returns (x, residual) after
    the last layer; None without the kernels, or where the weights are neither all float32 nor all bfloat16
    panels."""
    modules = load_decode_stack(), load_linear_kernels(), load_elementwise_kernels(), load_cpu_kernels()
    if any(module is None for module in modules) or not layers:
        return None
    stack, linear, elementwise, attention = modules
    dims = {w.dim() for layer in layers for w in (layer.qkv, layer.o, layer.gate_up, layer.down)}
    if dims == {3}:
        kernel = linear.float32_linear_kernel
    elif dims == {4}:
        kernel = linear.bfloat16_linear_kernel
    else:
        return None
    tensors = [tuple(getattr(layer, f.name) for f in fields(layer)) for layer in layers]
    return stack.DecodeStack(kernel, elementwise.rms_norm_kernel, elementwise.rotary_neox_kernel,
                             elementwise.silu_and_mul_kernel, attention.store_kv_kernel,
                             attention.paged_decode_attention_kernel, tensors, cos, sin, eps, scale, num_heads,
                             num_kv_heads, head_dim)
