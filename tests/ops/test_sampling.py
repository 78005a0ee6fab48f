"""ops/cpu/sampling.cpp's top-p floor against sorting each row (the definition the sampler keeps)."""

import pytest
import torch

from ops.cpu import missing_toolchain
from ops.cpu.sampling import top_p_floor

pytestmark = pytest.mark.skipif(bool(missing_toolchain()), reason=f"CPU kernels not compiled: {missing_toolchain()}")


def sorted_floor(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """The last probability, in descending order, whose tokens ranked above hold less than top_p."""
    ranked = probs.double().sort(dim=-1, descending=True).values
    kept = ((ranked.cumsum(dim=-1) - ranked) < top_p.double()[:, None]).sum(dim=-1, keepdim=True)
    return ranked.gather(1, kept - 1).float()


@pytest.mark.parametrize("vocab", [1, 7, 5000, 32003])
def test_top_p_floor_matches_sorting_the_row(vocab):
    g = torch.Generator().manual_seed(vocab)
    logits = torch.cat([
        torch.randn(6, vocab, generator=g) * 0.3,  # flat: the nucleus is most of the row
        torch.randn(6, vocab, generator=g) * 6.0,  # peaked: a few tokens
        (torch.randn(4, vocab, generator=g) * 4).round(),  # many tied values
    ])
    logits[::3, : vocab // 2] = float("-inf")  # masked tokens (top-k, grammar): probability 0
    probs = logits.softmax(dim=-1)
    top_p = torch.tensor([0.05, 0.3, 0.5, 0.8, 0.9, 0.95, 0.99, 0.999] * 2)
    floor = top_p_floor(probs, top_p)
    assert floor.shape == (16, 1)
    assert torch.equal(floor, sorted_floor(probs, top_p))


def test_top_p_floor_refuses_what_it_cannot_read():
    assert top_p_floor(torch.rand(2, 8).double(), torch.tensor([0.5, 0.5])) is None  # the caller's torch path
    with pytest.raises(RuntimeError, match="top_p and floor"):
        from ops.cpu import load_sampling_kernels

        load_sampling_kernels().top_p_floor(torch.empty(3), torch.rand(2, 8), torch.tensor([0.5, 0.5]))
