"""FP8 checkpoints (`quant_method: fp8`: DeepSeek-V3 and Qwen3-FP8 block scales, per-tensor and
per-channel scales), dequantized once at load to the compute dtype: CPUs have no FP8 arithmetic, and a
dequantized float32 layer runs the dense path. The checkpoint's activation scheme (dynamic or static) is
a GPU matter: here activations stay in the compute dtype (FP8 weights, 16/32-bit activations: W8A16).

Per linear layer: `weight` float8_e4m3fn [N, K] and either `weight_scale_inv` [ceil(N / bn), ceil(K / bk)]
(block [bn, bk] = weight_block_size: W = weight * scale of its tile) or `weight_scale`: one value per
tensor (per sub-projection of a fused layer) or one per output row. A static `input_scale` is read and
unused. Experts with block scales: fp8_moe.py."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from engine.models.layers.fused_moe import FusedMoE
from engine.models.layers.quantization.base import QuantizationConfig, QuantMethod
from engine.models.layers.quantization.dense import DenseLinearMethod
from engine.models.layers.quantization.fp8_moe import Fp8BlockFusedMoEMethod
from engine.models.layers.quantization.weight_only import quant_param, row_scale_loader

_DENSE = DenseLinearMethod()  # the dequantized weight computes as a dense layer


class Fp8Config(QuantizationConfig):
    name = "fp8"

    def __init__(self, block: tuple[int, int] | None, skip: list[str]) -> None:
        self.block, self.skip = block, skip

    @classmethod
    def from_config(cls, raw: dict[str, Any]) -> Fp8Config:
        fmt = raw.get("fmt", "e4m3")
        if fmt != "e4m3":
            raise ValueError(f"model: quantization_config.fmt={fmt!r} (fp8) is not supported; e4m3 is")
        if raw.get("activation_scheme", "dynamic") not in ("dynamic", "static"):
            raise ValueError(f"model: quantization_config.activation_scheme={raw['activation_scheme']!r} (fp8) is "
                             "not supported")
        if raw.get("kv_cache_scheme"):
            raise ValueError("model: quantization_config.kv_cache_scheme (an FP8 KV cache) is not supported")
        block = raw.get("weight_block_size")
        if block is not None and (len(block) != 2 or min(block) <= 0):
            raise ValueError(f"model: quantization_config.weight_block_size={block} (fp8) must be two positive sizes")
        skip = list(raw.get("modules_to_not_convert") or []) + list(raw.get("ignored_layers") or [])
        return cls(tuple(block) if block else None, skip)

    def get_quant_method(self, layer: nn.Module, prefix: str) -> QuantMethod | None:
        if self.is_skipped(prefix, self.skip):
            return None
        if isinstance(layer, FusedMoE):
            if self.block is None:
                raise ValueError(f"quantization: fp8 experts without weight_block_size ({prefix}) are not supported; "
                                 "block-quantized ones (DeepSeek-V3's format) are")
            return Fp8BlockFusedMoEMethod(self.block)
        return Fp8LinearMethod(self)


class Fp8LinearMethod(QuantMethod):
    def __init__(self, config: Fp8Config) -> None:
        self.block = config.block

    def create_weights(self, layer, input_size_per_partition, output_partition_sizes, params_dtype) -> None:
        n, k = sum(output_partition_sizes), input_size_per_partition
        quant_param(layer, "weight", (n, k), torch.float8_e4m3fn, output_dim=0, input_dim=1)
        if self.block is not None:
            bn, bk = self.block
            split = layer.tp_size > 1 or len(output_partition_sizes) > 1
            if split and any(size % bn for size in output_partition_sizes):
                raise ValueError(f"model: {layer.prefix}: output partitions {output_partition_sizes} are not multiples "
                                 f"of quantization_config.weight_block_size[0]={bn}; use another tensor_parallel_size")
            if k != layer.input_size and k % bk:
                raise ValueError(f"model: {layer.prefix}: {k} input features per rank are not a multiple of "
                                 f"quantization_config.weight_block_size[1]={bk}; use another tensor_parallel_size")
            # Along the output, one scale row per bn rows: the layer's loader slices it in those units.
            quant_param(layer, "weight_scale_inv", (-(-n // bn), -(-k // bk)), torch.float32, output_dim=0, input_dim=1,
                        packed_dim=0, pack_factor=bn)
        else:
            scale = quant_param(layer, "weight_scale", (n,), torch.float32)
            scale.weight_loader = row_scale_loader(layer)
        input_scale = quant_param(layer, "input_scale", (len(output_partition_sizes),), torch.float32, optional=True)
        input_scale.weight_loader = lambda param, loaded, shard_id=None: None  # activations stay unquantized

    def process_weights_after_loading(self, layer: nn.Module, batch_size_hint: int) -> None:
        weight = layer.weight.data.float()
        if self.block is not None:
            bn, bk = self.block
            n, k = weight.shape
            scale = layer.weight_scale_inv.data.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
            del layer.weight_scale_inv
        else:
            scale = layer.weight_scale.data[:, None]
            del layer.weight_scale
        del layer.weight, layer.input_scale
        layer.weight = nn.Parameter((weight * scale).to(layer.params_dtype), requires_grad=False)
        _DENSE.process_weights_after_loading(layer, batch_size_hint)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return _DENSE.apply(layer, x, bias)
