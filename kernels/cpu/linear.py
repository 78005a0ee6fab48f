"""Dense linear weights prepacked for oneDNN: the CPU path of the engine's dense linear method.

On x86 CPUs torch's default fp32 matmul (MKL sgemm on a plain row-major weight) reached 170-220 GFLOPS
on our 2-core AMD Zen 5 machines; oneDNN's matmul on a weight reordered once into its blocked layout
reached ~470 at the batch sizes of a decode step, and bfloat16 ~850. Same math, same dtype: only the
summation order differs."""

from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)


def pack_weight(weight: torch.Tensor, batch_size_hint: int) -> torch.Tensor:
    """`weight` [out, in] reordered into oneDNN's blocked layout for batches of about `batch_size_hint` rows."""
    with torch.no_grad():
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), batch_size_hint)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


@functools.cache
def packing_available(dtype: torch.dtype) -> bool:
    """Whether this torch build packs weights of `dtype` and computes with them correctly."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        weight, x = torch.randn(4, 8, dtype=dtype), torch.randn(3, 8, dtype=dtype)
        with torch.no_grad():
            return torch.allclose(packed_linear(x, pack_weight(weight, 3), None).float(), F.linear(x, weight).float(), atol=0.05)
    except (RuntimeError, AttributeError) as e:  # a torch built without oneDNN, or a changed private op
        logger.warning("oneDNN linear packing unavailable (%s); using plain matmuls", e)
        return False
