"""Runs one scheduled step: flattens the scheduled tokens into a varlen batch, runs the model through
the attention backend, computes logits only at positions that sample, and samples."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from engine.block_table import BlockTable
from engine.config import EngineConfig
from engine.kv_cache_manager import KVCacheManager
from engine.models.config import ModelConfig
from engine.models.loader import build_model
from engine.sampler import Sampler, build_sampling_metadata, gather_logprobs
from engine.scheduler import SchedulerOutput
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
        self.block_table = BlockTable(config.max_num_seqs, -(-max_model_len // self.block_size))

    def _bytes_per_block(self) -> int:
        cfg = self.model_config
        elem = torch.empty(0, dtype=self.dtype).element_size()
        return 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * self.block_size * elem

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
            if n == 1:
                input_ids.append(request.all_token_ids[start])
            else:
                input_ids.extend(request.all_token_ids[start : start + n])
            starts.append(start)
            q_lens.append(n)
            row, width = self.block_table.sync(request.request_id, kv.get_block_ids(request))
            rows.append(row)
            widths.append(width)
            if start + n == request.num_tokens:
                samplers.append(j)
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
            sampled = self.sampler(logits[:num_sampled], build_sampling_metadata(requests, self.model_config.vocab_size, self.device))
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
