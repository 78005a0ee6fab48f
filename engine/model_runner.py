"""Runs one scheduled step: flattens the scheduled tokens into a varlen batch, runs the model through
the attention backend, computes logits only at positions that sample, and samples."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from engine.block_table import BlockTable
from engine.config import EngineConfig
from engine.kv_cache_manager import KVCacheManager
from engine.models.config import ModelConfig
from engine.models.llama import LlamaForCausalLM
from engine.models.loader import build_model, resolve_model_path
from engine.request import Request
from engine.sampler import Sampler, SamplerOutput, SamplingMetadata, build_sampling_metadata, gather_logprobs, processed_probs
from engine.scheduler import SchedulerOutput
from engine.spec_decode.draft_proposer import DraftModelProposer
from engine.spec_decode.ngram_proposer import NgramProposer
from engine.spec_decode.rejection_sampler import accept_greedy, rejection_sample
from kernels.attention import AttentionMetadata, get_attention_backend
from kernels.cpu.linear import pack_linear_layers

_CPU_KV_CACHE_GB = 2.0


# A logprob entry: (token ids, logprobs, rank of the first token). The first token is the sampled (or,
# for prompt logprobs, the actual next) token; the top-k ones follow.
LogprobEntry = tuple[list[int], list[float], int]


@dataclass
class ModelRunnerOutput:
    # Aligned with SchedulerOutput.requests; None where a prefill chunk does not reach the end.
    sampled_token_ids: list[int | None]
    logprobs: list[LogprobEntry | None]
    # Per scheduled request asking for them: prompt logprobs of the positions computed this step.
    prompt_logprobs: dict[int, list[LogprobEntry]]
    # Speculative decoding, per request that verified drafts: how many were accepted (they come before
    # its sampled token), and their logprob entries when asked for.
    num_accepted_drafts: dict[int, int] = field(default_factory=dict)
    draft_logprobs: dict[int, list[LogprobEntry]] = field(default_factory=dict)


class ModelRunner:
    def __init__(
        self,
        config: EngineConfig,
        model_config: ModelConfig,
        model_path: Path,
        dtype: torch.dtype,
        device: torch.device,
        max_model_len: int,
    ) -> None:
        self.config = config
        self.model_config = model_config
        self.device = device
        self.dtype = dtype
        self.block_size = config.block_size
        self.max_model_len = max_model_len
        load_format = "safetensors" if config.load_format == "auto" else config.load_format
        self.model = build_model(model_config, model_path, load_format, dtype, device, config.seed)
        if device.type == "cpu":
            pack_linear_layers(self.model, config.max_num_seqs)
        spec = config.speculative_config
        self.draft_model = self._load_draft(spec.model, load_format) if spec and spec.method == "draft_model" else None
        self.num_blocks = self._num_kv_blocks()
        backend_cls = get_attention_backend(config.attention_backend, device.type)
        self.attn_backend = backend_cls(
            model_config.num_attention_heads,
            model_config.num_key_value_heads,
            model_config.head_dim,
            self.block_size,
            self.num_blocks,
            dtype,
            device,
        )
        # Zeroed, not empty: padded gathers read unwritten slots, and garbage could hold NaNs.
        for layer in self.model.attention_layers:
            layer.kv_cache = torch.zeros(self.attn_backend.kv_cache_shape(), dtype=dtype, device=device)
        self.sampler = Sampler(config.seed)
        self.structured_output = None  # the engine's StructuredOutputManager: masks constrained rows' logits
        self.block_table = BlockTable(config.max_num_seqs, -(-max_model_len // self.block_size))
        self.ngram = NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max) if spec and spec.method == "ngram" else None
        self.drafter = None
        if self.draft_model is not None:
            draft_cfg = self.draft_model.config
            draft_backend = backend_cls(
                draft_cfg.num_attention_heads, draft_cfg.num_key_value_heads, draft_cfg.head_dim,
                self.block_size, self.num_blocks, dtype, device,
            )
            # The draft's own KV, indexed by the target's block ids: one allocation, caching and freeing.
            for layer in self.draft_model.attention_layers:
                layer.kv_cache = torch.zeros(draft_backend.kv_cache_shape(), dtype=dtype, device=device)
            self.drafter = DraftModelProposer(
                self.draft_model, draft_backend,
                lambda request, kv: self.block_table.sync(request.request_id, kv.get_block_ids(request)),
                self._prepare_inputs, self.sampler.generator, device,
            )

    def _load_draft(self, model: str, load_format: str) -> LlamaForCausalLM:
        path = resolve_model_path(model)
        cfg = ModelConfig.from_pretrained(path)
        if cfg.vocab_size != self.model_config.vocab_size:
            raise ValueError(
                f"speculative_config.model: the draft's vocabulary has {cfg.vocab_size} tokens, the target's "
                f"{self.model_config.vocab_size}; pick a draft that shares the target's tokenizer"
            )
        if cfg.max_position_embeddings < self.max_model_len:
            raise ValueError(
                f"speculative_config.model: the draft handles {cfg.max_position_embeddings} positions, fewer than "
                f"max_model_len={self.max_model_len}; lower max_model_len or pick another draft"
            )
        draft = build_model(cfg, path, load_format, self.dtype, self.device, self.config.seed)
        if self.device.type == "cpu":
            pack_linear_layers(draft, self.config.max_num_seqs)
        return draft

    def _bytes_per_block(self) -> int:
        elem = torch.empty(0, dtype=self.dtype).element_size()
        configs = [self.model_config] + ([self.draft_model.config] if self.draft_model is not None else [])
        return sum(2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * self.block_size * elem for c in configs)

    def _num_kv_blocks(self) -> int:
        if self.config.num_kv_blocks is not None:
            return self.config.num_kv_blocks
        if self.config.kv_cache_memory_gb is not None:
            budget = self.config.kv_cache_memory_gb * 2**30
        elif self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            used = total - free
            budget = total * self.config.gpu_memory_utilization - used
            if budget <= 0:
                raise ValueError(
                    f"gpu_memory_utilization: {self.config.gpu_memory_utilization} leaves no room for the "
                    f"KV cache ({used / 2**30:.1f} GiB already in use); raise it or set kv_cache_memory_gb"
                )
        else:
            budget = _CPU_KV_CACHE_GB * 2**30
        # No point holding more than every running request at full length could use.
        ceiling = self.config.max_num_seqs * -(-self.max_model_len // self.block_size) + 1
        num_blocks = min(int(budget // self._bytes_per_block()), ceiling)
        if num_blocks < 2:
            raise ValueError("kv_cache_memory_gb: the budget holds less than 2 KV blocks; raise it")
        return num_blocks

    @torch.inference_mode()
    def execute(self, so: SchedulerOutput, kv: KVCacheManager) -> ModelRunnerOutput:
        self.release(so.released_request_ids)
        draft_probs = self._propose(so, kv) if self.ngram is not None or self.drafter is not None else {}
        # Decodes first: backends batch the leading single-token sequences together.
        order = sorted(range(len(so.requests)), key=lambda j: so.num_scheduled_tokens[j] != 1)
        input_ids: list[int] = []
        starts, q_lens, rows, widths = [], [], [], []
        samplers: list[int] = []  # index in so.requests of each request that samples, in batch order
        logit_rows: list[int] = []  # flat token rows whose logits are needed: samplers first
        prompt_rows: list[tuple[int, int, int, int]] = []  # (index in so.requests, first position, count, row)
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
            if start + n == request.num_tokens + len(drafts):
                samplers.append(j)
                if drafts:  # every verified position: the last token's and each draft's
                    logit_rows.extend(range(num_tokens + n - 1 - len(drafts), num_tokens + n))
                else:
                    logit_rows.append(num_tokens + n - 1)
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

        md, positions = self._prepare_inputs(starts, q_lens, rows, max(widths))
        self.attn_backend.plan(md)
        input_ids_t = torch.tensor(input_ids, dtype=torch.long, device=self.device)
        hidden = self.model(input_ids_t, positions, self.attn_backend)

        out = ModelRunnerOutput([None] * len(so.requests), [None] * len(so.requests), {})
        if not logit_rows:
            return out
        logits = self.model.compute_logits(hidden[torch.tensor(logit_rows, device=self.device)])
        if samplers:
            requests = [so.requests[j] for j in samplers]
            speculating = num_sampled > len(samplers)
            if speculating:  # one row per verified position
                requests = [view for r in requests for view in _position_views(r)]
            if self.structured_output is not None:
                self.structured_output.apply_bitmask(logits[:num_sampled], requests)
            md = build_sampling_metadata(requests, self.model_config.vocab_size, self.device)
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
        for j, first, count, _ in prompt_rows:
            request = so.requests[j]
            targets = torch.tensor(request.prompt_token_ids[first + 1 : first + 1 + count], device=self.device)
            k = request.sampling_params.prompt_logprobs
            out.prompt_logprobs[j] = _logprob_entries(*gather_logprobs(logits[offset : offset + count], targets, k))
            offset += count
        return out

    def release(self, request_ids: list[str]) -> None:
        """Forget per-request state of requests that left the running set."""
        for request_id in request_ids:
            self.block_table.release(request_id)
        if self.drafter is not None:
            self.drafter.release(request_ids)

    def _propose(self, so: SchedulerOutput, kv: KVCacheManager) -> dict[int, torch.Tensor]:
        """Draft tokens for the requests the scheduler gave draft slots (scheduled past their last token),
        whose scheduled tokens then shrink to 1 + the drafts found. Returns the draft model's q per
        non-greedy request (none for n-gram drafts: point masses)."""
        slots = {}
        for j, (request, n) in enumerate(zip(so.requests, so.num_scheduled_tokens)):
            if request.num_computed_tokens + n > request.num_tokens:
                slots[j] = request.num_computed_tokens + n - request.num_tokens
        probs = {}
        if self.drafter is not None:  # runs even without slots: the draft's KV follows every prompt
            probs = self.drafter.propose(so.requests, so.num_scheduled_tokens, slots, kv)
        else:
            for j, k in slots.items():
                so.requests[j].spec_token_ids = self.ngram.propose(so.requests[j].all_token_ids, k)
        for j in slots:
            so.num_scheduled_tokens[j] = 1 + len(so.requests[j].spec_token_ids)
        return probs

    def _verify(
        self,
        so: SchedulerOutput,
        samplers: list[int],
        logits: torch.Tensor,
        md: SamplingMetadata,
        sampled: SamplerOutput,
        draft_probs: dict[int, torch.Tensor],
        out: ModelRunnerOutput,
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

    def _prepare_inputs(
        self, starts: list[int], q_lens: list[int], rows: list[int], width: int
    ) -> tuple[AttentionMetadata, torch.Tensor]:
        """Attention metadata and token positions, vectorised over the batch."""
        num_seqs = len(q_lens)
        num_decodes = next((i for i, n in enumerate(q_lens) if n != 1), num_seqs)
        q_lens_np = np.asarray(q_lens, dtype=np.int64)
        starts_np = np.asarray(starts, dtype=np.int64)
        seq_lens_np = starts_np + q_lens_np
        query_start_loc = np.zeros(num_seqs + 1, dtype=np.int64)
        np.cumsum(q_lens_np, out=query_start_loc[1:])
        num_tokens = int(query_start_loc[-1])
        # Position of every token: its sequence's start plus its offset within the chunk.
        token_seq = np.repeat(np.arange(num_seqs), q_lens_np)
        positions = np.arange(num_tokens) - query_start_loc[token_seq] + starts_np[token_seq]
        # Columns past a request's blocks may hold stale ids; attention never reads past seq_lens.
        block_tables = self.block_table.table[rows, :width]
        bs = self.block_size
        slot_mapping = block_tables[token_seq, positions // bs] * bs + positions % bs
        dev = self.device
        md = AttentionMetadata(
            num_tokens=num_tokens,
            num_decodes=num_decodes,
            query_start_loc_cpu=query_start_loc.tolist(),
            seq_lens_cpu=seq_lens_np.tolist(),
            query_start_loc=torch.from_numpy(query_start_loc).to(dev, torch.int32),
            seq_lens=torch.from_numpy(seq_lens_np).to(dev, torch.int32),
            block_tables=torch.from_numpy(block_tables).to(dev, torch.int32),
            slot_mapping=torch.from_numpy(slot_mapping).to(dev),
        )
        return md, torch.from_numpy(positions).to(dev)


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
