"""Sampling: seeded reproducibility independent of the batch, and the effect of each parameter."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from engine import LLM, SamplingParams
from engine.sample.sampler import argmax_rows, draw, top_k_mask, top_p_mask
from tests.conftest import TINY

PROMPTS = ["The quick brown fox", "Once upon a time", "In a galaxy far away", "Hello"]


@pytest.fixture(scope="module")
def llm():
    return LLM(TINY, max_model_len=256)


def _tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


def test_seeded_sampling_is_reproducible_across_runs(llm):
    params = SamplingParams(temperature=1.0, seed=7, max_tokens=24, ignore_eos=True)
    first = _tokens(llm.generate(PROMPTS, params, use_tqdm=False))
    second = _tokens(llm.generate(PROMPTS, params, use_tqdm=False))
    assert first == second
    assert (LLM(TINY, max_model_len=256, seed=99).generate(PROMPTS, params, use_tqdm=False)[0].outputs[0].token_ids
            == first[0])


def test_seeded_sample_does_not_depend_on_the_batch(llm):
    seeded = SamplingParams(temperature=0.8, top_p=0.9, top_k=50, seed=123, max_tokens=24, ignore_eos=True)
    alone = _tokens(llm.generate([PROMPTS[0]], seeded, use_tqdm=False))[0]
    noise = SamplingParams(temperature=1.0, max_tokens=40, ignore_eos=True)
    greedy = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    in_batch = llm.generate([PROMPTS[1], PROMPTS[0], PROMPTS[2]], [noise, seeded, greedy], use_tqdm=False)
    assert in_batch[1].outputs[0].token_ids == alone


def test_different_seeds_differ_and_unseeded_runs_vary(llm):
    a = _tokens(llm.generate([PROMPTS[0]], SamplingParams(seed=1, max_tokens=16, ignore_eos=True), use_tqdm=False))
    b = _tokens(llm.generate([PROMPTS[0]], SamplingParams(seed=2, max_tokens=16, ignore_eos=True), use_tqdm=False))
    assert a != b
    unseeded = SamplingParams(max_tokens=16, ignore_eos=True)
    c = _tokens(llm.generate([PROMPTS[0]] * 2, unseeded, use_tqdm=False))
    assert c[0] != c[1]


def test_greedy_matches_temperature_zero_and_top_k_one(llm):
    greedy = _tokens(llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                                  use_tqdm=False))
    top1 = _tokens(llm.generate(PROMPTS, SamplingParams(top_k=1, seed=3, max_tokens=12, ignore_eos=True),
                                use_tqdm=False))
    assert greedy == top1


def _kept(logits, top_k, top_p):
    """The tokens a row may draw after top-k (on the logits) then top-p (on the probabilities), as
    processed_probs applies them; and the distribution."""
    if top_k is not None:
        logits = top_k_mask(logits, top_k)
    probs = logits.softmax(dim=-1)
    if top_p is not None:
        probs = top_p_mask(probs, top_p)
    return probs > 0, probs


def test_top_k_top_p_masks():
    logits = torch.tensor([[1.0, 2.0, 3.0, 4.0], [4.0, 3.0, 2.0, 1.0]])
    masked = top_k_mask(logits, torch.tensor([2, 4]))
    assert torch.isinf(masked[0, :2]).all() and torch.isfinite(masked[0, 2:]).all()
    assert torch.isfinite(masked[1]).all()
    probs = logits.softmax(-1)  # row 0: [.032, .087, .237, .644]
    kept = top_p_mask(probs, torch.tensor([0.5, 0.85]))
    assert (kept[0] > 0).tolist() == [False, False, False, True]  # 0.644 >= 0.5 alone
    assert (kept[1] > 0).tolist() == [True, True, False, False]  # .644 + .237 >= .85
    # renormalized: the softmax of the logits masked outside the nucleus
    assert torch.allclose(kept[1], logits[1].masked_fill(kept[1] == 0, float("-inf")).softmax(-1))
    assert torch.equal(top_p_mask(probs, torch.tensor([1.0, 1.0])), probs)


def _sorted_top_k_top_p(logits, top_k, top_p):
    """The oracle: every row sorted, masked by rank (top_p's mass summed from the least likely token)."""
    sorted_logits, order = logits.sort(dim=-1)
    vocab = logits.shape[-1]
    if top_k is not None:
        kth = sorted_logits.gather(1, (vocab - top_k).clamp(0, vocab - 1)[:, None])
        sorted_logits.masked_fill_(sorted_logits < kth, float("-inf"))
    if top_p is not None:
        drop = sorted_logits.softmax(dim=-1).cumsum(dim=-1) <= (1 - top_p)[:, None]
        drop[:, -1] = False
        sorted_logits.masked_fill_(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


@pytest.mark.parametrize("scale", [0.5, 8.0])  # flat rows (the nucleus past the candidates: a sort) and peaked
def test_top_k_top_p_thresholds_match_sorting_every_row(scale):
    g = torch.Generator().manual_seed(3)
    vocab = 5000
    logits = torch.randn(12, vocab, generator=g) * scale
    top_k = torch.tensor([vocab, 1, 7, 300, vocab, 4999, vocab, 50, vocab, 2, vocab, 10_000])
    top_p = torch.tensor([0.9, 1.0, 0.5, 0.95, 1.0, 0.3, 0.99, 1.0, 0.05, 0.7, 0.8, 1.0])
    for k, p in ((top_k, top_p), (top_k, None), (None, top_p)):
        oracle = ~torch.isinf(_sorted_top_k_top_p(logits, None if k is None else k.clamp(max=vocab), p))
        kept, probs = _kept(logits, k, p)  # CPU: the kernels' top-k and top-p masks
        assert torch.equal(kept, oracle)
        assert torch.allclose(probs.sum(dim=-1), torch.ones(12))
        # float64 takes the torch paths other devices take (topk; candidates, then a sort of the wide rows)
        kept64, probs64 = _kept(logits.double(), k, p)
        assert torch.equal(kept64, oracle)
        assert torch.allclose(probs64.float(), probs, atol=1e-6)
    kept = _kept(logits, top_k, top_p)[0].sum(dim=-1)
    assert kept[1] == 1 and kept[2] <= 7 and kept[4] == vocab


def test_argmax_rows_matches_torch_with_ties_and_nan():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 32000, generator=g)
    x[1, [7, 300, 31999]] = 100.0  # ties: the first maximum wins
    x[2, 11] = float("inf")
    x[3, [5, 9]] = float("nan")  # NaN is the maximum, as in torch
    x[4] = -float("inf")
    for rows in (x, x[:, ::2], x.to(torch.bfloat16), x[:1]):
        assert torch.equal(argmax_rows(rows), rows.argmax(dim=-1))
    assert argmax_rows(x).tolist()[:4] == [int(x[0].argmax()), 7, 11, 5]


def test_draw_follows_the_weights_and_never_picks_a_zero():
    weights = torch.tensor([0.0, 3.0, 0.0, 1.0, 0.0, 6.0, 0.0])  # unnormalized; zeros at both ends
    n = 40_000
    u = torch.rand(n, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    counts = torch.bincount(draw(weights.expand(n, -1), u), minlength=7).double() / n
    assert counts[[0, 2, 4, 6]].sum() == 0
    assert torch.allclose(counts, weights.double() / weights.sum(), atol=0.01)
    # the ends of [0, 1): the first weighted index, and the last (never the zeros past it)
    assert draw(weights.expand(2, -1), torch.tensor([0.0, 1.0 - 2**-53], dtype=torch.float64)).tolist() == [1, 5]
    assert 0 <= int(draw(torch.full((1, 7), float("nan")), torch.tensor([0.5]))) < 7  # a broken model's row
    # float64 weights take the torch path (running sums and a search) other devices take: the same tokens
    assert torch.equal(draw(weights.expand(n, -1).double(), u), draw(weights.expand(n, -1), u))
    assert 0 <= int(draw(torch.full((1, 7), float("nan"), dtype=torch.float64), torch.tensor([0.5]))) < 7


def test_max_tokens_and_stop_token_ids(llm):
    out = llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=7, ignore_eos=True), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 7 and out.outputs[0].finish_reason == "length"
    stop_at = out.outputs[0].token_ids[3]
    params = SamplingParams(temperature=0, max_tokens=7, ignore_eos=True, stop_token_ids=[stop_at])
    stopped = llm.generate([PROMPTS[0]], params, use_tqdm=False)[0].outputs[0]
    assert stopped.token_ids == out.outputs[0].token_ids[: out.outputs[0].token_ids.index(stop_at) + 1]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == stop_at


def test_eos_stops_unless_ignored(llm, tiny_model_path, tmp_path):
    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    tokens = llm.generate([PROMPTS[0]], greedy, use_tqdm=False)[0].outputs[0].token_ids
    eos = tokens[3]
    # The same model, with a config naming a token it is known to produce as EOS.
    shutil.copytree(tiny_model_path, tmp_path / "m")
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    (tmp_path / "m" / "config.json").write_text(json.dumps({**config, "eos_token_id": eos}))
    eos_llm = LLM(str(tmp_path / "m"), max_model_len=256)
    stopped = eos_llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=10), use_tqdm=False)[0].outputs[0]
    assert stopped.token_ids == tokens[: tokens.index(eos) + 1]
    assert stopped.finish_reason == "stop" and stopped.stop_reason is None
    ignored = eos_llm.generate([PROMPTS[0]], greedy, use_tqdm=False)[0].outputs[0]
    assert ignored.token_ids == tokens and ignored.finish_reason == "length"
