"""OnlineQuantConfig (`EngineConfig.quantization`: int8, int4, w8a8 or w4a8 on a dense checkpoint): which method
each layer gets: online.py's (w4a8.py's) for the decoder's linear projections, online_moe.py's for expert layers;
none elsewhere."""

from __future__ import annotations

from torch import nn

from engine.models.layers.fused_moe import FusedMoE
from engine.models.layers.quantization.base import QuantizationConfig, QuantMethod
from engine.models.layers.quantization.online import OnlineQuantMethod, OnlineW8A8Method, int4_group_size
from engine.models.layers.quantization.online_moe import OnlineQuantMoEMethod
from engine.models.layers.quantization.w4a8 import OnlineW4A8Method


class OnlineQuantConfig(QuantizationConfig):
    def __init__(self, name: str) -> None:
        self.name = name

    def get_quant_method(self, layer: nn.Module, prefix: str) -> QuantMethod | None:
        if ".layers." not in prefix:
            return None  # decoder projections only
        if isinstance(layer, FusedMoE):
            if self.name == "w4a8":
                raise ValueError(f"quantization: 'w4a8' has no method for MoE experts ({prefix}); use 'w8a8' or "
                                 "'int4'")
            return OnlineQuantMoEMethod(self.name)
        if self.name == "w4a8":
            return OnlineW4A8Method()
        if self.name == "int4":
            group = int4_group_size(layer.input_size)
            if layer.input_size_per_partition % group:
                raise ValueError(f"quantization: 'int4' groups {prefix}'s {layer.input_size} inputs by {group}, which "
                                 f"does not divide the {layer.input_size_per_partition} each rank holds; use another "
                                 "tensor_parallel_size or 'int8'")
        return OnlineW8A8Method() if self.name == "w8a8" else OnlineQuantMethod(self.name)
