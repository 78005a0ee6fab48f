"""ops/cpu/elementwise.cpp against the layers' torch code it replaces on CPU (engine/models/layers)."""

import pytest
import torch
import torch.nn.functional as F

from engine.models.layers.norm import rms_norm as torch_rms_norm
from engine.models.layers.rotary import RotaryEmbedding, rotate_neox
from ops.cpu import elementwise, missing_toolchain

# Only where nothing can compile: with a toolchain, a kernel that fails to build fails these tests.
pytestmark = pytest.mark.skipif(bool(missing_toolchain()), reason=f"CPU kernels not compiled: {missing_toolchain()}")

# float32: summation order only; bfloat16: where a float32 difference crosses a rounding boundary, one ulp
TOLERANCE = {torch.float32: dict(rtol=1e-5, atol=1e-6), torch.bfloat16: dict(rtol=1e-2, atol=1e-2)}
ROWS = [1, 7, 300]  # 300 x 512 takes the multi-threaded path


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", ROWS)
def test_rms_norm_with_and_without_residual(dtype, rows):
    g = torch.Generator().manual_seed(rows)
    x, residual = (torch.randn(rows, 512, generator=g).to(dtype) for _ in range(2))
    weight = (torch.rand(512, generator=g) + 0.5).to(dtype)
    torch.testing.assert_close(elementwise.rms_norm(x, weight, 1e-5), torch_rms_norm(x, weight, 1e-5),
                               **TOLERANCE[dtype])
    normed, summed = elementwise.rms_norm(x, weight, 1e-5, residual)
    want_normed, want_summed = torch_rms_norm(x, weight, 1e-5, residual)
    assert torch.equal(summed, want_summed)  # the sum is rounded where torch rounds it
    torch.testing.assert_close(normed, want_normed, **TOLERANCE[dtype])


def test_rms_norm_of_a_strided_view_normalises_each_head():
    qkv = torch.randn(5, 3 * 4 * 64)
    q = qkv[:, : 4 * 64].view(5, 4, 64)  # qk_norm models normalise each head of a view like this
    weight = torch.rand(64) + 0.5
    torch.testing.assert_close(elementwise.rms_norm(q, weight, 1e-6), torch_rms_norm(q, weight, 1e-6),
                               **TOLERANCE[torch.float32])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", ROWS)
def test_rotary_on_a_view_of_the_fused_qkv(dtype, tokens):
    rope = RotaryEmbedding(64, 4096, 500000.0, None)
    qkv = torch.randn(tokens, (8 + 2 * 4) * 64, generator=torch.Generator().manual_seed(tokens)).to(dtype)
    q = qkv[:, : 8 * 64].view(tokens, 8, 64)  # strided: what Attention.forward hands over
    k = qkv[:, 8 * 64 : 12 * 64].view(tokens, 4, 64)
    positions = torch.randint(0, 4096, (tokens,))
    cos, sin = rope.cos[positions].unsqueeze(1), rope.sin[positions].unsqueeze(1)
    got_q, got_k = rope(positions, q, k)
    torch.testing.assert_close(got_q, rotate_neox(q, cos, sin), **TOLERANCE[dtype])
    torch.testing.assert_close(got_k, rotate_neox(k, cos, sin), **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", ROWS)
def test_rotary_in_place_turns_q_and_k_heads_of_the_fused_qkv_and_leaves_v(dtype, tokens):
    rope = RotaryEmbedding(64, 4096, 500000.0, None)
    qkv = torch.randn(tokens, (8 + 2 * 4) * 64, generator=torch.Generator().manual_seed(tokens)).to(dtype)
    before = qkv.clone()
    positions = torch.randint(0, 4096, (tokens,))
    rope.rotate_(positions, qkv[:, : 12 * 64].view(tokens, 12, 64))  # what Attention.forward hands over
    cos, sin = rope.cos[positions].unsqueeze(1), rope.sin[positions].unsqueeze(1)
    want = rotate_neox(before[:, : 12 * 64].view(tokens, 12, 64), cos, sin)
    torch.testing.assert_close(qkv[:, : 12 * 64].view(tokens, 12, 64), want, **TOLERANCE[dtype])
    assert torch.equal(qkv[:, 12 * 64 :], before[:, 12 * 64 :])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("width", [1376, 37])  # 37: not a multiple of any vector width
def test_silu_and_mul_matches_torch(dtype, rows, width):
    g = torch.Generator().manual_seed(rows * width)
    gate_up = (torch.randn(rows, 2 * width, generator=g) * 6).to(dtype)  # reaches where exp under- and overflows
    gate_up[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(elementwise.silu_and_mul(gate_up), F.silu(gate) * up, **TOLERANCE[dtype])


def test_silu_and_mul_takes_leading_dims_and_refuses_an_odd_width():
    x = torch.randn(2, 3, 10)
    torch.testing.assert_close(elementwise.silu_and_mul(x), F.silu(x[..., :5]) * x[..., 5:], **TOLERANCE[torch.float32])
    with pytest.raises(RuntimeError, match="silu_and_mul"):
        elementwise.silu_and_mul(torch.randn(2, 9))


def test_rotary_refuses_a_position_outside_its_tables():
    rope = RotaryEmbedding(64, 128, 10000.0, None)
    q = torch.randn(2, 8, 64)
    with pytest.raises(RuntimeError, match="position 128 outside"):
        rope(torch.tensor([0, 128]), q, q)
