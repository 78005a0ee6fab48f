"""BatchBuilder: the model input of a scheduled step. It flattens the scheduled tokens into one varlen
batch (decodes first, then by LoRA slot), keeps the persistent block table, asks the drafter for draft
tokens, adds the KV connector's loads and saves, and notes which logit rows each request samples from."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from engine.config import EngineConfig
from engine.core.block_table import BlockTable
from engine.core.encoder_cache import EncoderCache
from engine.core.kv_cache_manager import KVCacheManager
from engine.core.scheduler import SchedulerOutput
from engine.executor.model_input import ModelInput
from engine.kv_transfer.base import KVConnector
from engine.multimodal.inputs import MultiModalInput
from engine.multimodal.mrope import mrope_positions
from engine.pooling.pooler import Pooler
from engine.spec_decode.drafter import Drafter


@dataclass
class StepPlan:
    """A step between `build` and sampling: its input, and where its logits go."""

    so: SchedulerOutput
    inp: ModelInput
    samplers: list[int]  # index in so.requests of each request that samples, in batch order
    num_sampled: int  # logit rows of the samplers (one per verified position); prompt logprob rows follow
    prompt_rows: list[tuple[int, int, int, int]]  # (index in so.requests, first position, count, row)
    draft_probs: dict[int, torch.Tensor]
    pooled: list[tuple[int, int]] = field(default_factory=list)  # an embedder's: (index in so.requests, start)


class BatchBuilder:
    def __init__(self, config: EngineConfig, block_tables: list[BlockTable], drafter: Drafter | None,
                 kv_connector: KVConnector | None, encoder_cache: EncoderCache | None = None,
                 mrope_merge: int | None = None, pooler: Pooler | None = None) -> None:
        """`block_tables`: one per KV cache group (engine/core/kv_cache_groups.py), the primary group's first.
        `encoder_cache`: a vision-language model's (images' embeddings). `mrope_merge`: an M-RoPE model's
        spatial merge size (its image tokens' positions follow their merged patch grid). `pooler`: an embedder's
        (its requests pool rows instead of sampling)."""
        self.block_size = config.block_size
        self.enable_lora = config.enable_lora
        self.block_table, self.window_tables = block_tables[0], block_tables[1:]
        self.drafter, self.kv_connector = drafter, kv_connector
        self.encoder_cache = encoder_cache
        self.mrope_merge = mrope_merge
        self.pooler = pooler

    @torch.inference_mode()
    def build(self, so: SchedulerOutput, kv: KVCacheManager) -> StepPlan:
        """Draft tokens (speculative decoding), then the step's ModelInput and what to sample from it."""
        self.release(so.released_request_ids)
        draft_probs = self.drafter.propose(so, kv) if self.drafter is not None else {}
        # Decodes first: backends batch the leading single-token sequences together. Then by LoRA slot, so
        # that each adapter's tokens form few runs (engine/lora/layers.py); without LoRA every slot is -1.
        order = sorted(range(len(so.requests)),
                       key=lambda j: (so.num_scheduled_tokens[j] != 1, so.requests[j].lora_slot))
        input_ids: list[int] = []
        starts, q_lens, rows, widths = [], [], [], []
        window_rows: list[list[int]] = [[] for _ in self.window_tables]
        samplers: list[int] = []  # index in so.requests of each request that samples, in batch order
        logit_rows: list[int] = []  # flat token rows whose logits are needed: samplers first
        prompt_rows: list[tuple[int, int, int, int]] = []  # (index in so.requests, first position, count, row)
        images: list[MultiModalInput] = []  # whose placeholder tokens this step computes
        placements: list[tuple[str, int, int, int]] = []  # (image hash, first embedding, count, first row)
        pooled: list[tuple[int, int]] = []  # an embedder's requests that pool this step: (index, start)
        segments: list[tuple[int, int]] = []  # and their rows: (first row, count)
        num_tokens = 0
        for j in order:
            request, n = so.requests[j], so.num_scheduled_tokens[j]
            start = request.num_computed_tokens
            drafts = request.spec_token_ids
            if n == 1:
                input_ids.append(request.all_token_ids[start])
            else:
                input_ids.extend(request.all_token_ids[start : start + n])
                input_ids.extend(drafts)
            starts.append(start)
            q_lens.append(n)
            row, width = self.block_table.sync(request.request_id, kv.get_block_ids(request))
            rows.append(row)
            widths.append(width)
            if self.window_tables:  # a window group's list is as long as the primary's (null where it skipped)
                for table, g_rows, ids in zip(self.window_tables, window_rows, kv.get_window_block_ids(request)):
                    g_rows.append(table.sync(request.request_id, ids)[0])
            if self.pooler is not None:
                pooled_rows = self.pooler.rows(start, n, request.num_prompt_tokens)
                if pooled_rows is not None:
                    pooled.append((j, start))
                    segments.append((num_tokens + pooled_rows[0], pooled_rows[1]))
            elif start + n == request.num_tokens + len(drafts):
                samplers.append(j)
                if drafts:  # every verified position: the last token's and each draft's
                    logit_rows.extend(range(num_tokens + n - 1 - len(drafts), num_tokens + n))
                else:
                    logit_rows.append(num_tokens + n - 1)
            for image in request.mm_inputs:
                first, last = max(start, image.offset), min(start + n, image.end)
                if first < last:
                    images.append(image)
                    placements.append((image.content_hash, first - image.offset, last - first,
                                       num_tokens + first - start))
            if request.wants_prompt_logprobs:
                # Position p predicts prompt token p + 1; skip positions already done before a preemption.
                first = max(start, len(request.prompt_logprobs) - 1)
                last = min(start + n, request.num_prompt_tokens - 1)
                if last > first:
                    prompt_rows.append((j, first, last - first, num_tokens + first - start))
            num_tokens += n
        num_sampled = len(logit_rows)
        for _, _, count, row in prompt_rows:
            logit_rows.extend(range(row, row + count))

        lora_slots = [so.requests[j].lora_slot for j in order] if self.enable_lora else None
        width = max(widths)
        inp = ModelInput.build(input_ids, starts, q_lens, self.block_table.table[rows, :width], self.block_size,
                               logit_rows, lora_slots,
                               [t.table[r, :width] for t, r in zip(self.window_tables, window_rows)])
        if segments:
            inp.pool_segments = np.asarray(segments, dtype=np.int64)
        if placements:
            inp.mm_encode, inp.mm_evict = self.encoder_cache.plan(images)
            inp.mm_placements = placements
        if self.mrope_merge is not None and any(so.requests[j].mm_inputs for j in order):
            inp.mrope_positions = np.concatenate(
                [mrope_positions(so.requests[j].mm_inputs, self.mrope_merge, start, n)
                 for j, start, n in zip(order, starts, q_lens)], axis=1)
        if self.drafter is not None:
            self.drafter.record_step([so.requests[j].request_id for j in order], starts, q_lens)
        if self.kv_connector is not None:
            meta = self.kv_connector.build_connector_meta(so.requests, so.num_scheduled_tokens,
                                                          [kv.get_block_ids(r) for r in so.requests])
            inp.kv_meta = meta or None
        return StepPlan(so, inp, samplers, num_sampled, prompt_rows, draft_probs, pooled)

    def release(self, request_ids: list[str]) -> None:
        """Forget per-request state of requests that left the running set."""
        for request_id in request_ids:
            for table in (self.block_table, *self.window_tables):
                table.release(request_id)
        if self.drafter is not None:
            self.drafter.release(request_ids)
