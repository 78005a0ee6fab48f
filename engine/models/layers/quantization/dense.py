"""The dense (unquantized) linear method. On CPU its weights are prepacked once after loading (ops/cpu/
linear.py: float32 into panels for our kernel, bfloat16 into panels or for oneDNN; each beat plain sgemm at
decode batch sizes); elsewhere, and for shapes neither takes, F.linear."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.models.layers.quantization.base import QuantMethod, set_weight_attrs
from ops.cpu.decode_stack import Projection
from ops.cpu.linear import pack_weight, packed_linear


class DenseLinearMethod(QuantMethod):
    def create_weights(self, layer, input_size_per_partition, output_partition_sizes, params_dtype) -> None:
        weight = nn.Parameter(torch.empty(sum(output_partition_sizes), input_size_per_partition, dtype=params_dtype),
                              requires_grad=False)
        set_weight_attrs(weight, {"output_dim": 0, "input_dim": 1})
        layer.register_parameter("weight", weight)

    def process_weights_after_loading(self, layer: nn.Module, batch_size_hint: int) -> None:
        weight = layer.weight
        packed = pack_weight(weight, batch_size_hint) if weight.device.type == "cpu" else None
        if packed is None:
            return
        layer.register_buffer("packed_weight", packed)
        # Kept where it is read elsewhere too: a tied LM head's is the embedding's; MLA's decode reads kv_b_proj's.
        if not getattr(layer, "keeps_weight", False):
            del layer.weight

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        packed = getattr(layer, "packed_weight", None)
        if packed is not None:
            return packed_linear(x, packed, bias)
        return F.linear(x, layer.weight, bias)

    def decode_projection(self, layer: nn.Module) -> Projection | None:
        packed = getattr(layer, "packed_weight", None)
        kernel = {3: "float32", 4: "bfloat16"}.get(packed.dim()) if packed is not None else None  # not oneDNN's
        return Projection(kernel, packed) if kernel else None
