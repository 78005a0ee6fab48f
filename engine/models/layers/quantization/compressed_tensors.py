"""compressed-tensors checkpoints (llm-compressor): weight-only integer schemes in the `pack-quantized`
format, 4 or 8 bit (W4A16, W8A16), per channel or per group, symmetric or not, act-order groups; and W8A8 in
the `int-quantized` format (int8 weights per channel or per tensor, symmetric; activations int8, dynamic per
token, symmetric: w8a8.py computes it).

Per linear layer: `weight_packed` int32 [N, K * bits / 32], values packed along the input lowest bits
first, each stored as its signed value + 2**(bits-1); `weight_scale` [N, G]; `weight_zero_point` int32
[N * bits / 32, G] packed along the output, likewise offset (asymmetric only); `weight_g_idx` int32 [K]
(actorder: group); `weight_shape` [2]. W[n, k] = weight_scale[n, g] * (q[n, k] - z[n, g]) with z =
2**(bits-1) when symmetric. W8A8: `weight` int8 [N, K] and `weight_scale` [N, 1] (or one value): W = scale * q.
Other schemes that quantize activations (static scales, FP8, 4-bit activations...) are refused."""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn

from engine.models.layers.quantization.base import QuantizationConfig, QuantMethod
from engine.models.layers.quantization.w8a8 import W8A8Method
from engine.models.layers.quantization.weight_only import (
    QuantizedWeight,
    WeightOnlyMethod,
    check_packing,
    contiguous_g_idx,
    g_idx_param,
    loaded_g_idx,
    num_groups,
    quant_param,
    row_scale_loader,
    unpack_int32,
)


class WeightScheme:
    """One config group's weight arguments, checked."""

    def __init__(self, targets: list[str], weights: dict[str, Any], where: str, w8a8: bool = False) -> None:
        self.targets, self.w8a8 = targets, w8a8
        self.bits = weights.get("num_bits")
        self.strategy = weights.get("strategy")
        self.symmetric = weights.get("symmetric", True)
        self.group_size = weights.get("group_size") if self.strategy == "group" else -1
        self.act_order = weights.get("actorder") in ("group", "dynamic")
        if weights.get("type", "int") != "int" or self.bits not in (4, 8):
            raise ValueError(f"model: quantization_config.{where}.weights: type={weights.get('type')!r} num_bits="
                             f"{self.bits} (compressed-tensors) is not supported; int with 4 or 8 bits is")
        if w8a8:
            if self.bits != 8 or not self.symmetric or self.strategy not in ("channel", "tensor"):
                raise ValueError(f"model: quantization_config.{where}.weights: num_bits={self.bits} symmetric="
                                 f"{self.symmetric} strategy={self.strategy!r} with int8 activations is not supported; "
                                 "W8A8 takes 8-bit symmetric weights per channel or per tensor")
        elif self.strategy not in ("channel", "group") or (self.strategy == "group" and not self.group_size):
            raise ValueError(f"model: quantization_config.{where}.weights.strategy={self.strategy!r} "
                             "(compressed-tensors) is not supported; channel and group are")
        if weights.get("dynamic"):
            raise ValueError(f"model: quantization_config.{where}.weights.dynamic=true is not supported")


class CompressedTensorsConfig(QuantizationConfig):
    name = "compressed-tensors"

    def __init__(self, schemes: list[WeightScheme], ignore: list[str]) -> None:
        self.schemes, self.ignore = schemes, ignore

    @classmethod
    def from_config(cls, raw: dict[str, Any]) -> CompressedTensorsConfig:
        fmt = raw.get("format")
        schemes = []
        for name, group in (raw.get("config_groups") or {}).items():
            where = f"config_groups.{name}"
            group_format = group.get("format") or fmt
            w8a8 = bool(group.get("input_activations"))
            expected = "int-quantized" if w8a8 else "pack-quantized"
            if group_format != expected:
                raise ValueError(f"model: quantization_config.{where} format={group_format!r} (compressed-tensors) "
                                 f"is not supported {'with' if w8a8 else 'without'} input_activations; {expected} is")
            if group.get("output_activations"):
                raise ValueError(f"model: quantization_config.{where}.output_activations (quantized outputs) is not "
                                 "supported")
            if w8a8:
                _check_dynamic_int8_tokens(group["input_activations"], f"{where}.input_activations")
            if not group.get("weights"):
                raise ValueError(f"model: quantization_config.{where} has no weights scheme")
            schemes.append(WeightScheme(list(group.get("targets") or []), group["weights"], where, w8a8))
        if not schemes:
            raise ValueError("model: quantization_config.config_groups (compressed-tensors) is empty")
        if raw.get("kv_cache_scheme"):
            raise ValueError("model: quantization_config.kv_cache_scheme (a quantized KV cache) is not supported")
        return cls(schemes, list(raw.get("ignore") or []))

    def get_quant_method(self, layer: nn.Module, prefix: str) -> QuantMethod | None:
        if self.is_skipped(prefix, self.ignore):
            return None
        names = self.checkpoint_names(prefix)
        for scheme in self.schemes:
            hits = [any(_target_matches(name, t) for t in scheme.targets) for name in names]
            if all(hits):
                return CompressedTensorsW8A8Method() if scheme.w8a8 else CompressedTensorsWNA16Method(scheme)
            if any(hits):
                break
        raise ValueError(f"model: no quantization_config.config_groups entry of the compressed-tensors checkpoint "
                         f"covers all of {', '.join(names)}")


def _check_dynamic_int8_tokens(acts: dict[str, Any], where: str) -> None:
    """W8A8's activations: what w8a8.py computes, int8 per token, dynamic, symmetric."""
    found = {key: acts.get(key) for key in ("type", "num_bits", "strategy", "dynamic", "symmetric")}
    if found != {"type": "int", "num_bits": 8, "strategy": "token", "dynamic": True, "symmetric": True}:
        raise ValueError(f"model: quantization_config.{where} = {found} is not supported; int8 activations are, "
                         "quantized per token as they arrive (type int, num_bits 8, strategy token, dynamic true, "
                         "symmetric true)")


def _target_matches(name: str, target: str) -> bool:
    if target == "Linear":
        return True
    return re.match(target[3:], name) is not None if target.startswith("re:") else name == target


class CompressedTensorsWNA16Method(WeightOnlyMethod):
    def __init__(self, scheme: WeightScheme) -> None:
        self.scheme = scheme

    def create_weights(self, layer, input_size_per_partition, output_partition_sizes, params_dtype) -> None:
        s = self.scheme
        f = 32 // s.bits
        n, k, g = sum(output_partition_sizes), input_size_per_partition, num_groups(layer, s.group_size)
        check_packing(layer, [k], f, "input features")
        quant_param(layer, "weight_packed", (n, k // f), torch.int32, output_dim=0, input_dim=1, packed_dim=1,
                    pack_factor=f)
        quant_param(layer, "weight_scale", (n, g), torch.float32, output_dim=0)
        if not s.symmetric:
            check_packing(layer, output_partition_sizes, f, "output features")
            quant_param(layer, "weight_zero_point", (n // f, g), torch.int32, output_dim=0, packed_dim=0, pack_factor=f)
        if s.act_order:
            g_idx_param(layer, "weight_g_idx")
        shape = quant_param(layer, "weight_shape", (2,), torch.int64, optional=True)

        def check_shape(param: torch.Tensor, loaded, shard_id: int | None = None) -> None:
            if int(loaded.load()[1]) != layer.input_size:
                raise ValueError(f"says {layer.input_size} input features are {int(loaded.load()[1])}")

        shape.weight_loader = check_shape

    def quantized_weight(self, layer: nn.Module) -> QuantizedWeight:
        s = self.scheme
        scales = layer.weight_scale.data.T  # [G, N]
        if s.symmetric:
            zeros = torch.full(scales.shape, 1 << (s.bits - 1), dtype=torch.int32)
        else:
            zeros = unpack_int32(layer.weight_zero_point.data, s.bits, 0).T
        group_size = s.group_size if s.group_size > 0 else layer.input_size
        g_idx = (loaded_g_idx(layer, layer.weight_g_idx, group_size) if s.act_order
                 else contiguous_g_idx(layer, group_size))
        return QuantizedWeight(unpack_int32(layer.weight_packed.data, s.bits, 1), scales, zeros, g_idx, s.bits)


class CompressedTensorsW8A8Method(W8A8Method):
    def create_weights(self, layer, input_size_per_partition, output_partition_sizes, params_dtype) -> None:
        n = sum(output_partition_sizes)
        quant_param(layer, "weight", (n, input_size_per_partition), torch.int8, output_dim=0, input_dim=1)
        scale = quant_param(layer, "weight_scale", (n,), torch.float32)
        scale.weight_loader = row_scale_loader(layer)

    def int8_weight(self, layer: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
        return layer.weight.data, layer.weight_scale.data
