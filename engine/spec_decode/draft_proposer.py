"""Drafting with a small model that shares the target's vocabulary.

The draft keeps its own KV tensors, indexed by the target's block ids and block tables: allocation,
prefix caching, preemption and freeing stay the target's one mechanism, and a block's draft KV is valid
wherever its target KV is. To keep it so, every step the draft first runs over what the target computes
(prompt chunks, plain decodes) and catches up on tokens it has not seen (a request's last token, an
accepted draft it never fed); that forward also yields the first draft of each drafting request. Then
k - 1 single-token forwards extend the drafts. Their KV lands in slots the scheduler reserved for the
drafts, so rejected drafts need no cleanup: their slots are rewritten before anything reads them."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.config import EngineConfig
from engine.core.block_table import BlockTable
from engine.core.kv_cache_manager import KVCacheManager
from engine.core.request import Request
from engine.executor.model_input import ModelInput
from engine.executor.worker import Worker
from engine.model_spec import ModelSpec
from engine.models.config import ModelConfig
from engine.models.layers.quantization import QuantizationConfig, resolve_quant_config
from engine.models.model_path import resolve_model_path
from engine.models.registry import MTP_ARCHITECTURE
from engine.sample.sampler import argmax_rows, build_sampling_metadata, processed_probs
from engine.spec_decode.rejection_sampler import draw_from


@dataclass(frozen=True)
class DraftCheckpoint:
    """The draft model of `speculative_config.model`, checked against the target before any worker starts."""

    path: Path
    model_config: ModelConfig
    quant_config: QuantizationConfig | None

    @classmethod
    def resolve(cls, model: str, target: ModelSpec) -> DraftCheckpoint:
        path = resolve_model_path(model)
        cfg = ModelConfig.from_pretrained(path)
        if cfg.vocab_size != target.model_config.vocab_size:
            raise ValueError(
                f"speculative_config.model: the draft's vocabulary has {cfg.vocab_size} tokens, the target's "
                f"{target.model_config.vocab_size}; pick a draft that shares the target's tokenizer"
            )
        if cfg.max_position_embeddings < target.max_model_len:
            raise ValueError(
                f"speculative_config.model: the draft handles {cfg.max_position_embeddings} positions, fewer than "
                f"max_model_len={target.max_model_len}; lower max_model_len or pick another draft"
            )
        return cls(path, cfg, resolve_quant_config(None, cfg.quantization_config))

    @classmethod
    def mtp(cls, target: ModelSpec) -> DraftCheckpoint:
        """The target checkpoint's multi-token prediction layer (engine/models/deepseek_mtp.py)."""
        cfg = dataclasses.replace(target.model_config, architecture=MTP_ARCHITECTURE)
        return cls(target.path, cfg, target.quant_config)

    def kv_bytes_per_block(self, block_size: int, dtype: torch.dtype) -> int:
        """What the draft's KV adds to each of the target's blocks (the target's KV budget holds both)."""
        c = self.model_config
        if c.architecture == MTP_ARCHITECTURE:  # one latent-attention layer: a latent per token, no K and V
            return c.mla.latent_dim * block_size * dtype.itemsize
        return 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * block_size * dtype.itemsize

    def build_worker(self, config: EngineConfig, target: ModelSpec, device: torch.device, num_blocks: int) -> Worker:
        """The draft as one whole rank on the driver's device (a Worker, as any rank of the target), its KV
        cache sized in the target's blocks."""
        spec = ModelSpec(self.model_config, self.path, target.dtype, target.device_type, target.max_model_len,
                         self.quant_config)
        worker = Worker(config.model_copy(update={"enable_lora": False, "kv_transfer_config": None}), spec, device)
        worker.init_kv_cache(num_blocks)
        return worker


class DraftModelProposer:
    def __init__(self, worker: Worker, block_table: BlockTable, block_size: int, generator: torch.Generator) -> None:
        self.worker = worker
        self.block_table = block_table
        self.block_size = block_size
        self.generator = generator
        self.device = worker.device
        self.vocab_size = worker.spec.model_config.vocab_size
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
        sampler = DraftSampler(requests, drafting, self.vocab_size, self.device, self.generator)
        tokens = sampler.pick(logits, drafting)
        for j, token in zip(drafting, tokens):
            requests[j].spec_token_ids = [token]
        # Forwards 2..k: each drafting request feeds its latest draft, one token at a time.
        for step in range(1, max(slots[j] for j in drafting)):
            active = [j for j in drafting if slots[j] > step]
            seqs = [(j, requests[j].num_tokens + step - 1, requests[j].spec_token_ids[-1:]) for j in active]
            tokens = sampler.pick(self._forward(requests, seqs, kv, active), active)
            for j, token in zip(active, tokens):
                requests[j].spec_token_ids.append(token)
                self._num_computed[requests[j].request_id] = requests[j].num_tokens + step
        return sampler.distributions()

    def _forward(
        self, requests: list[Request], seqs: list[tuple[int, int, list[int]]], kv: KVCacheManager, wanted: list[int],
        previous_hidden: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Run the draft over `seqs` (index, first position, tokens); logits at the last token of each
        sequence in `wanted`, in that order. `previous_hidden`: an MTP layer's other input, a row per token."""
        starts, q_lens, rows, widths, input_ids = [], [], [], [], []
        last_row: dict[int, int] = {}
        for j, begin, tokens in seqs:
            row, width = self.block_table.sync(requests[j].request_id, kv.get_block_ids(requests[j]))
            starts.append(begin)
            q_lens.append(len(tokens))
            rows.append(row)
            widths.append(width)
            input_ids.extend(tokens)
            last_row[j] = len(input_ids) - 1
        inp = ModelInput.build(input_ids, starts, q_lens, self.block_table.table[rows, : max(widths)], self.block_size,
                               [last_row[j] for j in wanted])
        inp.previous_hidden = previous_hidden
        logits = self.worker.execute_model(inp)
        return logits if logits is not None else torch.empty(0, self.vocab_size, device=self.device)


class DraftSampler:
    """Picks the drafts of a step's forwards: the argmax for greedy requests; for the others a draw from the
    request's own processed distribution (temperature, top-k/top-p/min-p), so that drafts stay close to the
    target's, whose verification needs the distributions q they came from."""

    def __init__(self, requests: list[Request], drafting: list[int], vocab_size: int, device: torch.device,
                 generator: torch.Generator) -> None:
        self.md = build_sampling_metadata([requests[j] for j in drafting], vocab_size, device)
        self.md_row = {j: i for i, j in enumerate(drafting)}
        self.probs: dict[int, list[torch.Tensor]] = {j: [] for j in drafting if not requests[j].sampling_params.greedy}
        self.device, self.generator = device, generator

    def pick(self, logits: torch.Tensor, active: list[int]) -> list[int]:
        tokens = argmax_rows(logits)
        rows = [i for i, j in enumerate(active) if j in self.probs]
        if rows:
            md_rows = torch.tensor([self.md_row[active[i]] for i in rows], device=self.device)
            q = processed_probs(logits[rows].float(), self.md, md_rows)
            tokens[rows] = draw_from(q, self.generator).to(tokens.device)
            for i, row in zip(rows, q):
                self.probs[active[i]].append(row)
        return tokens.tolist()

    def distributions(self) -> dict[int, torch.Tensor]:
        return {j: torch.stack(rows) for j, rows in self.probs.items()}
