"""ops/cpu/sampling.cpp against the sampler's torch code: the top-k and top-p masks against sorting each
row (the definitions the sampler keeps), the draw against float64 running sums and a search, and a step's rows
in one call against those, one by one."""

import pytest
import torch

from ops.cpu import missing_toolchain
from ops.cpu.sampling import draw, sample_rows, top_k_mask, top_p_mask

pytestmark = pytest.mark.skipif(bool(missing_toolchain()), reason=f"CPU kernels not compiled: {missing_toolchain()}")


@pytest.mark.parametrize("vocab", [1, 7, 5000, 32003])
def test_top_k_mask_matches_sorting_the_row(vocab):
    g = torch.Generator().manual_seed(vocab)
    logits = torch.cat([
        torch.randn(6, vocab, generator=g) * 3,
        (torch.randn(6, vocab, generator=g) * 2).round(),  # many tied values: ties with the k-th are kept
        torch.randn(4, vocab, generator=g) - 1e4,  # all negative
    ])
    logits[::4, : vocab // 2] = float("-inf")  # masked already (bans, grammar): k may reach into them
    logits[5, :: max(1, vocab // 3)] = float("nan")  # a broken row: NaN ranks first, as in torch's topk
    logits[7, 0] = -0.0
    logits[8, ::32] = 100.0 + torch.arange(len(logits[8, ::32]))  # the largest where the kernel's sample looks:
    # its guess at a floor under the k largest then holds fewer than k (rank 8 of 50): the radix selection's turn
    k = torch.tensor([1, 2, 7, 50, 0, vocab - 1, vocab, vocab + 5, 3, 1000, 1, 4, 20, 5000, 2, 1])
    masked = top_k_mask(logits, k)
    ranked = logits.sort(dim=-1, descending=True).values  # sort puts NaN first too
    kth = ranked.gather(1, (k.clamp(1, vocab) - 1)[:, None])
    want = logits.masked_fill(logits < kth, float("-inf"))
    assert torch.equal(masked.isnan(), want.isnan())
    assert torch.equal(masked.nan_to_num(), want.nan_to_num())
    assert masked.data_ptr() != logits.data_ptr()


def test_top_k_mask_refuses_what_it_cannot_read():
    assert top_k_mask(torch.rand(2, 8).double(), torch.tensor([2, 2])) is None  # the caller's torch path
    from ops.cpu import load_sampling_kernels

    with pytest.raises(RuntimeError, match="k int64"):
        load_sampling_kernels().top_k_mask(torch.empty(2, 8), torch.rand(2, 8), torch.tensor([2, 2], dtype=torch.int32))


def sorted_floor(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """The last probability, in descending order, whose tokens ranked above hold less than top_p."""
    ranked = probs.double().sort(dim=-1, descending=True).values
    kept = ((ranked.cumsum(dim=-1) - ranked) < top_p.double()[:, None]).sum(dim=-1, keepdim=True)
    return ranked.gather(1, kept - 1).float()


@pytest.mark.parametrize("vocab", [1, 7, 5000, 32003])
def test_top_p_mask_keeps_what_sorting_keeps_and_renormalizes(vocab):
    g = torch.Generator().manual_seed(vocab)
    logits = torch.cat([
        torch.randn(6, vocab, generator=g) * 0.3,  # flat: the nucleus is most of the row
        torch.randn(6, vocab, generator=g) * 6.0,  # peaked: a few tokens
        (torch.randn(4, vocab, generator=g) * 4).round(),  # many tied values
    ])
    logits[::3, : vocab // 2] = float("-inf")  # masked tokens (top-k, grammar): probability 0
    probs = logits.softmax(dim=-1)
    top_p = torch.tensor([0.05, 0.3, 0.5, 0.8, 0.9, 0.95, 0.99, 0.999, 1.0] * 2)[:16]
    kept = top_p_mask(probs, top_p)
    floor = torch.where(top_p[:, None] < 1, sorted_floor(probs, top_p), 0.0)
    assert torch.equal(kept > 0, probs >= floor)  # the floor is the sort's, ties with it kept
    want = probs.double().masked_fill(probs < floor, 0.0)
    assert torch.allclose(kept.double(), want / want.sum(dim=-1, keepdim=True), rtol=1e-5, atol=1e-9)
    assert kept.data_ptr() != probs.data_ptr()


def test_top_p_mask_refuses_what_it_cannot_read():
    assert top_p_mask(torch.rand(2, 8).double(), torch.tensor([0.5, 0.5])) is None  # the caller's torch path
    with pytest.raises(RuntimeError, match="top_p float32"):
        from ops.cpu import load_sampling_kernels

        load_sampling_kernels().top_p_mask(torch.empty(3, 8), torch.rand(2, 8), torch.tensor([0.5, 0.5]))


@pytest.mark.parametrize("vocab", [1, 9, 32000])
def test_draw_matches_running_sums_and_a_search(vocab):
    g = torch.Generator().manual_seed(vocab)
    weights = torch.rand(40, vocab, generator=g) ** 4
    weights[::2, ::3] = 0.0  # masked tokens
    weights[1, :] = 0.0
    weights[1, vocab // 2] = 1.0  # one token left
    u = torch.rand(40, generator=g, dtype=torch.float64)
    u[:2] = torch.tensor([0.0, 1.0 - 2**-53], dtype=torch.float64)  # the ends of [0, 1)
    cdf = weights.cumsum(dim=-1, dtype=torch.float64)
    want = torch.searchsorted(cdf, (u[:, None] * cdf[:, -1:]).contiguous(), right=True).squeeze(1)
    want = torch.minimum(want, torch.searchsorted(cdf, cdf[:, -1:].contiguous()).squeeze(1))
    got = draw(weights, u)
    assert torch.equal(got, want)
    weighted = weights.sum(dim=-1) > 0  # (with one token, the masked rows have none: index 0, as torch's)
    assert bool((weights.gather(1, got[:, None]).squeeze(1) > 0)[weighted].all())


def _settings(rows: int, vocab: int, g: torch.Generator):
    temperature = torch.rand(rows, generator=g) * 1.5 + 0.05
    top_k = torch.tensor([vocab, 1, 3, 50, vocab + 9, 0, vocab - 1, 7] * (rows // 8 + 1))[:rows]
    top_p = torch.tensor([1.0, 0.9, 1.0, 0.5, 0.95, 0.3, 1.0, 0.999] * (rows // 8 + 1))[:rows]
    return temperature, top_k, top_p


@pytest.mark.parametrize("vocab", [1, 5, 5000])
def test_sample_rows_draws_what_processed_probs_and_the_draw_draw(vocab):
    """The one-call step against the sampler's ops one by one (processed_probs, then draw): every token inside the
    sorted oracle's kept set, and the same token for nearly every row (they differ only where u falls within
    rounding of a boundary of the running sums: unnormalized probabilities, exp by polynomial)."""
    from engine.sample.sampler import SamplingMetadata, draw, processed_probs

    g = torch.Generator().manual_seed(vocab)
    rows = 400
    logits = torch.randn(rows, vocab, generator=g) * 3
    logits[::5, : vocab // 3] = float("-inf")  # bans, grammar
    temperature, top_k, top_p = _settings(rows, vocab, g)
    u = torch.rand(rows, generator=g, dtype=torch.float64)
    u[:2] = torch.tensor([0.0, 1.0 - 2**-53], dtype=torch.float64)
    tokens = sample_rows(logits, temperature, top_k, top_p, u)
    md = SamplingMetadata(temperature=temperature, all_greedy=False, top_k=top_k, top_p=top_p, min_p=None,
                          seeds={}, max_num_logprobs=None)
    probs = processed_probs(logits, md, torch.arange(rows))
    assert bool((probs.gather(1, tokens[:, None]) > 0).all())
    assert (tokens == draw(probs, u)).float().mean() >= 0.99


def test_sample_rows_follows_the_distribution():
    """u on a grid: each token drawn as often as its probability under temperature, top-k and top-p."""
    from engine.sample.sampler import SamplingMetadata, processed_probs

    logits = torch.tensor([[2.0, -1.0, 0.5, float("-inf"), 1.5, 0.0, 3.0]])
    n = 20_000
    u = (torch.arange(n, dtype=torch.float64) + 0.5) / n
    for t, k, p in ((1.0, 7, 1.0), (0.7, 4, 1.0), (1.3, 7, 0.8), (0.9, 5, 0.9)):
        temperature, top_k, top_p = torch.full((n,), t), torch.full((n,), k), torch.full((n,), p)
        counts = torch.bincount(sample_rows(logits.expand(n, -1), temperature, top_k, top_p, u), minlength=7)
        md = SamplingMetadata(temperature=temperature[:1], all_greedy=False, top_k=top_k[:1], top_p=top_p[:1],
                              min_p=None, seeds={}, max_num_logprobs=None)
        want = processed_probs(logits, md, torch.arange(1))[0]
        assert torch.allclose(counts.double() / n, want.double(), atol=2 / n)


def test_sample_rows_keeps_broken_rows_in_range_and_refuses_what_it_cannot_read():
    logits = torch.tensor([[float("nan")] * 6, [float("-inf")] * 6, [1.0, float("nan"), 2.0, 0.0, 1.0, 1.0]])
    tokens = sample_rows(logits, torch.ones(3), None, torch.tensor([0.9, 1.0, 0.5]), torch.full((3,), 0.5,
                                                                                              dtype=torch.float64))
    assert bool(((tokens >= 0) & (tokens < 6)).all()) and int(tokens[2]) != 1  # NaN is never drawn
    assert sample_rows(logits.double(), torch.ones(3), None, None, torch.zeros(3)) is None
    from ops.cpu import load_sampling_kernels

    with pytest.raises(RuntimeError, match="sample_rows: temperature"):
        load_sampling_kernels().sample_rows(torch.empty(3, dtype=torch.long), logits, torch.ones(2),
                                            torch.ones(3, dtype=torch.long), torch.ones(3), torch.zeros(3).double())
