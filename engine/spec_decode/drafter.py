"""Drafter: the draft tokens of a step, by n-gram prompt lookup, a draft model or the checkpoint's MTP layer,
for the requests the scheduler gave draft slots (scheduled past their last token)."""

from __future__ import annotations

import torch

from engine.core.kv_cache_manager import KVCacheManager
from engine.core.scheduler import SchedulerOutput
from engine.spec_decode.draft_proposer import DraftModelProposer
from engine.spec_decode.mtp_proposer import MTPProposer
from engine.spec_decode.ngram_proposer import NgramProposer


class Drafter:
    def __init__(self, ngram: NgramProposer | None = None, model: DraftModelProposer | None = None) -> None:
        """`model`: a draft model's proposer, or an MTPProposer."""
        self.ngram, self.model = ngram, model

    def propose(self, so: SchedulerOutput, kv: KVCacheManager) -> dict[int, torch.Tensor]:
        """Set the drafting requests' `spec_token_ids`; their scheduled tokens then shrink to 1 + the drafts
        found. Returns the draft model's q per non-greedy request (none for n-gram drafts: point masses)."""
        slots = {}
        for j, (request, n) in enumerate(zip(so.requests, so.num_scheduled_tokens)):
            if request.num_computed_tokens + n > request.num_tokens:
                slots[j] = request.num_computed_tokens + n - request.num_tokens
        probs = {}
        if self.model is not None:  # runs even without slots: the draft's KV follows every prompt
            probs = self.model.propose(so.requests, so.num_scheduled_tokens, slots, kv)
        else:
            for j, k in slots.items():
                so.requests[j].spec_token_ids = self.ngram.propose(so.requests[j].all_token_ids, k)
        for j in slots:
            so.num_scheduled_tokens[j] = 1 + len(so.requests[j].spec_token_ids)
        return probs

    def record_step(self, request_ids: list[str], starts: list[int], q_lens: list[int]) -> None:
        """The target step's rows, in batch order (the MTP layer reads its hidden states by them)."""
        if isinstance(self.model, MTPProposer):
            self.model.record_step(request_ids, starts, q_lens)

    def release(self, request_ids: list[str]) -> None:
        if self.model is not None:
            self.model.release(request_ids)
