"""W4A8, online and opt-in (`quantization: "w4a8"` on a dense checkpoint): int4 weights, symmetric per group of
input columns of a row (online int4's groups: 128, or the largest power of two dividing the input size when
smaller, at least 8; scale = max|w| of the group / 7, q = round(w / scale) in [-7, 7]), times int8
activations quantized per token as they arrive, as W8A8's (w8a8.py). The integer sums of a group are exact
(ops/cpu/quant_linear.py's w4a8_linear: nibbles widened to bytes in registers, vpdpbusd); each group's sum is
scaled once. Half W8A8's weight bytes; llama.cpp's q4_0 is its peer (int4 in blocks of 32 with int8
activations), which groups four times finer than our 128: a quarter of the scaling work per product.

Accuracy contract, per output: against x . w on the original weight, the error is at most sum_k |x_k| *
scale_g(k) / 2 (the weights) + (sx / 2) * sum_k |w_k| (the activations, as W8A8's), plus float32 rounding.
Row-parallel ranks must hold whole groups (refused at load otherwise). Where no kernel runs the same numbers
are computed by torch matmuls."""

from __future__ import annotations

import torch
from torch import nn

from engine.models.layers.quantization.base import QuantMethod
from engine.models.layers.quantization.online import int4_group_size
from engine.models.layers.quantization.weight_only import quant_kernels_available, quant_param
from ops.cpu.decode_stack import Projection
from ops.cpu.quant_linear import pack_w4a8, quantize_activations, w4a8_linear


def quantize_w4a8(weight: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] -> (q int8 [N, K] in [-7, 7], scales float32 [N, K / group])."""
    w = weight.float()
    n, k = w.shape
    groups = w.view(n, k // group, group)
    absmax = groups.abs().amax(-1)
    scales = torch.where(absmax > 0, absmax / 7, torch.ones_like(absmax))
    q = torch.round(groups / scales[..., None]).clamp(-7, 7).to(torch.int8).view(n, k)
    return q, scales


class OnlineW4A8Method(QuantMethod):
    def create_weights(self, layer, input_size_per_partition, output_partition_sizes, params_dtype) -> None:
        group = layer.w4a8_group = int4_group_size(layer.input_size)
        if group % 8 or input_size_per_partition % group:
            raise ValueError(f"quantization: 'w4a8' groups {layer.prefix}'s {layer.input_size} inputs by {group}, "
                             f"which is not a multiple of 8 or does not divide the {input_size_per_partition} each "
                             "rank holds; use another tensor_parallel_size, 'w8a8' or 'int4'")
        quant_param(layer, "weight", (sum(output_partition_sizes), input_size_per_partition), params_dtype,
                    output_dim=0, input_dim=1)

    def process_weights_after_loading(self, layer: nn.Module, batch_size_hint: int) -> None:
        q, scales = quantize_w4a8(layer.weight.data, layer.w4a8_group)
        del layer.weight
        layer.out_features = q.shape[0]
        if q.device.type == "cpu" and quant_kernels_available():
            packed, panel_scales = pack_w4a8(q, scales)
            layer.register_buffer("w4a8_weight", packed)
            layer.register_buffer("w4a8_scales", panel_scales)
        else:  # the reference: the dequantized weight, activations rounded in apply
            layer.register_buffer("w4a8_dequantized", q.float() * scales.repeat_interleave(layer.w4a8_group, 1))
        layer.compute = "w4a8"

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if hasattr(layer, "w4a8_weight"):
            return w4a8_linear(x, layer.w4a8_weight, layer.w4a8_scales, layer.w4a8_group, layer.out_features, bias)
        x2 = x.reshape(-1, x.shape[-1]).float()
        xq, x_scales = quantize_activations(x2)
        out = (xq.double() @ layer.w4a8_dequantized.double().T).float() * x_scales[:, None]
        if bias is not None:
            out += bias
        return out.to(x.dtype).view(*x.shape[:-1], layer.out_features)

    def decode_projection(self, layer: nn.Module) -> Projection | None:
        if not hasattr(layer, "w4a8_weight"):
            return None
        return Projection("w4a8", layer.w4a8_weight, layer.w4a8_scales, layer.w4a8_group)
