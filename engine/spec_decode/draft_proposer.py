"""Drafting with a small model that shares the target's vocabulary.

The draft keeps its own KV tensors, indexed by the target's block ids and block tables: allocation,
prefix caching, preemption and freeing stay the target's one mechanism, and a block's draft KV is valid
wherever its target KV is. To keep it so, every step the draft first runs over what the target computes
(prompt chunks, plain decodes) and catches up on tokens it has not seen (a request's last token, an
accepted draft it never fed); that forward also yields the first draft of each drafting request. Then
k - 1 single-token forwards extend the drafts. Their KV lands in slots the scheduler reserved for the
drafts, so rejected drafts need no cleanup: their slots are rewritten before anything reads them."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from engine.kv_cache_manager import KVCacheManager
from engine.models.llama import LlamaForCausalLM
from engine.request import Request
from engine.sampler import build_sampling_metadata, processed_probs
from engine.spec_decode.rejection_sampler import draw
from kernels.attention import AttentionBackend, AttentionMetadata

# (starts, query lengths, block-table rows, widest row) -> attention metadata and token positions
PrepareInputs = Callable[[list[int], list[int], list[int], int], tuple[AttentionMetadata, torch.Tensor]]


class DraftModelProposer:
    def __init__(
        self,
        model: LlamaForCausalLM,
        backend: AttentionBackend,
        sync_row: Callable[[Request, KVCacheManager], tuple[int, int]],
        prepare_inputs: PrepareInputs,
        generator: torch.Generator,
        device: torch.device,
    ) -> None:
        self.model = model
        self.backend = backend
        self.sync_row = sync_row
        self.prepare_inputs = prepare_inputs
        self.generator = generator
        self.device = device
        self.vocab_size = model.config.vocab_size
        # Request id -> leading positions whose draft KV is valid. Rollback needs no bookkeeping: it is
        # clamped to the target's computed tokens, which rollback resets.
        self._num_computed: dict[str, int] = {}

    def release(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self._num_computed.pop(request_id, None)

    def propose(
        self, requests: list[Request], num_scheduled: list[int], slots: dict[int, int], kv: KVCacheManager
    ) -> dict[int, torch.Tensor]:
        """Set `spec_token_ids` of each request j in `slots` to slots[j] drafts; returns, for non-greedy
        requests, the distributions q the drafts were drawn from ([slots[j], vocab])."""
        # Forward 1: catch up every scheduled request; drafting ones through their last token.
        seqs: list[tuple[int, int, list[int]]] = []  # (index, first position, tokens)
        for j, (request, n) in enumerate(zip(requests, num_scheduled)):
            start = request.num_computed_tokens
            begin = min(self._num_computed.get(request.request_id, start), start)
            end = request.num_tokens if j in slots else start + n
            if end > begin:
                seqs.append((j, begin, request.all_token_ids[begin:end]))
                self._num_computed[request.request_id] = end
        if not seqs:
            return {}
        seqs.sort(key=lambda s: len(s[2]) != 1)  # backends want single-token sequences first
        drafting = [j for j, _, _ in seqs if j in slots]
        logits = self._forward(requests, seqs, kv, drafting)
        if not drafting:
            return {}
        md = build_sampling_metadata([requests[j] for j in drafting], self.vocab_size, self.device)
        md_row = {j: i for i, j in enumerate(drafting)}
        probs: dict[int, list[torch.Tensor]] = {j: [] for j in drafting if not requests[j].sampling_params.greedy}

        def pick(logits: torch.Tensor, active: list[int]) -> list[int]:
            tokens = logits.argmax(dim=-1)
            rows = [i for i, j in enumerate(active) if j in probs]
            if rows:
                # Non-greedy drafts come from the request's own processed distribution (temperature,
                # top-k/top-p/min-p), so they stay close to the target's; verification needs that q.
                md_rows = torch.tensor([md_row[active[i]] for i in rows], device=self.device)
                q = processed_probs(logits[rows].float(), md, md_rows)
                tokens[rows] = draw(q, self.generator).to(tokens.device)
                for i, row in zip(rows, q):
                    probs[active[i]].append(row)
            return tokens.tolist()

        tokens = pick(logits, drafting)
        for j, token in zip(drafting, tokens):
            requests[j].spec_token_ids = [token]
        # Forwards 2..k: each drafting request feeds its latest draft, one token at a time.
        for step in range(1, max(slots[j] for j in drafting)):
            active = [j for j in drafting if slots[j] > step]
            seqs = [(j, requests[j].num_tokens + step - 1, requests[j].spec_token_ids[-1:]) for j in active]
            tokens = pick(self._forward(requests, seqs, kv, active), active)
            for j, token in zip(active, tokens):
                requests[j].spec_token_ids.append(token)
                self._num_computed[requests[j].request_id] = requests[j].num_tokens + step
        return {j: torch.stack(rows) for j, rows in probs.items()}

    def _forward(
        self, requests: list[Request], seqs: list[tuple[int, int, list[int]]], kv: KVCacheManager, wanted: list[int]
    ) -> torch.Tensor:
        """Run the draft over `seqs` (index, first position, tokens); logits at the last token of each
        sequence in `wanted`, in that order."""
        starts, q_lens, rows, widths, input_ids = [], [], [], [], []
        last_row: dict[int, int] = {}
        for j, begin, tokens in seqs:
            row, width = self.sync_row(requests[j], kv)
            starts.append(begin)
            q_lens.append(len(tokens))
            rows.append(row)
            widths.append(width)
            input_ids.extend(tokens)
            last_row[j] = len(input_ids) - 1
        md, positions = self.prepare_inputs(starts, q_lens, rows, max(widths))
        self.backend.plan(md)
        hidden = self.model(torch.tensor(input_ids, dtype=torch.long, device=self.device), positions, self.backend)
        if not wanted:
            return hidden[:0]
        index = torch.from_numpy(np.asarray([last_row[j] for j in wanted], dtype=np.int64)).to(self.device)
        return self.model.compute_logits(hidden[index])
