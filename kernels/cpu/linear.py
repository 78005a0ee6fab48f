"""Linear layers with their weights prepacked for oneDNN.

On x86 CPUs torch's default fp32 matmul (MKL sgemm on a plain row-major weight) reached 170-220 GFLOPS
on our 2-core AMD Zen 5 machines; oneDNN's matmul on a weight reordered once into its blocked layout
reached ~470 at the batch sizes of a decode step, and bfloat16 ~850. Same math, same dtype: only the
summation order differs."""

from __future__ import annotations

import logging

import torch
from torch import nn

logger = logging.getLogger(__name__)


class PackedLinear(nn.Module):
    def __init__(self, linear: nn.Linear, batch_size_hint: int) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        with torch.no_grad():
            self.register_buffer("weight", torch.ops.mkldnn._reorder_linear_weight(linear.weight, batch_size_hint))
            self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")


def _packing_works(dtype: torch.dtype) -> bool:
    try:
        linear = nn.Linear(8, 4).to(dtype)
        x = torch.randn(3, 8, dtype=dtype)
        with torch.no_grad():
            return torch.allclose(PackedLinear(linear, 3)(x).float(), linear(x).float(), atol=0.05)
    except (RuntimeError, AttributeError) as e:  # a torch built without oneDNN, or a changed private op
        logger.warning("oneDNN linear packing unavailable (%s); using plain matmuls", e)
        return False


def pack_linear_layers(model: nn.Module, batch_size_hint: int) -> int:
    """Replace every nn.Linear of a CPU model by a PackedLinear; returns how many were replaced."""
    dtype = next(model.parameters()).dtype
    if not torch.backends.mkldnn.is_available() or not _packing_works(dtype):
        return 0
    count = 0
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, nn.Linear):
                setattr(module, name, PackedLinear(child, batch_size_hint))
                count += 1
    return count
