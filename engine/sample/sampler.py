"""Batched sampling over requests with different parameters: one pass of tensor ops per step, never a
Python loop over the vocabulary. Order, as in vLLM: raw logprobs; logit bias and min_tokens masks;
repetition/frequency/presence penalties; then greedy argmax, or temperature, min_p, top-k/top-p and a
draw (inverse CDF: one uniform number per row). A seeded request draws its number from a generator keyed by
(seed, output index), so a seeded sample depends on nothing else in the batch, nor on preemption."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from engine.core.request import Request
from ops.cpu.sampling import draw as cpu_draw
from ops.cpu.sampling import sample_rows as cpu_sample_rows
from ops.cpu.sampling import top_k_mask as cpu_top_k_mask
from ops.cpu.sampling import top_p_mask as cpu_top_p_mask

_SEED_MIX = 0x9E3779B97F4A7C15  # golden-ratio constant: spreads (seed, index) over the seed space


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """x.argmax(dim=-1), first maximum on ties, as torch's. On CPU through numpy: torch 2.13's CPU argmax over a
    row is a scalar loop (28 us for 32k float32 logits, 0.9 ms for 64 rows: 2-3% of a 56M model's decode
    step), numpy's is vectorized (2 us; 130 us)."""
    tokens = _numpy_argmax(x)
    return torch.from_numpy(tokens) if tokens is not None else x.argmax(dim=-1)


def greedy_tokens(x: torch.Tensor) -> list[int]:
    """argmax_rows(x) as a list, with no torch op where numpy can take the rows."""
    tokens = _numpy_argmax(x)
    return (tokens if tokens is not None else x.argmax(dim=-1)).tolist()


def _numpy_argmax(x: torch.Tensor) -> np.ndarray | None:
    """Each row's argmax through numpy, where x is rows numpy can read in place (float32 on the CPU); else None."""
    if x.device.type == "cpu" and x.dtype == torch.float32 and x.dim() == 2 and x.is_contiguous():
        return x.numpy().argmax(axis=-1)
    return None


def sample_seed(seed: int, output_index: int) -> int:
    return (seed * _SEED_MIX + output_index) & 0x7FFF_FFFF_FFFF_FFFF


@dataclass
class Penalties:
    rows: torch.Tensor  # rows of the batch that carry penalties
    presence: torch.Tensor  # [rows]
    frequency: torch.Tensor
    repetition: torch.Tensor
    output_tokens: torch.Tensor  # [rows, longest], padded with vocab_size
    prompt_tokens: torch.Tensor  # [rows, longest], padded with vocab_size


@dataclass
class SamplingMetadata:
    temperature: torch.Tensor | None  # [B] float32, 0 marks a greedy row; None when all rows are greedy
    all_greedy: bool
    top_k: torch.Tensor | None  # [B] int64, vocab size where disabled; None when no row uses it
    top_p: torch.Tensor | None  # [B], 1.0 where disabled
    min_p: torch.Tensor | None  # [B], 0.0 where disabled
    seeds: dict[int, int]  # row -> seed of this token's noise
    max_num_logprobs: int | None  # top logprobs to return (0: the sampled token's only); None: none
    logit_bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # rows, token ids, biases
    banned: tuple[torch.Tensor, torch.Tensor] | None = None  # rows, token ids masked to -inf
    penalties: Penalties | None = None


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # [B] int64
    # With logprobs requested: [B, 1 + k] token ids (sampled first, then the top k) and their logprobs,
    # and the sampled token's rank in the distribution.
    logprob_token_ids: torch.Tensor | None = None
    logprobs: torch.Tensor | None = None
    sampled_ranks: torch.Tensor | None = None
    # The logits after bias, penalties and bans: processed_probs(logits[rows], md, rows) is the distribution
    # sampled rows drew from (speculative decoding verifies drafts against it).
    logits: torch.Tensor | None = None


def build_sampling_metadata(requests: Sequence[Request], vocab_size: int, device: torch.device) -> SamplingMetadata:
    rows, seeds = [], {}
    max_logprobs = None
    bias_rows, bias_tokens, bias_values = [], [], []
    banned_rows, banned_tokens = [], []
    penalized: list[int] = []
    for row, request in enumerate(requests):
        params = request.sampling_params
        rows.append(params.sampling_row)
        if not params.needs_row_extras:  # the common case stops here
            continue
        if request.seed is not None and not params.greedy:
            seeds[row] = sample_seed(request.seed, request.num_output_tokens)
        if params.logprobs is not None:
            max_logprobs = max(max_logprobs or 0, params.logprobs)
        if params.logit_bias:
            for token, bias in params.logit_bias.items():
                bias_rows.append(row)
                bias_tokens.append(token)
                bias_values.append(bias)
        if request.num_output_tokens < params.min_tokens:
            stops = params.stop_token_ids + ([] if params.ignore_eos else list(request.eos_token_ids))
            banned_rows.extend([row] * len(stops))
            banned_tokens.extend(stops)
        if params.has_penalties:
            penalized.append(row)

    def tensor(values, dtype=None):
        return torch.tensor(values, dtype=dtype, device=device)

    all_greedy = not any(r[0] for r in rows)
    if all_greedy:  # the common offline case needs none of the per-row tensors
        temperature = top_k = top_p = min_p = None
    else:  # which settings any row uses, asked of the Python rows: each torch op on a tiny tensor costs ~5 us
        temperature = tensor([r[0] for r in rows], torch.float32)
        top_k = (tensor([int(r[1]) if r[1] > 0 else vocab_size for r in rows], torch.long)
                 if any(r[1] > 0 for r in rows) else None)
        top_p = tensor([r[2] for r in rows], torch.float32) if any(r[2] < 1 for r in rows) else None
        min_p = tensor([r[3] for r in rows], torch.float32) if any(r[3] > 0 for r in rows) else None
    return SamplingMetadata(
        temperature=temperature,
        all_greedy=all_greedy,
        top_k=top_k,
        top_p=top_p,
        min_p=min_p,
        seeds=seeds,
        max_num_logprobs=max_logprobs,
        logit_bias=(tensor(bias_rows), tensor(bias_tokens), tensor(bias_values, torch.float32)) if bias_rows else None,
        banned=(tensor(banned_rows), tensor(banned_tokens)) if banned_rows else None,
        penalties=_penalties([requests[r] for r in penalized], penalized, vocab_size, device) if penalized else None,
    )


def _penalties(requests: list[Request], rows: list[int], vocab_size: int, device: torch.device) -> Penalties:
    def padded(seqs: list[list[int]]) -> torch.Tensor:
        out = torch.full((len(seqs), max(1, max(map(len, seqs)))), vocab_size, dtype=torch.long, device="cpu")
        for i, seq in enumerate(seqs):  # filled on the CPU, then moved in one copy
            out[i, : len(seq)] = torch.tensor(seq, dtype=torch.long, device="cpu")
        return out.to(device)

    params = [r.sampling_params for r in requests]
    return Penalties(
        rows=torch.tensor(rows, device=device),
        presence=torch.tensor([p.presence_penalty for p in params], device=device),
        frequency=torch.tensor([p.frequency_penalty for p in params], device=device),
        repetition=torch.tensor([p.repetition_penalty for p in params], device=device),
        output_tokens=padded([r.output_token_ids for r in requests]),
        prompt_tokens=padded([r.prompt_token_ids for r in requests]),
    )


def apply_penalties(logits: torch.Tensor, p: Penalties) -> None:
    """In place, on the penalized rows. Frequency and presence count generated tokens only (OpenAI);
    repetition covers prompt and output tokens (vLLM, after the CTRL paper)."""
    vocab = logits.shape[1]
    rows = logits[p.rows]
    counts = torch.zeros(rows.shape[0], vocab + 1, device=logits.device)  # last column: padding
    counts.scatter_add_(1, p.output_tokens, torch.ones_like(p.output_tokens, dtype=counts.dtype))
    counts = counts[:, :vocab]
    seen = torch.zeros(rows.shape[0], vocab + 1, dtype=torch.bool, device=logits.device)
    seen.scatter_(1, p.prompt_tokens, True)
    seen = seen[:, :vocab] | (counts > 0)
    repetition = p.repetition[:, None]
    rows = torch.where(seen, torch.where(rows > 0, rows / repetition, rows * repetition), rows)
    rows -= p.frequency[:, None] * counts + p.presence[:, None] * (counts > 0)
    logits[p.rows] = rows


class Sampler:
    def __init__(self, seed: int, device: torch.device | str = "cpu") -> None:
        # On the logits' device: a generator draws only tensors of its own device.
        self.generator = torch.Generator(device).manual_seed(seed)
        self._row_generator = torch.Generator(device)

    def __call__(self, logits: torch.Tensor, md: SamplingMetadata) -> SamplerOutput:
        raw = logits.float()
        logits = raw
        if md.logit_bias is not None or md.banned is not None or md.penalties is not None:
            logits = raw.clone()
            if md.logit_bias is not None:
                rows, tokens, biases = md.logit_bias
                logits.index_put_((rows, tokens), biases, accumulate=True)
            if md.penalties is not None:
                apply_penalties(logits, md.penalties)
            if md.banned is not None:
                logits[md.banned] = float("-inf")
        if md.all_greedy:
            tokens = argmax_rows(logits)
        else:
            rows = (md.temperature > 0).nonzero().squeeze(1)
            if len(rows) == len(logits):  # none greedy: no argmax, no copy of the logits
                tokens = self._sample(logits, md, rows)
            else:
                tokens = argmax_rows(logits).index_copy(0, rows, self._sample(logits[rows], md, rows))
        out = SamplerOutput(token_ids=tokens, logits=logits)
        if md.max_num_logprobs is not None:
            out.logprob_token_ids, out.logprobs, out.sampled_ranks = gather_logprobs(raw, tokens, md.max_num_logprobs)
        return out

    def _sample(self, logits: torch.Tensor, md: SamplingMetadata, rows: torch.Tensor) -> torch.Tensor:
        u = torch.rand(len(rows), generator=self.generator, dtype=torch.float64, device=logits.device)
        if md.seeds:
            position = {int(r): j for j, r in enumerate(rows.tolist())}
            for row, seed in md.seeds.items():
                self._row_generator.manual_seed(seed)
                u[position[row]] = torch.rand((), generator=self._row_generator, dtype=torch.float64,
                                              device=logits.device)
        if md.min_p is None:  # on CPU, processed_probs and the draw row by row in one call
            tokens = cpu_sample_rows(logits, md.temperature[rows], None if md.top_k is None else md.top_k[rows],
                                     None if md.top_p is None else md.top_p[rows], u)
            if tokens is not None:
                return tokens
        return draw(processed_probs(logits, md, rows), u)


def draw(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One index per row of `weights` [rows, V] (non-negative, each row with some weight), with probability
    weight / the row's sum, by inverse CDF: the first index whose running sum exceeds u * the row's sum, u
    [rows] uniform in [0, 1). One random number per row, where an exponential race (argmax(w / E), E ~ Exp(1))
    takes one per token: torch's CPU exponential_ took 39 ms for 64 rows of 32k, longer than the 56M model's
    whole decode step; these float64 running sums take ~1.5 ms, ops/cpu/sampling.cpp's two passes ~0.5."""
    drawn = cpu_draw(weights, u)
    if drawn is not None:
        return drawn
    cdf = weights.cumsum(dim=-1, dtype=torch.float64)
    total = cdf[:, -1:].contiguous()
    picked = torch.searchsorted(cdf, u.to(cdf)[:, None] * total, right=True)
    last = torch.searchsorted(cdf, total)  # the last index with weight, should u * total round up to total
    return torch.minimum(picked, last).squeeze(1).clamp_(max=weights.shape[-1] - 1)  # NaN weights: in range


def processed_probs(logits: torch.Tensor, md: SamplingMetadata, rows: torch.Tensor) -> torch.Tensor:
    """The distribution non-greedy `rows` of the batch sample from, given their logits after bias,
    penalties and bans: temperature, min_p, top-k, then top-p over what top-k kept."""
    logits = logits / md.temperature[rows, None]
    if md.min_p is not None:
        probs = logits.softmax(dim=-1)
        threshold = md.min_p[rows, None] * probs.max(dim=-1, keepdim=True).values
        logits = logits.masked_fill(probs < threshold, float("-inf"))
    if md.top_k is not None:
        logits = top_k_mask(logits, md.top_k[rows])
    probs = logits.softmax(dim=-1)
    if md.top_p is not None:
        probs = top_p_mask(probs, md.top_p[rows])
    return probs


def gather_logprobs(logits: torch.Tensor, tokens: torch.Tensor, k: int) -> tuple[torch.Tensor, ...]:
    """Log-softmax of `logits` at `tokens` and at each row's top k, and the rank of `tokens`."""
    logprobs = logits.float().log_softmax(dim=-1)
    chosen = logprobs.gather(1, tokens[:, None])
    ranks = (logprobs > chosen).sum(dim=-1) + 1
    ids, values = tokens[:, None], chosen
    if k > 0:
        top_values, top_ids = logprobs.topk(k, dim=-1)
        ids, values = torch.cat([ids, top_ids], dim=1), torch.cat([values, top_values], dim=1)
    return ids, values, ranks


# Top-k and top-p by a threshold value (ties with the last token kept are kept too), found without sorting whole
# rows where it can be: torch's CPU sort took 1.2 ms per 32k-logit row (74 ms for 64 rows, twice the 56M model's
# decode step).


def top_k_mask(logits: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """`logits` with the values below each row's `top_k`-th largest (vocab size or more: none) set to -inf. On CPU
    in one call of ops/cpu/sampling.cpp (the k-th largest selected among the values above a floor guessed from a
    sample of the row, then the mask: ~3x torch's topk and two masking ops)."""
    vocab = logits.shape[-1]
    on = top_k < vocab
    if not bool(on.any()):
        return logits
    masked = cpu_top_k_mask(logits, top_k)
    if masked is not None:
        return masked
    k = top_k.clamp(1, vocab)
    largest = logits.topk(int(k[on].max()), dim=-1).values
    kth = largest.gather(1, (k - 1).clamp(max=largest.shape[-1] - 1)[:, None]).masked_fill_(~on[:, None],
                                                                                       float("-inf"))
    return logits.masked_fill(logits < kth, float("-inf"))


def top_p_mask(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """`probs` zeroed outside each row's nucleus and renormalized: a token is kept while the probability of the
    tokens ranked above it is under top_p (1: all). The same distribution as a softmax of logits masked outside
    the nucleus, without a second softmax. On CPU in one call (ops/cpu/sampling.cpp: the nucleus's floor by radix
    selection, then the kept mass and a scaled write)."""
    if not bool((top_p < 1).any()):
        return probs
    kept = cpu_top_p_mask(probs, top_p)
    if kept is not None:
        return kept
    kept = probs.masked_fill(probs < nucleus_floor(probs, top_p), 0.0)
    return kept.div_(kept.sum(dim=-1, keepdim=True))


NUCLEUS_CANDIDATES = 256  # without the CPU kernel: a row's most likely tokens, where top-p looks first


def nucleus_floor(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """[rows, 1]: the smallest probability each row's nucleus keeps (0 where top_p is 1), where the CPU kernel does
    not apply: among the row's NUCLEUS_CANDIDATES most likely tokens when they hold top_p of the mass (a trained
    model's usual case), and by sorting the rows where they do not."""
    floor = torch.zeros(probs.shape[0], 1, dtype=probs.dtype, device=probs.device)
    narrow = (top_p < 1).nonzero().squeeze(1)
    rows, row_top_p = (probs, top_p) if len(narrow) == len(top_p) else (probs[narrow], top_p[narrow])
    largest = rows.topk(min(NUCLEUS_CANDIDATES, rows.shape[-1]), dim=-1).values
    found = _floor_of_sorted(largest, row_top_p)
    wide = (largest.sum(dim=-1) < row_top_p).nonzero().squeeze(1)
    if len(wide):
        found[wide] = _floor_of_sorted(rows[wide].sort(dim=-1, descending=True).values, row_top_p[wide])
    floor[narrow] = found.to(floor.dtype)
    return floor


def _floor_of_sorted(ranked: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """[rows, 1]: the last probability of `ranked` (each row descending) whose tokens ranked above hold less
    than top_p (the first always: top_p > 0)."""
    above = ranked.cumsum(dim=-1) - ranked
    kept = (above < top_p[:, None]).sum(dim=-1, keepdim=True)
    return ranked.gather(1, kept - 1)
