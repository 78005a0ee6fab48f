"""Drafting with the checkpoint's multi-token prediction layer (DeepSeek-V3; engine/models/deepseek_mtp.py).

At position p the layer reads the target's final hidden state h_p with the embedding of token p + 1, and
predicts token p + 2. Its KV lives as a draft model's does (engine/spec_decode/draft_proposer.py: its own
tensors under the target's block ids and tables), so it must see every position the target computes, one
behind: a step's target forward leaves its hidden states on the driver's worker, and the next step's
proposal first feeds the layer each request's new positions p < num_computed_tokens, whose next token is
known. Hidden states of positions at or past num_computed_tokens came from rejected drafts and are dropped.
That forward's last row of a decoding request (p = num_computed_tokens - 1) gives the first draft; each
further draft feeds the layer its own output as the hidden state of the next position, with the draft just
made. Positions the target did not compute (a prefix-cache hit) keep whatever MTP KV their blocks hold: it
only costs acceptance, never correctness, as verification decides every token."""

from __future__ import annotations

import torch

from engine.core.block_table import BlockTable
from engine.core.kv_cache_manager import KVCacheManager
from engine.core.request import Request
from engine.executor.worker import Worker
from engine.spec_decode.draft_proposer import DraftModelProposer, DraftSampler


class MTPProposer(DraftModelProposer):
    def __init__(self, worker: Worker, block_table: BlockTable, block_size: int, generator: torch.Generator,
                 target: Worker) -> None:
        super().__init__(worker, block_table, block_size, generator)
        self.target = target
        target.keep_hidden_states = worker.keep_hidden_states = True
        self._layout: list[tuple[str, int, int]] = []  # the last target step: (request id, first position, tokens)
        # Request id -> (first position, the target's hidden states from it on) not yet fed to the layer.
        self._hidden: dict[str, tuple[int, torch.Tensor]] = {}

    def record_step(self, request_ids: list[str], starts: list[int], q_lens: list[int]) -> None:
        """The rows of the target step about to run: whose positions its hidden states will be."""
        self._layout = list(zip(request_ids, starts, q_lens))

    def release(self, request_ids: list[str]) -> None:
        super().release(request_ids)
        for request_id in request_ids:
            self._hidden.pop(request_id, None)

    def _take_hidden(self) -> None:
        """File the last target step's hidden states under their requests (none if that step never ran)."""
        hidden, self.target.hidden_states = self.target.hidden_states, None
        layout, self._layout = self._layout, []
        if hidden is None or hidden.shape[0] != sum(n for _, _, n in layout):
            return
        row = 0
        for request_id, start, n in layout:
            rows, row = hidden[row : row + n], row + n
            pending = self._hidden.get(request_id)
            if pending is not None and pending[0] + len(pending[1]) == start:  # a prefill continued
                start, rows = pending[0], torch.cat([pending[1], rows])
            self._hidden[request_id] = (start, rows)

    def propose(
        self, requests: list[Request], num_scheduled: list[int], slots: dict[int, int], kv: KVCacheManager
    ) -> dict[int, torch.Tensor]:
        self._take_hidden()
        try:
            return self._propose(requests, slots, kv)
        finally:
            self.worker.hidden_states = None

    def _propose(self, requests: list[Request], slots: dict[int, int], kv: KVCacheManager) -> dict[int, torch.Tensor]:
        # Forward 1: each scheduled request's new positions, through num_computed_tokens - 1.
        seqs: list[tuple[int, int, list[int], torch.Tensor]] = []  # (index, first position, next tokens, hidden)
        for j, request in enumerate(requests):
            request.spec_token_ids = []
            pending = self._hidden.pop(request.request_id, None)
            if pending is None:
                continue
            first, rows = pending
            end = min(first + len(rows), request.num_computed_tokens)
            if end > first:
                seqs.append((j, first, request.all_token_ids[first + 1 : end + 1], rows[: end - first]))
        seqs.sort(key=lambda s: len(s[2]) != 1)  # backends want single-token sequences first
        # A request drafts when that forward reached the position before its last token.
        drafting = [j for j, first, tokens, _ in seqs
                    if j in slots and first + len(tokens) == requests[j].num_computed_tokens]
        if not seqs:
            return {}
        logits, hidden = self._run(requests, [s[:3] for s in seqs], kv, drafting, torch.cat([s[3] for s in seqs]))
        if not drafting:
            return {}
        sampler = DraftSampler(requests, drafting, self.vocab_size, self.device, self.generator)
        for j, token in zip(drafting, sampler.pick(logits, drafting)):
            requests[j].spec_token_ids = [token]
        # Drafts 2..k: the layer's own output stands in for the target's hidden state one position on.
        for step in range(1, max(slots[j] for j in drafting)):
            active = [j for j in drafting if slots[j] > step]
            chained = [(j, requests[j].num_computed_tokens + step - 1, requests[j].spec_token_ids[-1:])
                       for j in active]
            logits, hidden = self._run(requests, chained, kv, active, torch.stack([hidden[j] for j in active]))
            for j, token in zip(active, sampler.pick(logits, active)):
                requests[j].spec_token_ids.append(token)
        return sampler.distributions()

    def _run(self, requests: list[Request], seqs: list[tuple[int, int, list[int]]], kv: KVCacheManager,
             wanted: list[int], previous_hidden: torch.Tensor) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """The layer over `seqs`: logits at the last token of each sequence in `wanted`, and its output there
        (the hidden state the request's next draft continues from)."""
        logits = self._forward(requests, seqs, kv, wanted, previous_hidden)
        last_row, total = {}, 0
        for j, _, tokens in seqs:
            total += len(tokens)
            last_row[j] = total - 1
        rows = self.worker.hidden_states[torch.tensor([last_row[j] for j in wanted], device=self.device)]
        return logits, dict(zip(wanted, rows))
