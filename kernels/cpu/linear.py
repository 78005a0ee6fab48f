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


# oneDNN builds (JIT-compiles) a matmul primitive per input shape and keeps it in its primitive cache (up to
# ONEDNN_PRIMITIVE_CACHE_CAPACITY = 1024 by default, ~0.25 MiB each). A serving engine's batches have every
# row count from 1 to max_num_batched_tokens, so that cache filled over tens of thousands of requests: the
# engine process's memory grew for as long (benchmarks/soak.py: +300 MiB live, still rising after 4,000
# requests), and every new row count paid a primitive build (milliseconds). Rows are padded to a bucket:
# exact up to EXACT_ROWS (decode batches), then 8 buckets per power of two (at most 12.5% padded rows), so
# a weight sees ~100 shapes, not thousands.
EXACT_ROWS = 64


def bucket_rows(num_rows: int) -> int:
    """The row count `num_rows` is padded to: itself up to EXACT_ROWS, then the next multiple of 1/8 of
    its power of two (65 -> 72, 129 -> 144, 1000 -> 1024)."""
    if num_rows <= EXACT_ROWS:
        return num_rows
    step = 1 << (num_rows.bit_length() - 4)
    return -(-num_rows // step) * step


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    rows = x.shape[0] if x.dim() == 2 else 0
    padded = bucket_rows(rows)
    if padded == rows:  # bucketed already, or not a 2-D batch of rows
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    x = F.pad(x, (0, 0, 0, padded - rows))
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")[:rows]


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
