"""AWQ checkpoints (AutoAWQ, GEMM packing): 4 bit, asymmetric, groups along the input.

Per linear layer: `qweight` int32 [K, N / 8] packed along the output, `qzeros` int32 [G, N / 8] likewise,
`scales` [G, N]. Inside each int32 the eight columns are interleaved: nibble i (bits 4i..4i+3) holds
column AWQ_PACK_ORDER[i] of its run of eight. W[n, k] = scales[k // g, n] * (q[k, n] - z[k // g, n])."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from engine.models.layers.quantization.base import QuantizationConfig, QuantMethod
from engine.models.layers.quantization.weight_only import (
    QuantizedWeight,
    WeightOnlyMethod,
    check_packing,
    contiguous_g_idx,
    num_groups,
    quant_param,
    unpack_int32,
)

AWQ_PACK_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]
AWQ_UNPACK_ORDER = [AWQ_PACK_ORDER.index(i) for i in range(8)]  # [0, 4, 1, 5, 2, 6, 3, 7]


class AWQConfig(QuantizationConfig):
    name = "awq"

    def __init__(self, group_size: int, skip: list[str]) -> None:
        self.group_size, self.skip = group_size, skip

    @classmethod
    def from_config(cls, raw: dict[str, Any]) -> AWQConfig:
        bits = raw.get("bits", raw.get("w_bit", 4))
        if bits != 4:
            raise ValueError(f"model: quantization_config.bits={bits} (awq) is not supported; 4 is")
        version = str(raw.get("version") or raw.get("format") or "gemm").lower()
        if version != "gemm":
            raise ValueError(f"model: quantization_config.version={version!r} (awq) is not supported; 'gemm' is")
        if not raw.get("zero_point", True):
            raise ValueError("model: quantization_config.zero_point=false (awq) is not supported")
        group_size = raw.get("group_size", raw.get("q_group_size", 128))
        if group_size <= 0:
            raise ValueError(f"model: quantization_config.group_size={group_size} (awq) must be positive")
        return cls(group_size, list(raw.get("modules_to_not_convert") or []))

    def get_quant_method(self, layer: nn.Module, prefix: str) -> QuantMethod | None:
        return None if self.is_skipped(prefix, self.skip) else AWQLinearMethod(self)


class AWQLinearMethod(WeightOnlyMethod):
    def __init__(self, config: AWQConfig) -> None:
        self.config = config

    def create_weights(self, layer, input_size_per_partition, output_partition_sizes, params_dtype) -> None:
        n, k, g = sum(output_partition_sizes), input_size_per_partition, num_groups(layer, self.config.group_size)
        check_packing(layer, output_partition_sizes, 8, "output features")
        quant_param(layer, "qweight", (k, n // 8), torch.int32, input_dim=0, output_dim=1, packed_dim=1, pack_factor=8)
        quant_param(layer, "qzeros", (g, n // 8), torch.int32, output_dim=1, packed_dim=1, pack_factor=8)
        quant_param(layer, "scales", (g, n), torch.float32, output_dim=1)

    def quantized_weight(self, layer: nn.Module) -> QuantizedWeight:
        q = unpack_awq(layer.qweight.data)  # [K, N]
        zeros = unpack_awq(layer.qzeros.data)
        return QuantizedWeight(q.T, layer.scales.data, zeros, contiguous_g_idx(layer, self.config.group_size), 4)


def unpack_awq(packed: torch.Tensor) -> torch.Tensor:
    """int32 [R, C / 8] -> [R, C] in column order."""
    values = unpack_int32(packed, 4, 1)
    rows, cols = values.shape
    return values.view(rows, cols // 8, 8)[..., AWQ_UNPACK_ORDER].reshape(rows, cols)
