"""The CPU weight-only kernels against a float32 matmul on their own dequantized weights, over the shapes
their blocking splits differently: 1-4 and 5+ rows of x, row counts not a multiple of the 3-row block,
int8 inputs not a multiple of 8, int4 groups of 32 and 128."""

import pytest
import torch
import torch.nn.functional as F

from kernels.cpu.quant_linear import (dequantize_int4, dequantize_int8, int4_linear, int8_linear, pack_int4,
                                      quant_kernels_available, unpack_int4)

pytestmark = pytest.mark.skipif(not quant_kernels_available(), reason="no compiler for the CPU kernels")


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 16, 70])
@pytest.mark.parametrize("n,k", [(7, 100), (48, 256)])
def test_int8_linear_equals_its_dequantized_matmul(rows, n, k):
    gen = torch.Generator().manual_seed(rows * 1000 + n)
    q = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8)
    scales = torch.rand(n, generator=gen) * 0.01 + 1e-3
    x, bias = torch.randn(rows, k, generator=gen), torch.randn(n, generator=gen)
    torch.testing.assert_close(int8_linear(x, q, scales, bias), F.linear(x, dequantize_int8(q, scales), bias),
                               rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 16, 70])
@pytest.mark.parametrize("n,k,group", [(7, 64, 32), (48, 256, 128), (10, 384, 32)])
def test_int4_linear_equals_its_dequantized_matmul(rows, n, k, group):
    gen = torch.Generator().manual_seed(rows * 1000 + n)
    q = torch.randint(0, 16, (n, k), generator=gen)
    packed = pack_int4(q)
    assert torch.equal(unpack_int4(packed), q.to(torch.uint8))
    scales = torch.rand(n, k // group, generator=gen) * 0.01 + 1e-3
    zeros = -8 * scales + torch.randn(n, k // group, generator=gen) * 1e-3
    x = torch.randn(rows, k, generator=gen)
    expected = F.linear(x, dequantize_int4(packed, scales, zeros, group))
    torch.testing.assert_close(int4_linear(x, packed, scales, zeros, group, None), expected, rtol=1e-4, atol=1e-5)
