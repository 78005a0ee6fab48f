"""Runs one scheduled step: flattens the scheduled tokens into a varlen batch, runs the model through
the attention backend, computes logits only at positions that sample, and samples."""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain
from pathlib import Path

import numpy as np
import torch

from engine.config import EngineConfig
from engine.kv_cache_manager import KVCacheManager
from engine.models.config import ModelConfig
from engine.models.loader import build_model
from engine.sampler import Sampler, SamplingMetadata, sample_seed
from engine.scheduler import SchedulerOutput
from kernels.attention import AttentionMetadata, get_attention_backend
from kernels.cpu.linear import pack_linear_layers

_CPU_KV_CACHE_GB = 2.0


@dataclass
class ModelRunnerOutput:
    # Aligned with SchedulerOutput.requests; None where a prefill chunk does not reach the end.
    sampled_token_ids: list[int | None]
    # For requests asking for logprobs: (token ids, logprobs, rank of the sampled token); the sampled
    # token comes first, then the top ones.
    logprobs: list[tuple[list[int], list[float], int] | None]


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
        # Decodes first: backends batch the leading single-token sequences together.
        order = sorted(range(len(so.requests)), key=lambda j: so.num_scheduled_tokens[j] != 1)
        input_ids: list[int] = []
        starts, q_lens, block_rows = [], [], []
        sample_rows: list[int] = []  # batch rows that sample, in batch order
        sample_requests: list[int] = []  # their index in so.requests
        temperatures, top_ks, top_ps, seeds = [], [], [], {}
        max_logprobs = None
        vocab = self.model_config.vocab_size
        for row, j in enumerate(order):
            request, n = so.requests[j], so.num_scheduled_tokens[j]
            start = request.num_computed_tokens
            if n == 1:
                input_ids.append(request.all_token_ids[start])
            else:
                input_ids.extend(request.all_token_ids[start : start + n])
            starts.append(start)
            q_lens.append(n)
            block_rows.append(kv.get_block_ids(request))
            if start + n == request.num_tokens:
                params = request.sampling_params
                sample_rows.append(row)
                sample_requests.append(j)
                temperatures.append(0.0 if params.greedy else params.temperature)
                top_ks.append(params.top_k if params.top_k > 0 else vocab)
                top_ps.append(params.top_p)
                if params.seed is not None and not params.greedy:
                    seeds[len(sample_rows) - 1] = sample_seed(params.seed, request.num_output_tokens)
                if params.logprobs is not None:
                    max_logprobs = max(max_logprobs or 0, params.logprobs)

        md, positions = self._prepare_inputs(starts, q_lens, block_rows)
        self.attn_backend.plan(md)
        input_ids_t = torch.tensor(input_ids, dtype=torch.long, device=self.device)
        hidden = self.model(input_ids_t, positions, self.attn_backend)

        sampled: list[int | None] = [None] * len(so.requests)
        logprobs: list[tuple[list[int], list[float], int] | None] = [None] * len(so.requests)
        if not sample_rows:
            return ModelRunnerOutput(sampled, logprobs)
        logits_index = torch.tensor(md.query_start_loc_cpu, dtype=torch.long)[1:][sample_rows] - 1
        logits = self.model.compute_logits(hidden[logits_index.to(self.device)])
        sampling = SamplingMetadata(
            temperature=torch.tensor(temperatures, device=self.device),
            all_greedy=not any(temperatures),
            top_k=torch.tensor(top_ks, device=self.device) if any(k < vocab for k in top_ks) else None,
            top_p=torch.tensor(top_ps, device=self.device) if any(p < 1.0 for p in top_ps) else None,
            seeds=seeds,
            max_num_logprobs=max_logprobs,
        )
        out = self.sampler(logits, sampling)
        for j, token in zip(sample_requests, out.token_ids.tolist()):
            sampled[j] = token
        if out.logprobs is not None:
            ids, values, ranks = out.logprob_token_ids.tolist(), out.logprobs.tolist(), out.sampled_ranks.tolist()
            for k, j in enumerate(sample_requests):
                want = so.requests[j].sampling_params.logprobs
                if want is not None:
                    logprobs[j] = (ids[k][: 1 + want], values[k][: 1 + want], ranks[k])
        return ModelRunnerOutput(sampled, logprobs)

    def _prepare_inputs(
        self, starts: list[int], q_lens: list[int], block_rows: list[list[int]]
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
        row_lens = np.fromiter((len(b) for b in block_rows), dtype=np.int64, count=num_seqs)
        block_tables = np.zeros((num_seqs, int(row_lens.max())), dtype=np.int64)
        block_tables[np.arange(block_tables.shape[1])[None, :] < row_lens[:, None]] = np.fromiter(
            chain.from_iterable(block_rows), dtype=np.int64, count=int(row_lens.sum())
        )
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
