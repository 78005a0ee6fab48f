"""The packed dense linear: float32 weights in panels and bfloat16 ones in pair panels (our kernels;
bfloat16 where the CPU has AVX512_BF16, or where oneDNN cannot pack it) and other / odd-sized ones for oneDNN
compute what F.linear does; oneDNN's rows padded to buckets give the rows' own results, and a batch of any row
count up to max_num_batched_tokens runs with one of ~100 shapes (oneDNN caches a primitive per shape)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ops.cpu import cpu_flags, missing_toolchain
from ops.cpu.linear import (
    EXACT_ROWS,
    bfloat16_linear,
    bfloat16_panels_preferred,
    bucket_rows,
    from_unit_panels,
    instruction_sets,
    onednn_packs,
    pack_weight,
    packed_linear,
    to_unit_panels,
)


def test_buckets_bound_the_shapes_and_the_padding():
    buckets = {bucket_rows(m) for m in range(1, 2049)}
    assert len(buckets) <= 110
    for m in range(1, 4097):
        padded = bucket_rows(m)
        assert padded == m if m <= EXACT_ROWS else m <= padded <= m * 1.125
        assert bucket_rows(padded) == padded


@pytest.mark.skipif(not onednn_packs(torch.float32), reason="this torch build has no oneDNN weight packing")
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


@pytest.mark.skipif(bool(missing_toolchain()), reason=f"CPU kernels not compiled: {missing_toolchain()}")
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 15, 16, 17, 33, 70, 600])
@pytest.mark.parametrize("n,k", [(7, 100), (48, 256), (40, 602), (33, 1030)])
def test_bfloat16_panels_sum_their_products_in_float32(rows, n, k):
    """vdpbf16ps (or, without AVX512_BF16, panels widened to float32) against float64 on the same bfloat16
    numbers: the products are exact, so only float32 summation stands between them. Rows 1-4 take the direct
    path, more the tiles of 16 rows (and a partial tile); K over the 128-pair chunk and not a multiple of it."""
    gen = torch.Generator().manual_seed(rows * 1000 + n)
    w = torch.randn(n, k, generator=gen).bfloat16()
    x = torch.randn(rows, k, generator=gen).bfloat16()
    panels = to_unit_panels(w, 2)
    assert panels.shape == (-(-n // 16), k // 2, 16, 2) and torch.equal(from_unit_panels(panels, n, k), w)
    sums = bfloat16_linear(x.float(), panels, None)[:, :n]  # float32 x of bfloat16 values: float32 sums out
    exact = x.double() @ w.double().T
    scale = x.double().abs() @ w.double().abs().T
    assert ((sums.double() - exact).abs() <= 1e-6 * scale + 1e-6).all()
    out = bfloat16_linear(x, panels, None)  # bfloat16 x: rounded once to bfloat16
    assert out.dtype == torch.bfloat16 and torch.equal(out[:, :n], sums.bfloat16())


def test_bfloat16_weights_pack_into_pair_panels_where_ours_are_preferred():
    """Our panels where the CPU has AVX512_BF16 but not AMX (vdpbf16ps) or oneDNN cannot pack bfloat16 (AVX2:
    widened in registers); oneDNN's layout elsewhere; never plain matmuls for whole panels."""
    if missing_toolchain():
        pytest.skip(f"CPU kernels not compiled: {missing_toolchain()}")
    torch.manual_seed(0)
    weight, bias, x = torch.randn(48, 300).bfloat16(), torch.randn(48).bfloat16(), torch.randn(5, 300).bfloat16()
    preferred = bfloat16_panels_preferred()
    assert preferred == (instruction_sets()["avx512_bf16"] and "amx_bf16" not in cpu_flags()
                         or not onednn_packs(torch.bfloat16))
    packed = pack_weight(weight, 16)
    assert packed.dim() == (4 if preferred else 2)
    odd = pack_weight(weight[:40], 16)  # 40 rows: not whole panels: oneDNN's, or plain where it cannot pack them
    assert odd.dim() == 2 if onednn_packs(torch.bfloat16) else odd is None
    torch.testing.assert_close(packed_linear(x, packed, bias), F.linear(x, weight, bias), atol=0.05, rtol=0.02)
