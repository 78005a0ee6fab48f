"""Online quantization of a dense checkpoint at load (`EngineConfig.quantization`: int8, int4 or w8a8) for every
linear projection inside the decoder layers and every expert of an MoE layer (online_moe.py; the embeddings,
the LM head and MoE routers stay in the compute dtype):

- int8: symmetric per output row: scale = max|w| of the row / 127, q = round(w / scale), |q| <= 127;
  error per weight <= scale / 2.
- int4: asymmetric per group of `group_size` input columns of a row (128, or the largest power of two
  dividing the input size when smaller): the group's range [min(w, 0), max(w, 0)] in 15 steps, scale =
  range / 15, zero point z = round(-min / scale), q = clamp(round(w / scale) + z, 0, 15); error per weight
  <= scale / 2. Asymmetric (like GPTQ and AWQ, unlike llama.cpp's q4_0) because a 4-bit grid is coarse
  enough for its offset to matter.
- w8a8: int8's weights; activations quantized per token as they arrive (w8a8.py states its contract).

The loaded weight is this rank's partition. Row-parallel ranks hold a slice of each row: int8 takes the
row's maximum over the tensor-parallel group, and int4's groups must not straddle two ranks, so that every
layout quantizes to the same numbers."""

from __future__ import annotations

import torch
from torch import nn

from engine.models.layers.quantization.w8a8 import W8A8Method
from engine.models.layers.quantization.weight_only import (
    QuantizedWeight,
    WeightOnlyMethod,
    contiguous_g_idx,
    quant_param,
)

INT4_MAX_GROUP = 128


def int4_group_size(input_size: int) -> int:
    return min(INT4_MAX_GROUP, input_size & -input_size)  # the largest power of two dividing input_size


def quantize_int8(weight: torch.Tensor, row_absmax: torch.Tensor | None = None) -> QuantizedWeight:
    """weight [N, K] -> its int8 form; `row_absmax` is the whole row's max|w| when `weight` holds a slice."""
    w = weight.float()
    absmax = w.abs().amax(dim=1) if row_absmax is None else row_absmax
    scale = torch.where(absmax > 0, absmax / 127, torch.ones_like(absmax))
    q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int32) + 128
    return QuantizedWeight(q, scale[None, :], torch.full((1, w.shape[0]), 128, dtype=torch.int32),
                           torch.zeros(w.shape[1], dtype=torch.long), 8)


def quantize_int4(weight: torch.Tensor, group_size: int, g_idx: torch.Tensor | None = None) -> QuantizedWeight:
    """weight [N, K] -> its int4 form in groups of `group_size` consecutive columns (K % group_size == 0);
    `g_idx` numbers the groups when `weight` is a slice of the layer's inputs."""
    w = weight.float()
    n, k = w.shape
    groups = w.view(n, k // group_size, group_size)
    low, high = groups.amin(-1).clamp(max=0), groups.amax(-1).clamp(min=0)
    scale = (high - low) / 15
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    zero = torch.round(-low / scale).clamp(0, 15)
    q = (torch.round(groups / scale[..., None]) + zero[..., None]).clamp(0, 15).to(torch.int32).view(n, k)
    if g_idx is None:
        g_idx = torch.arange(k) // group_size
    first = int(g_idx[0])  # scales of this slice's groups, placed at their layer-wide index
    scales = torch.ones(first + k // group_size, n)
    zeros = torch.zeros(first + k // group_size, n, dtype=torch.int32)
    scales[first:], zeros[first:] = scale.T, zero.T.to(torch.int32)
    return QuantizedWeight(q, scales, zeros, g_idx, 4)



def dense_weight_param(layer: nn.Module, input_size_per_partition: int, output_partition_sizes: list[int],
                       params_dtype: torch.dtype) -> None:
    """The dense checkpoint's weight, loaded as the dense method loads it, to be quantized after loading."""
    quant_param(layer, "weight", (sum(output_partition_sizes), input_size_per_partition), params_dtype,
                output_dim=0, input_dim=1)


def quantize_layer_int8(layer: nn.Module) -> QuantizedWeight:
    """The layer's loaded weight in int8; a row-parallel rank takes each row's maximum over the whole row."""
    weight = layer.weight.data
    absmax = weight.float().abs().amax(dim=1)
    if layer.input_size_per_partition != layer.input_size:
        absmax = layer.tp_group.all_reduce_max(absmax)
    return quantize_int8(weight, absmax)


class OnlineQuantMethod(WeightOnlyMethod):
    def __init__(self, scheme: str) -> None:
        self.scheme = scheme

    def create_weights(self, layer, input_size_per_partition, output_partition_sizes, params_dtype) -> None:
        dense_weight_param(layer, input_size_per_partition, output_partition_sizes, params_dtype)

    def quantized_weight(self, layer: nn.Module) -> QuantizedWeight:
        if self.scheme == "int8":
            return quantize_layer_int8(layer)
        group = int4_group_size(layer.input_size)
        return quantize_int4(layer.weight.data, group, contiguous_g_idx(layer, group))


class OnlineW8A8Method(W8A8Method):
    """`quantization: "w8a8"`: weights as online int8's, activations quantized per token (w8a8.py)."""

    def create_weights(self, layer, input_size_per_partition, output_partition_sizes, params_dtype) -> None:
        dense_weight_param(layer, input_size_per_partition, output_partition_sizes, params_dtype)

    def int8_weight(self, layer: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
        qw = quantize_layer_int8(layer)
        return qw.q - 128, qw.scales[0]
