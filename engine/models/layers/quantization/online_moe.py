"""Online int8 / int4 / w8a8 for mixture-of-experts layers (`EngineConfig.quantization` on an MoE checkpoint): each
expert's gate_up and down projections quantized by the linear layers' schemes (engine/models/layers/
quantization/online.py: int8 per row, int4 per group of a row's inputs; w8a8: int8's weights), then multiplied
expert by expert through the same quantized kernels (weight-only ones dequantized once to float32 instead where
a linear layer's would be: no kernel for the device, or no compiler).

Tensor parallelism slices each expert's intermediate dim: down's rows are split across ranks, so int8 takes
each row's maximum over the group and int4's groups must not straddle two ranks, as for row-parallel linear
layers. Expert parallelism holds whole experts. The router stays unquantized (its layer has no quant config)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.models.layers.fused_moe import DenseFusedMoEMethod, FusedMoE, FusedMoEMethod
from engine.models.layers.quantization.online import int4_group_size, quantize_int4, quantize_int8
from engine.models.layers.quantization.w8a8 import w8a8_apply, w8a8_weight
from engine.models.layers.quantization.weight_only import QuantizedWeight, kernel_form, select_compute
from ops.cpu.quant_linear import int4_linear, int8_linear

# Each fused projection, and whether tensor parallelism splits its rows' inputs (down: row-parallel).
_PROJECTIONS = (("w13", False), ("w2", True))


class OnlineQuantMoEMethod(FusedMoEMethod):
    def __init__(self, scheme: str) -> None:
        self.scheme = scheme

    def create_weights(self, layer, num_local_experts, hidden_size, intermediate_size_per_partition,
                       params_dtype) -> None:
        # The checkpoint is dense: load it as the dense method does, quantize after loading.
        DenseFusedMoEMethod().create_weights(layer, num_local_experts, hidden_size, intermediate_size_per_partition,
                                             params_dtype)
        inputs = intermediate_size_per_partition * (layer.tp_size if layer.intermediate_sliced else 1)
        if self.scheme == "int4" and intermediate_size_per_partition % int4_group_size(inputs):
            raise ValueError(f"quantization: 'int4' groups {layer.prefix}'s down projection's {inputs} inputs by "
                             f"{int4_group_size(inputs)}, which does not divide the {intermediate_size_per_partition} "
                             "each rank holds; use another tensor_parallel_size, expert parallelism or 'int8'")

    def process_weights_after_loading(self, layer: FusedMoE, batch_size_hint: int) -> None:
        computes = []
        for name, row_parallel in _PROJECTIONS:
            weight = getattr(layer, f"{name}_weight").data  # [E, N, K]
            delattr(layer, f"{name}_weight")
            experts = self._quantize(layer, weight, row_parallel and layer.intermediate_sliced)
            compute = "w8a8" if self.scheme == "w8a8" else select_compute(experts[0], weight.device)
            if compute == "w8a8":  # the linear layers' W8A8 weights (w8a8.py), stacked over experts
                layer.register_buffer(f"{name}_w8a8_weight", torch.stack([w8a8_weight(qw.q - 128) for qw in experts]))
                layer.register_buffer(f"{name}_weight_scales", torch.stack([qw.scales[0].float() for qw in experts]))
            elif compute == "dense":
                layer.register_buffer(f"{name}_weight",
                                      torch.stack([qw.dequantize().to(weight.dtype) for qw in experts]))
            else:  # the linear layers' kernel form, stacked over experts (contiguous groups: input_perm is None)
                forms = [kernel_form(qw, compute) for qw in experts]
                for key, value in forms[0].items():
                    if isinstance(value, torch.Tensor):
                        layer.register_buffer(f"{name}_{key}", torch.stack([form[key] for form in forms]))
                    else:
                        setattr(layer, f"{name}_{key}", value)
            setattr(layer, f"{name}_compute", compute)
            computes.append(compute)
        layer.expert_compute = "+".join(dict.fromkeys(computes))  # e.g. "int8", "int4", "dense"

    def _quantize(self, layer: FusedMoE, weight: torch.Tensor, sliced: bool) -> list[QuantizedWeight]:
        """Every local expert's [N, K] projection in the scheme; `sliced`: K is this rank's part of each row."""
        if self.scheme in ("int8", "w8a8"):
            absmax = weight.float().abs().amax(dim=-1)  # [E, N]
            if sliced:  # the whole row's maximum, in one all-reduce for every expert
                absmax = layer.tp_group.all_reduce_max(absmax)
            return [quantize_int8(w, m) for w, m in zip(weight, absmax)]
        k = weight.shape[-1]
        group = int4_group_size(k * layer.tp_size if sliced else k)
        g_idx = (torch.arange(k) + (layer.tp_rank * k if sliced else 0)) // group
        return [quantize_int4(w, group, g_idx) for w in weight]

    def apply(self, layer: FusedMoE, x: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        out = x.new_empty(x.shape[0], layer.hidden_size)
        start = 0
        for e, end in enumerate(offsets.tolist()):  # one device sync for the whole loop
            if end > start:
                gate, up = _linear(layer, "w13", e, x[start:end]).chunk(2, dim=-1)
                out[start:end] = _linear(layer, "w2", e, F.silu(gate) * up)
            start = end
        return out


def _linear(layer: FusedMoE, name: str, expert: int, x: torch.Tensor) -> torch.Tensor:
    def get(key: str):
        return getattr(layer, f"{name}_{key}")

    compute = get("compute")
    if compute == "int8":
        return int8_linear(x, get("int8_weight")[expert], get("weight_scales")[expert], None)
    if compute == "w8a8":
        return w8a8_apply(get("w8a8_weight")[expert], get("weight_scales")[expert], x, None)
    if compute == "int4":
        return int4_linear(x, get("int4_weight")[expert], get("int4_params")[expert], get("group_size"),
                           get("out_features"), None)
    return F.linear(x, get("weight")[expert])
