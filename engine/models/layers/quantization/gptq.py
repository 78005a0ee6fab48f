"""GPTQ checkpoints (AutoGPTQ / GPTQModel), 4 and 8 bit, symmetric or not, with or without act-order.

Per linear layer (N outputs, K inputs, G groups): `qweight` int32 [K / f, N] packed along the input,
f = 32 / bits values per int32, value i of a word in bits [bits * i, bits * (i + 1)); `qzeros` int32
[G, N / f] packed along the output the same way; `scales` [G, N]; `g_idx` int32 [K], the group of each
input column (k // group_size unless desc_act). W[n, k] = scales[g, n] * (q[k, n] - z[g, n]), g = g_idx[k].
The v1 format (`checkpoint_format: gptq`, AutoGPTQ's) stores z - 1; v2 (`gptq_v2`) stores z."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from engine.models.layers.quantization.base import QuantizationConfig, QuantMethod
from engine.models.layers.quantization.weight_only import (
    QuantizedWeight,
    WeightOnlyMethod,
    check_packing,
    g_idx_param,
    loaded_g_idx,
    num_groups,
    quant_param,
    unpack_int32,
)


class GPTQConfig(QuantizationConfig):
    name = "gptq"

    def __init__(self, bits: int, group_size: int, v1: bool, skip: list[str]) -> None:
        self.bits, self.group_size, self.v1, self.skip = bits, group_size, v1, skip

    @classmethod
    def from_config(cls, raw: dict[str, Any]) -> GPTQConfig:
        bits = raw.get("bits", 4)
        if bits not in (4, 8):
            raise ValueError(f"model: quantization_config.bits={bits} (gptq) is not supported; 4 and 8 are")
        fmt = raw.get("checkpoint_format") or raw.get("format") or "gptq"
        if fmt not in ("gptq", "gptq_v2"):
            raise ValueError(f"model: quantization_config.checkpoint_format={fmt!r} (gptq) is not supported; "
                             "'gptq' and 'gptq_v2' are")
        if raw.get("dynamic"):
            raise ValueError("model: quantization_config.dynamic (gptq per-module overrides) is not supported")
        if raw.get("lm_head"):
            raise ValueError("model: quantization_config.lm_head=true (a gptq-quantized LM head) is not supported")
        group_size = raw.get("group_size", 128)
        if group_size != -1 and group_size <= 0:
            raise ValueError(f"model: quantization_config.group_size={group_size} (gptq) must be positive or -1")
        return cls(bits, group_size, fmt == "gptq", list(raw.get("modules_to_not_convert") or []))

    def get_quant_method(self, layer: nn.Module, prefix: str) -> QuantMethod | None:
        return None if self.is_skipped(prefix, self.skip) else GPTQLinearMethod(self)


class GPTQLinearMethod(WeightOnlyMethod):
    def __init__(self, config: GPTQConfig) -> None:
        self.config = config

    def create_weights(self, layer, input_size_per_partition, output_partition_sizes, params_dtype) -> None:
        f = 32 // self.config.bits
        n, k, g = sum(output_partition_sizes), input_size_per_partition, num_groups(layer, self.config.group_size)
        check_packing(layer, [k], f, "input features")
        check_packing(layer, output_partition_sizes, f, "output features")
        quant_param(layer, "qweight", (k // f, n), torch.int32, input_dim=0, output_dim=1, packed_dim=0, pack_factor=f)
        quant_param(layer, "qzeros", (g, n // f), torch.int32, output_dim=1, packed_dim=1, pack_factor=f)
        quant_param(layer, "scales", (g, n), torch.float32, output_dim=1)
        g_idx_param(layer, "g_idx")

    def quantized_weight(self, layer: nn.Module) -> QuantizedWeight:
        bits = self.config.bits
        zeros = unpack_int32(layer.qzeros.data, bits, 1)
        if self.config.v1:
            zeros = zeros + 1  # AutoGPTQ's off-by-one, undone as its own dequantization does
        group_size = self.config.group_size if self.config.group_size > 0 else layer.input_size
        return QuantizedWeight(unpack_int32(layer.qweight.data, bits, 0).T, layer.scales.data, zeros,
                               loaded_g_idx(layer, layer.g_idx, group_size), bits)
