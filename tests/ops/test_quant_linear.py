"""The CPU quantized kernels: weight-only ones against a float32 matmul on their own dequantized weights,
over the shapes they split differently: 1-4 rows of x (widened in registers) and 5+ (widened into a buffer,
in tiles of 12 rows with AVX-512 and 6 with AVX2), output rows not a multiple of the 16-row panel, inputs
longer than the 256-column buffer and not a multiple of it, an odd number of inputs (columns are widened in
pairs), int4 groups from 16 to 128. W8A8 against float64 on its own quantized numbers (its integer sums are exact), over
inputs not a multiple of the 4-column unit; W4A8 likewise, per group of 8 to 128 inputs; both at their extremes
(the largest weights times the largest activations, of one sign), where AVX2's int16 pair sums could saturate."""

import pytest
import torch
import torch.nn.functional as F

from ops.cpu import missing_toolchain
from ops.cpu.quant_linear import (
    dequantize_int4,
    dequantize_int8,
    int4_linear,
    int8_linear,
    pack_int4,
    pack_int4_params,
    pack_int8,
    pack_w4a8,
    pack_w8a8,
    quantize_activations,
    unpack_int4,
    unpack_int4_params,
    unpack_int8,
    unpack_w4a8,
    unpack_w8a8,
    w4a8_linear,
    w8a8_linear,
)

# Only where nothing can compile: with a toolchain, a kernel that fails to build fails these tests.
pytestmark = pytest.mark.skipif(bool(missing_toolchain()), reason=f"CPU kernels not compiled: {missing_toolchain()}")

ROWS = [1, 2, 3, 4, 5, 16, 70, 600]


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("n,k", [(7, 100), (48, 256), (40, 600), (9, 301)])
def test_int8_linear_equals_its_dequantized_matmul(rows, n, k):
    gen = torch.Generator().manual_seed(rows * 1000 + n)
    q = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8)
    packed = pack_int8(q)
    assert packed.shape == (-(-n // 16), k, 16) and torch.equal(unpack_int8(packed, n), q)
    scales = torch.rand(n, generator=gen) * 0.01 + 1e-3
    x, bias = torch.randn(rows, k, generator=gen), torch.randn(n, generator=gen)
    expected = F.linear(x, q.float() * scales[:, None], bias)
    torch.testing.assert_close(dequantize_int8(packed, scales), q.float() * scales[:, None])
    torch.testing.assert_close(int8_linear(x, packed, scales, bias), expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("n,k,group", [(7, 64, 32), (48, 256, 128), (10, 384, 32), (24, 48, 16), (33, 640, 128)])
def test_int4_linear_equals_its_dequantized_matmul(rows, n, k, group):
    gen = torch.Generator().manual_seed(rows * 1000 + n)
    q = torch.randint(0, 16, (n, k), generator=gen)
    packed = pack_int4(q)
    assert packed.shape == (-(-n // 16), k // 2, 16) and torch.equal(unpack_int4(packed, n), q.to(torch.uint8))
    scales = torch.rand(n, k // group, generator=gen) * 0.01 + 1e-3
    zeros = -8 * scales + torch.randn(n, k // group, generator=gen) * 1e-3
    x = torch.randn(rows, k, generator=gen)
    params = pack_int4_params(scales, zeros)
    assert params.shape == (-(-n // 16), k // group, 32)
    assert all(torch.equal(a, b) for a, b in zip(unpack_int4_params(params, n), (scales, zeros)))
    dense = q.float() * scales.repeat_interleave(group, 1) + zeros.repeat_interleave(group, 1)
    torch.testing.assert_close(dequantize_int4(packed, params, group, n), dense)
    torch.testing.assert_close(int4_linear(x, packed, params, group, n, None), F.linear(x, dense), rtol=1e-4, atol=1e-4)


def test_int4_packing_refuses_an_odd_number_of_inputs():
    with pytest.raises(ValueError, match="must be even"):
        pack_int4(torch.zeros(16, 33, dtype=torch.uint8))


@pytest.mark.parametrize("rows", [*ROWS, 17, 33])
@pytest.mark.parametrize("n,k", [(7, 100), (48, 256), (40, 601), (33, 1030), (16, 3)])
def test_w8a8_linear_equals_float64_on_its_quantized_numbers(rows, n, k):
    gen = torch.Generator().manual_seed(rows * 1000 + n)
    q = torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int8)  # -128 too: int8 checkpoints hold it
    packed = pack_w8a8(q)
    assert packed.shape == (-(-n // 16), -(-k // 4), 16, 4) and torch.equal(unpack_w8a8(packed, n, k), q)
    scales = torch.rand(n, generator=gen) * 0.01 + 1e-3
    x, bias = torch.randn(rows, k, generator=gen) * 3, torch.randn(n, generator=gen)
    x[0] = 0  # a zero row: scale 1, every integer 0
    xq, x_scales = quantize_activations(x)
    assert xq.abs().max() <= 127 and float(x_scales[0]) == 1.0
    exact = (xq.double() @ q.double().T) * x_scales.double()[:, None] * scales.double() + bias.double()
    out = w8a8_linear(x, packed, scales, bias)
    torch.testing.assert_close(out.double(), exact, rtol=1e-6, atol=1e-5)
    assert torch.equal(out[0], bias)


def _extreme_signs(rows, n, k):
    """Weight signs [n, k] at random, and x [rows, k] of magnitude 2.5 with row m's signs those of weight row m
    (odd rows: the opposite): every product of row m with weight row m is the largest there is, of one sign."""
    gen = torch.Generator().manual_seed(rows)
    signs = torch.randint(0, 2, (n, k), generator=gen) * 2 - 1
    x = 2.5 * signs[torch.arange(rows) % n].float()
    x[1::2] *= -1
    return signs, x


@pytest.mark.parametrize("rows", [1, 3, 17, 33])
def test_w8a8_linear_is_exact_at_the_extremes(rows):
    # q of 127 and -128 times x quantized to +-127, signs alike: a pair of products reaches 2 * 128 * 127, which
    # vpmaddubsw (AVX2) over the stored q + 128 would saturate to int16's 32767; and -128 is the q whose sign
    # vpsignb cannot flip.
    n, k = 33, 1030
    signs, x = _extreme_signs(rows, n, k)
    q = torch.where(signs > 0, 127, -128).to(torch.int8)
    scales = torch.full((n,), 1e-3)
    xq, x_scales = quantize_activations(x)
    assert xq.abs().eq(127).all()
    exact = (xq.double() @ q.double().T) * x_scales.double()[:, None] * scales.double()
    torch.testing.assert_close(w8a8_linear(x, pack_w8a8(q), scales, None).double(), exact, rtol=1e-6, atol=0)


@pytest.mark.parametrize("rows", [1, 3, 17, 33])
def test_w4a8_linear_is_exact_at_the_extremes(rows):
    n, k, group = 33, 1024, 128
    signs, x = _extreme_signs(rows, n, k)
    q = torch.where(signs > 0, 7, -8).to(torch.int8)
    scales = torch.full((n, k // group), 1e-3)
    packed, panel_scales = pack_w4a8(q, scales)
    xq, x_scales = quantize_activations(x)
    assert xq.abs().eq(127).all()
    exact = (xq.double() @ q.double().T) * x_scales.double()[:, None] * 1e-3
    # Groups' sums are scaled and added in float32: sums that cancel leave ~1e-7, not 0.
    torch.testing.assert_close(w4a8_linear(x, packed, panel_scales, group, n, None).double(), exact, rtol=1e-6,
                               atol=1e-5)


def test_w8a8_activation_error_is_within_half_a_step_per_element():
    x = torch.randn(9, 300) * torch.logspace(-3, 3, 9)[:, None]
    xq, scales = quantize_activations(x)
    assert ((xq.float() * scales[:, None] - x).abs() <= scales[:, None] / 2 * (1 + 1e-6)).all()


@pytest.mark.parametrize("rows", [*ROWS, 17, 33])
@pytest.mark.parametrize("n,k,group", [(7, 64, 32), (48, 256, 128), (40, 640, 32), (33, 1024, 128), (16, 8, 8)])
def test_w4a8_linear_equals_float64_on_its_quantized_numbers(rows, n, k, group):
    gen = torch.Generator().manual_seed(rows * 1000 + n)
    q = torch.randint(-8, 8, (n, k), generator=gen, dtype=torch.int8)
    scales = torch.rand(n, k // group, generator=gen) * 0.01 + 1e-3
    packed, panel_scales = pack_w4a8(q, scales)
    assert packed.shape == (-(-n // 16), k // 8, 16, 4) and torch.equal(unpack_w4a8(packed, n), q)
    x, bias = torch.randn(rows, k, generator=gen), torch.randn(n, generator=gen)
    xq, x_scales = quantize_activations(x)
    weight = q.double() * scales.double().repeat_interleave(group, 1)
    exact = (xq.double() * x_scales.double()[:, None]) @ weight.T + bias.double()
    torch.testing.assert_close(w4a8_linear(x, packed, panel_scales, group, n, bias).double(), exact, rtol=1e-5,
                               atol=1e-5)
