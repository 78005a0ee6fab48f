"""Batched sampling over requests with different parameters: one pass of tensor ops per step, never a
Python loop over the vocabulary. Seeded requests draw their noise from a generator keyed by
(seed, output index), so a seeded sample depends on nothing else in the batch, nor on preemption."""

from __future__ import annotations

from dataclasses import dataclass

import torch

_SEED_MIX = 0x9E3779B97F4A7C15  # golden-ratio constant: spreads (seed, index) over the seed space


@dataclass
class SamplingMetadata:
    temperature: torch.Tensor  # [B] float32; 0 marks a greedy row
    all_greedy: bool
    top_k: torch.Tensor | None  # [B] int64, vocab size where disabled; None when no row uses it
    top_p: torch.Tensor | None  # [B] float32, 1.0 where disabled; None when no row uses it
    seeds: dict[int, int]  # row -> per-sample seed for this token
    max_num_logprobs: int | None  # top logprobs to return (0: the sampled token's only); None: none


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # [B] int64
    # With logprobs requested: [B, 1 + k] token ids (sampled first, then the top k) and their logprobs,
    # and the sampled token's rank in the distribution.
    logprob_token_ids: torch.Tensor | None = None
    logprobs: torch.Tensor | None = None
    sampled_ranks: torch.Tensor | None = None


def sample_seed(seed: int, output_index: int) -> int:
    return (seed * _SEED_MIX + output_index) & 0x7FFF_FFFF_FFFF_FFFF


class Sampler:
    def __init__(self, seed: int) -> None:
        self.generator = torch.Generator().manual_seed(seed)
        self._row_generator = torch.Generator()

    def __call__(self, logits: torch.Tensor, md: SamplingMetadata) -> SamplerOutput:
        logits = logits.float()
        greedy = logits.argmax(dim=-1)
        if md.all_greedy:
            tokens = greedy
        else:
            rows = (md.temperature > 0).nonzero().squeeze(1)
            sampled = self._sample(logits[rows], md, rows)
            tokens = greedy.index_copy(0, rows, sampled)
        out = SamplerOutput(token_ids=tokens)
        if md.max_num_logprobs is not None:
            self._gather_logprobs(logits, tokens, md.max_num_logprobs, out)
        return out

    def _sample(self, logits: torch.Tensor, md: SamplingMetadata, rows: torch.Tensor) -> torch.Tensor:
        logits = logits / md.temperature[rows, None]
        top_k = md.top_k[rows] if md.top_k is not None else None
        top_p = md.top_p[rows] if md.top_p is not None else None
        if top_k is not None or top_p is not None:
            logits = apply_top_k_top_p(logits, top_k, top_p)
        probs = logits.softmax(dim=-1)
        # Exponential race: argmax(p / E) with E ~ Exp(1) draws from p (a Gumbel-max in disguise).
        noise = torch.empty_like(probs).exponential_(generator=self.generator)
        if md.seeds:
            position = {int(r): j for j, r in enumerate(rows.tolist())}
            for row, seed in md.seeds.items():
                self._row_generator.manual_seed(seed)
                noise[position[row]].exponential_(generator=self._row_generator)
        return probs.div_(noise).argmax(dim=-1)

    @staticmethod
    def _gather_logprobs(logits: torch.Tensor, tokens: torch.Tensor, k: int, out: SamplerOutput) -> None:
        logprobs = logits.log_softmax(dim=-1)
        sampled = logprobs.gather(1, tokens[:, None])
        out.sampled_ranks = (logprobs > sampled).sum(dim=-1) + 1
        ids = tokens[:, None]
        values = sampled
        if k > 0:
            top_values, top_ids = logprobs.topk(k, dim=-1)
            ids = torch.cat([ids, top_ids], dim=1)
            values = torch.cat([values, top_values], dim=1)
        out.logprob_token_ids, out.logprobs = ids, values


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> torch.Tensor:
    """Mask logits outside each row's top-k and top-p (nucleus) sets with -inf."""
    sorted_logits, order = logits.sort(dim=-1, descending=False)
    vocab = logits.shape[-1]
    if top_k is not None:
        kth = sorted_logits.gather(1, (vocab - top_k).clamp(0, vocab - 1)[:, None])
        sorted_logits.masked_fill_(sorted_logits < kth, float("-inf"))
    if top_p is not None:
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        drop = cumulative <= (1 - top_p)[:, None]
        drop[:, -1] = False  # always keep the most likely token
        sorted_logits.masked_fill_(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)
