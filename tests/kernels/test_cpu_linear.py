"""The oneDNN-packed dense linear: rows padded to buckets give the rows' own results, and a batch of any row
count up to max_num_batched_tokens runs with one of ~100 shapes (oneDNN caches a primitive per shape)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels.cpu.linear import EXACT_ROWS, bucket_rows, pack_weight, packed_linear, packing_available


def test_buckets_bound_the_shapes_and_the_padding():
    buckets = {bucket_rows(m) for m in range(1, 2049)}
    assert len(buckets) <= 110
    for m in range(1, 4097):
        padded = bucket_rows(m)
        assert padded == m if m <= EXACT_ROWS else m <= padded <= m * 1.125
        assert bucket_rows(padded) == padded


@pytest.mark.skipif(not packing_available(torch.float32), reason="this torch build has no oneDNN weight packing")
@pytest.mark.parametrize("rows", [1, 64, 65, 100, 300])
def test_padded_rows_compute_what_the_plain_linear_does(rows):
    torch.manual_seed(0)
    weight, bias, x = torch.randn(48, 32), torch.randn(48), torch.randn(rows, 32)
    y = packed_linear(x, pack_weight(weight, 64), bias)
    assert y.shape == (rows, 48) and y.is_contiguous()
    torch.testing.assert_close(y, F.linear(x, weight, bias), atol=1e-4, rtol=1e-4)
