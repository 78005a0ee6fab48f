"""Runs one scheduled step: flattens the scheduled tokens into a varlen batch, runs the model through
the attention backend, computes logits only at positions that sample, and samples."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from pathlib import Path

import torch

from engine.block_table import BlockTable
from engine.config import EngineConfig
from engine.kv_cache_manager import KVCacheManager
from engine.models.config import ModelConfig
from engine.models.layers.quantization import QuantizationConfig, resolve_quant_config
from engine.models.llama import LlamaForCausalLM
from engine.models.loader import build_model, resolve_model_path
from engine.model_spec import ModelSpec
from engine.executor import ModelInput, Rendezvous, create_executor
from engine.request import Request
from engine.sampler import Sampler, SamplerOutput, SamplingMetadata, build_sampling_metadata, gather_logprobs, processed_probs
from engine.scheduler import SchedulerOutput
from engine.spec_decode.draft_proposer import DraftModelProposer
from engine.spec_decode.ngram_proposer import NgramProposer
from engine.spec_decode.rejection_sampler import accept_greedy, rejection_sample
from kernels.attention import AttentionMetadata, get_attention_backend


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


@dataclass
class StepPlan:
    """A step between `prepare` and `finish`: its input, and where its logits go."""

    so: SchedulerOutput
    inp: ModelInput
    samplers: list[int]  # index in so.requests of each request that samples, in batch order
    num_sampled: int  # logit rows of the samplers (one per verified position); prompt logprob rows follow
    prompt_rows: list[tuple[int, int, int, int]]  # (index in so.requests, first position, count, row)
    draft_probs: dict[int, torch.Tensor]


class ModelRunner:
    """The driver's side of a step: which token rows to run and which to sample (engine/executor runs the
    forward on every rank), then sampling, speculative drafting and verification, structured-output masks.
    A draft model for speculative decoding lives here too, whole, on the driver alone."""

    def __init__(self, config: EngineConfig, spec: ModelSpec, rendezvous: Rendezvous | None = None) -> None:
        self.config = config
        self.spec = spec
        self.model_config = spec.model_config
        self.dtype = spec.dtype
        self.block_size = config.block_size
        self.max_model_len = spec.max_model_len
        draft = config.speculative_config
        # The draft's config is checked before any worker starts; its weights load on the driver's device.
        draft_checkpoint = self._draft_checkpoint(draft.model) if draft and draft.method == "draft_model" else None
        draft_bytes = self._draft_bytes_per_block(draft_checkpoint[1]) if draft_checkpoint else 0
        self.executor = create_executor(config, spec, rendezvous, draft_bytes)
        # The driver rank's device, made its current one when it started: every tensor of a step is made there.
        self.device = self.executor.driver_worker.device
        try:
            self._init_driver(draft_checkpoint)
        except BaseException:  # the workers are up: they go too
            self.executor.shutdown()
            raise

    def _init_driver(self, draft_checkpoint: tuple[Path, ModelConfig, QuantizationConfig | None] | None) -> None:
        config, draft = self.config, self.config.speculative_config
        self.num_blocks = self.executor.num_blocks
        self.sampler = Sampler(config.seed, self.device)
        self.structured_output = None  # the engine's StructuredOutputManager: masks constrained rows' logits
        self.kv_connector = None  # the scheduler's KV connector (disaggregated prefill/decode), set by the engine
        self.block_table = BlockTable(config.max_num_seqs, -(-self.max_model_len // self.block_size))
        self.ngram = NgramProposer(draft.prompt_lookup_min, draft.prompt_lookup_max) if draft and draft.method == "ngram" else None
        self.drafter = None
        self.draft_model = None
        if draft_checkpoint is None:
            return
        path, draft_cfg, quant_config = draft_checkpoint
        load_format = "safetensors" if config.load_format == "auto" else config.load_format
        self.draft_model = build_model(draft_cfg, path, load_format, self.dtype, self.device, config.seed,
                                       config.max_num_seqs, quant_config)
        backend_cls = get_attention_backend(config.attention_backend, self.device.type)
        draft_backend = backend_cls(
            draft_cfg.num_attention_heads, draft_cfg.num_key_value_heads, draft_cfg.head_dim,
            self.block_size, self.num_blocks, self.dtype, self.device,
        )
        # The draft's own KV, indexed by the target's block ids: one allocation, caching and freeing.
        for layer in self.draft_model.attention_layers:
            layer.kv_cache = torch.zeros(draft_backend.kv_cache_shape(), dtype=self.dtype, device=self.device)
        self.drafter = DraftModelProposer(
            self.draft_model, draft_backend,
            lambda request, kv: self.block_table.sync(request.request_id, kv.get_block_ids(request)),
            self._prepare_inputs, self.sampler.generator, self.device,
        )

    @property
    def model(self) -> LlamaForCausalLM:
        """The driver's part of the model (all of it on one rank)."""
        return self.executor.driver_worker.model

    def _draft_checkpoint(self, model: str) -> tuple[Path, ModelConfig, QuantizationConfig | None]:
        """The draft model's folder, config and quantization, checked against the target's."""
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
        return path, cfg, resolve_quant_config(None, cfg.quantization_config)

    def _draft_bytes_per_block(self, c: ModelConfig) -> int:
        return 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * self.block_size * self.dtype.itemsize

    def execute(self, so: SchedulerOutput, kv: KVCacheManager) -> ModelRunnerOutput:
        plan = self.prepare(so, kv)
        return self.finish(plan, self.executor.execute_model(plan.inp))

    @torch.inference_mode()
    def prepare(self, so: SchedulerOutput, kv: KVCacheManager) -> StepPlan:
        """Draft tokens (speculative decoding), then the step's ModelInput and what to sample from it."""
        self.release(so.released_request_ids)
        draft_probs = self._propose(so, kv) if self.ngram is not None or self.drafter is not None else {}
        # Decodes first: backends batch the leading single-token sequences together. Then by LoRA slot, so
        # that each adapter's tokens form few runs (engine/lora/layers.py); without LoRA every slot is -1.
        order = sorted(range(len(so.requests)), key=lambda j: (so.num_scheduled_tokens[j] != 1, so.requests[j].lora_slot))
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

        lora_slots = [so.requests[j].lora_slot for j in order] if self.config.enable_lora else None
        inp = ModelInput.build(input_ids, starts, q_lens, self.block_table.table[rows, : max(widths)], self.block_size,
                               logit_rows, lora_slots)
        if self.kv_connector is not None:
            meta = self.kv_connector.build_connector_meta(so.requests, so.num_scheduled_tokens,
                                                          [kv.get_block_ids(r) for r in so.requests])
            inp.kv_meta = meta or None
        return StepPlan(so, inp, samplers, num_sampled, prompt_rows, draft_probs)

    @torch.inference_mode()
    def finish(self, plan: StepPlan, logits: torch.Tensor | None) -> ModelRunnerOutput:
        """Sample (and verify drafts, and gather logprobs) from the step's logits."""
        so, samplers, num_sampled, draft_probs = plan.so, plan.samplers, plan.num_sampled, plan.draft_probs
        if plan.inp.kv_meta is not None:
            self.kv_connector.loads_done(plan.inp.kv_meta)
        out = ModelRunnerOutput([None] * len(so.requests), [None] * len(so.requests), {})
        if logits is None:
            return out
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
        for j, first, count, _ in plan.prompt_rows:
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
        """Attention metadata and token positions of a batch the driver runs itself (the draft model's)."""
        inp = ModelInput.build([], starts, q_lens, self.block_table.table[rows, :width], self.block_size)
        return inp.attention_metadata(self.device), torch.from_numpy(inp.positions).to(self.device)


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
