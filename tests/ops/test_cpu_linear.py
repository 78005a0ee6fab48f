"""The packed dense linear: float32 weights in panels (our kernel) and bfloat16 / odd-sized float32 ones for
oneDNN compute what F.linear does; oneDNN's rows padded to buckets give the rows' own results, and a batch of
any row count up to max_num_batched_tokens runs with one of ~100 shapes (oneDNN caches a primitive per shape)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ops.cpu import missing_toolchain
from ops.cpu.linear import EXACT_ROWS, bucket_rows, pack_weight, packed_linear, packing_available


def test_buckets_bound_the_shapes_and_the_padding():
    buckets = {bucket_rows(m) for m in range(1, 2049)}
    assert len(buckets) <= 110
    for m in range(1, 4097):
        padded = bucket_rows(m)
        assert padded == m if m <= EXACT_ROWS else m <= padded <= m * 1.125
        assert bucket_rows(padded) == padded


@pytest.mark.skipif(not packing_available(torch.float32), reason="this torch build has no oneDNN weight packing")
@pytest.mark.parametrize("rows", [1, 4, 5, 64, 65, 100, 300, 1100])
@pytest.mark.parametrize("out_features,layout_dims", [(48, 3), (40, 2)])  # 40: not whole panels, so oneDNN
def test_packed_rows_compute_what_the_plain_linear_does(rows, out_features, layout_dims):
    if layout_dims == 3 and missing_toolchain():  # with a toolchain, a kernel that fails to build fails here
        pytest.skip(f"CPU kernels not compiled: {missing_toolchain()}")
    torch.manual_seed(0)
    weight, bias, x = torch.randn(out_features, 300), torch.randn(out_features), torch.randn(rows, 300)
    packed = pack_weight(weight, 64)
    assert packed.dim() == layout_dims
    y = packed_linear(x, packed, bias)
    assert y.shape == (rows, out_features) and y.is_contiguous()
    torch.testing.assert_close(y, F.linear(x, weight, bias), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(packed_linear(x[0], packed, None), F.linear(x[0], weight), atol=1e-4, rtol=1e-4)
