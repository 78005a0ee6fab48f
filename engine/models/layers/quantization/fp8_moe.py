"""FP8 experts with block scales (DeepSeek-V3's release format: e4m3 weights, a float32 `weight_scale_inv`
per [bn, bk] tile of each expert's projection), dequantized once at load into the dense experts' layout, which
then run as DenseFusedMoEMethod's: CPUs have no FP8 arithmetic (see fp8.py for linear layers)."""

from __future__ import annotations

import torch
from torch import nn

from engine.models.checkpoint import CheckpointTensor
from engine.models.layers.fused_moe import EXPERT_PROJECTIONS, DenseFusedMoEMethod, FusedMoE
from engine.models.layers.linear import copy_checked
from engine.models.layers.quantization.base import set_weight_attrs


def dequantize_blocks(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """weight [..., n, k] (FP8) times the scale of its [bn, bk] tile (scale [..., ceil(n / bn), ceil(k / bk)])."""
    bn, bk = block
    n, k = weight.shape[-2:]
    full = scale.repeat_interleave(bn, -2)[..., :n, :].repeat_interleave(bk, -1)[..., :k]
    return weight.float() * full


class Fp8BlockFusedMoEMethod(DenseFusedMoEMethod):
    suffixes = ("", "_scale_inv")

    def __init__(self, block: tuple[int, int]) -> None:
        self.block = block

    def create_weights(self, layer: FusedMoE, num_local_experts, hidden_size, intermediate_size_per_partition,
                       params_dtype) -> None:
        (bn, bk), e, h, i = self.block, num_local_experts, hidden_size, intermediate_size_per_partition
        if layer.intermediate_sliced and (i % bn or i % bk):
            raise ValueError(f"model: {layer.prefix}: {i} intermediate features per rank are not a multiple of "
                             f"quantization_config.weight_block_size={list(self.block)}; use another "
                             "tensor_parallel_size or enable_expert_parallel")
        self.params_dtype = params_dtype
        shapes = {"w13_weight": (e, 2 * i, h), "w2_weight": (e, h, i),
                  "w13_weight_scale_inv": (e, 2 * -(-i // bn), -(-h // bk)),
                  "w2_weight_scale_inv": (e, -(-h // bn), -(-i // bk))}
        for name, shape in shapes.items():
            dtype = torch.float32 if name.endswith("scale_inv") else torch.float8_e4m3fn
            param = nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)
            loader = self._scale_loader(layer) if name.endswith("scale_inv") else layer.weight_loader
            set_weight_attrs(param, {"expert_dim": 0, "output_dim": 1, "input_dim": 2, "weight_loader": loader})
            layer.register_parameter(name, param)

    def _scale_loader(self, layer: FusedMoE):
        """One expert's projection's tile scales into its rows (gate, up) or columns (down), in tiles."""
        bn, bk = self.block

        def load(param: torch.Tensor, loaded: CheckpointTensor, shard_id: tuple[int, str]) -> None:
            expert, proj = shard_id
            local = expert - layer.expert_start
            if not 0 <= local < layer.num_local_experts:
                return
            half = EXPERT_PROJECTIONS[proj][1]
            target = param.data[local]
            dim, size = (0, target.shape[0] // 2) if half is not None else (1, target.shape[1])
            if half is not None:
                target = target.narrow(0, half * size, size)
            if layer.intermediate_sliced:  # whole tiles: the intermediate size per rank is a multiple of the tile
                loaded = loaded.narrow(dim, layer.tp_rank * size, size)
            copy_checked(target, loaded)

        return load

    def process_weights_after_loading(self, layer: FusedMoE, batch_size_hint: int) -> None:
        rows = layer.w13_weight.shape[1] // 2
        scale = layer.w13_weight_scale_inv.data
        halves = scale.shape[1] // 2
        w13 = torch.cat([dequantize_blocks(layer.w13_weight.data[:, h * rows:(h + 1) * rows],
                                           scale[:, h * halves:(h + 1) * halves], self.block) for h in (0, 1)], 1)
        w2 = dequantize_blocks(layer.w2_weight.data, layer.w2_weight_scale_inv.data, self.block)
        for name, dense in (("w13_weight", w13), ("w2_weight", w2)):
            delattr(layer, name)
            delattr(layer, name + "_scale_inv")
            layer.register_parameter(name, nn.Parameter(dense.to(self.params_dtype), requires_grad=False))
        super().process_weights_after_loading(layer, batch_size_hint)
