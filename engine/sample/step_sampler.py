"""StepSampler: the tokens of a step from its logits. Each sampling request's rows go through the batched
sampler (structured-output masks first); requests with drafts are verified (greedy: the argmax matches;
otherwise rejection sampling against the draft's q); logprobs and prompt logprobs are gathered."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch

from engine.core.batch_builder import StepPlan
from engine.core.request import Request
from engine.core.scheduler import SchedulerOutput
from engine.sample.sampler import (
    Sampler,
    SamplerOutput,
    SamplingMetadata,
    build_sampling_metadata,
    gather_logprobs,
    greedy_tokens,
    processed_probs,
)
from engine.spec_decode.rejection_sampler import accept_greedy, rejection_sample
from engine.structured_output import StructuredOutputManager

# A logprob entry: (token ids, logprobs, rank of the first token). The first token is the sampled (or,
# for prompt logprobs, the actual next) token; the top-k ones follow.
LogprobEntry = tuple[list[int], list[float], int]


@dataclass
class StepOutput:
    # Aligned with SchedulerOutput.requests; None where a prefill chunk does not reach the end.
    sampled_token_ids: list[int | None]
    logprobs: list[LogprobEntry | None]
    # Per scheduled request asking for them: prompt logprobs of the positions computed this step.
    prompt_logprobs: dict[int, list[LogprobEntry]]
    # Speculative decoding, per request that verified drafts: how many were accepted (they come before
    # its sampled token), and their logprob entries when asked for.
    num_accepted_drafts: dict[int, int] = field(default_factory=dict)
    draft_logprobs: dict[int, list[LogprobEntry]] = field(default_factory=dict)

    @classmethod
    def empty(cls, num_requests: int) -> StepOutput:
        return cls([None] * num_requests, [None] * num_requests, {})


class StepSampler:
    def __init__(self, sampler: Sampler, device: torch.device, vocab_size: int,
                 structured_output: StructuredOutputManager) -> None:
        self.sampler, self.device, self.vocab_size = sampler, device, vocab_size
        self.structured_output = structured_output

    def sample(self, plan: StepPlan, logits: torch.Tensor | None) -> StepOutput:
        """Sample (and verify drafts, and gather logprobs) from the step's logits."""
        so, samplers = plan.so, plan.samplers
        out = StepOutput.empty(len(so.requests))
        if logits is None:
            return out
        if (samplers and plan.num_sampled == len(samplers) == len(logits) and not plan.prompt_rows
                and all(_argmax_only(so.requests[j]) for j in samplers)):
            # Greedy rows and nothing else asked: their argmax, without the batched sampler's tensors (each torch
            # op runs from memory after the step's weights streamed through the caches, ~50 us apiece).
            for j, token in zip(samplers, greedy_tokens(logits)):
                out.sampled_token_ids[j] = token
            return out
        return self._sample(plan, logits, out)

    @torch.inference_mode()
    def _sample(self, plan: StepPlan, logits: torch.Tensor, out: StepOutput) -> StepOutput:
        so, samplers, num_sampled, draft_probs = plan.so, plan.samplers, plan.num_sampled, plan.draft_probs
        if samplers:
            requests = [so.requests[j] for j in samplers]
            speculating = num_sampled > len(samplers)
            if speculating:  # one row per verified position
                requests = [view for r in requests for view in _position_views(r)]
            self.structured_output.apply_bitmask(logits[:num_sampled], requests)
            _force_thinking_tags(logits, requests)
            md = build_sampling_metadata(requests, self.vocab_size, self.device)
            sampled = self.sampler(logits[:num_sampled], md)
            if speculating:
                self._verify(so, samplers, logits[:num_sampled], md, sampled, draft_probs, out)
            else:
                for j, token in zip(samplers, sampled.token_ids.tolist()):
                    out.sampled_token_ids[j] = token
                if sampled.logprobs is not None:
                    entries = _logprob_entries(sampled.logprob_token_ids, sampled.logprobs, sampled.sampled_ranks)
                    for j, entry in zip(samplers, entries):
                        want = so.requests[j].sampling_params.logprobs
                        if want is not None:
                            out.logprobs[j] = (entry[0][: 1 + want], entry[1][: 1 + want], entry[2])
        offset = num_sampled
        for j, first, count, _ in plan.prompt_rows:
            request = so.requests[j]
            targets = torch.tensor(request.prompt_token_ids[first + 1 : first + 1 + count], device=self.device)
            k = request.sampling_params.prompt_logprobs
            out.prompt_logprobs[j] = _logprob_entries(*gather_logprobs(logits[offset : offset + count], targets, k))
            offset += count
        return out

    def _verify(
        self,
        so: SchedulerOutput,
        samplers: list[int],
        logits: torch.Tensor,
        md: SamplingMetadata,
        sampled: SamplerOutput,
        draft_probs: dict[int, torch.Tensor],
        out: StepOutput,
    ) -> None:
        """Emitted tokens of a step with drafts; each sampler owns 1 + len(drafts) consecutive rows.
        Greedy rows keep the sampler's argmax (exactly what decoding without drafts picks); non-greedy
        requests with drafts go through rejection sampling against the processed distributions."""
        tokens = sampled.token_ids.tolist()
        emitted: dict[int, tuple[int, list[int]]] = {}  # j -> (first row, tokens)
        rejection: list[tuple[int, int]] = []  # (j, first row)
        row = 0
        for j in samplers:
            drafts = so.requests[j].spec_token_ids
            if not drafts:
                emitted[j] = (row, [tokens[row]])
            elif so.requests[j].sampling_params.greedy:
                emitted[j] = (row, accept_greedy(drafts, tokens[row : row + 1 + len(drafts)]))
            else:
                rejection.append((j, row))
            row += 1 + len(drafts)
        if rejection:
            rows = [r for j, first in rejection for r in range(first, first + 1 + len(so.requests[j].spec_token_ids))]
            rows_t = torch.tensor(rows, device=self.device)
            p = processed_probs(sampled.logits[rows_t], md, rows_t)
            q = torch.cat([draft_probs[j] for j, _ in rejection]) if draft_probs else None
            drafts = [so.requests[j].spec_token_ids for j, _ in rejection]
            for (j, first), tokens_j in zip(rejection, rejection_sample(p, drafts, q, self.sampler.generator)):
                emitted[j] = (first, tokens_j)
        logprob_rows, logprob_tokens = [], []
        for j, (first, tokens_j) in emitted.items():
            out.sampled_token_ids[j] = tokens_j[-1]
            if so.requests[j].spec_token_ids:
                out.num_accepted_drafts[j] = len(tokens_j) - 1
            if md.max_num_logprobs is not None and so.requests[j].sampling_params.logprobs is not None:
                logprob_rows.extend(range(first, first + len(tokens_j)))
                logprob_tokens.extend(tokens_j)
        if logprob_rows:
            # Raw logprobs of the emitted tokens, position by position, as the sampler reports them.
            entries = iter(_logprob_entries(*gather_logprobs(
                logits[torch.tensor(logprob_rows, device=self.device)].float(),
                torch.tensor(logprob_tokens, device=self.device), md.max_num_logprobs,
            )))
            for j, (_, tokens_j) in emitted.items():
                want = so.requests[j].sampling_params.logprobs
                if want is None:
                    continue
                trimmed = [(e[0][: 1 + want], e[1][: 1 + want], e[2]) for e in (next(entries) for _ in tokens_j)]
                out.logprobs[j] = trimmed[-1]
                if len(trimmed) > 1:
                    out.draft_logprobs[j] = trimmed[:-1]


def _argmax_only(request: Request) -> bool:
    """Whether the request's token is its row's argmax, with no mask, bias, penalty or logprobs first."""
    params = request.sampling_params
    return params.greedy and not params.needs_row_extras and request.grammar is None and request.thinking is None


def _force_thinking_tags(logits: torch.Tensor, requests: list[Request]) -> None:
    """Rows whose thinking must take a tag's next token (engine/sample/thinking.py) can sample that token only."""
    for i, request in enumerate(requests):
        forced = request.thinking.forced_token() if request.thinking is not None else None
        if forced is not None:
            logits[i].fill_(float("-inf"))
            logits[i, forced] = 0.0


def _logprob_entries(ids: torch.Tensor, values: torch.Tensor, ranks: torch.Tensor) -> list[LogprobEntry]:
    return list(zip(ids.tolist(), values.tolist(), ranks.tolist()))


def _position_views(request: Request) -> list[Request]:
    """The request once per verified position. With penalties, position i sees the drafts before it as
    output tokens (shallow copies); otherwise every position samples alike."""
    drafts = request.spec_token_ids
    if not request.sampling_params.has_penalties:
        return [request] * (1 + len(drafts))
    views = [request]
    for i in range(1, 1 + len(drafts)):
        view = copy.copy(request)
        view.output_token_ids = request.output_token_ids + drafts[:i]
        views.append(view)
    return views
