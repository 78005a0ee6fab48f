"""ModelInput: what every rank needs to run one step's forward, and nothing about requests.

The driver builds it from the scheduled requests (token ids, positions, block tables, slot mapping, the
rows whose logits the sampler needs) as flat numpy arrays, so that it pickles small and fast and the
other ranks keep no request state at all."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from engine.kv_transfer.base import KVConnectorMetadata
from engine.multimodal.inputs import MultiModalInput
from ops.attention import AttentionMetadata


@dataclass
class ModelInput:
    input_ids: np.ndarray  # int64 [num_tokens]
    positions: np.ndarray  # int64 [num_tokens]
    query_start_loc: np.ndarray  # int64 [num_seqs + 1]
    seq_lens: np.ndarray  # int64 [num_seqs]
    num_decodes: int  # the leading single-token sequences
    # int32 [num_seqs, max_blocks]; columns past a sequence's blocks may hold stale ids: attention never
    # reads past seq_lens.
    block_tables: np.ndarray
    slot_mapping: np.ndarray  # int64 [num_tokens]
    logit_rows: np.ndarray  # int64: token rows whose logits are needed, in the sampler's order
    kv_meta: KVConnectorMetadata | None = None  # KV to load before the forward and save after it
    # int32 [num_tokens]: each token's LoRA slot (-1: the base model); None when no token has an adapter.
    lora_slots: np.ndarray | None = None
    # The other KV cache groups' (sliding-window layers', engine/core/kv_cache_groups.py) block tables and
    # slot mappings, in group order; the fields above are the primary group's.
    window_block_tables: list[np.ndarray] | None = None
    window_slot_mappings: list[np.ndarray] | None = None
    # An MTP draft layer's other input: the hidden state each token's position follows from
    # (engine/spec_decode/mtp_proposer.py). Built on the driver's device; never sent to other ranks.
    previous_hidden: torch.Tensor | None = None
    # Images (engine/core/encoder_cache.py): those to encode this step, which every worker then holds in its
    # encoder cache by content hash; the hashes it drops first; and where each scheduled run of placeholder
    # tokens takes its embeddings: (hash, first embedding, count, first token row).
    mm_encode: list[MultiModalInput] | None = None
    mm_evict: list[str] | None = None
    mm_placements: list[tuple[str, int, int, int]] | None = None
    # M-RoPE models (Qwen-VL), in a step where some request has images: int64 [3, num_tokens]
    # (engine/multimodal/mrope.py); `positions` still places the KV.
    mrope_positions: np.ndarray | None = None
    # An embedder's step (engine/pooling): int64 [k, 2], the (first row, count) of each pooling request's rows
    # the driver returns summed in place of logits.
    pool_segments: np.ndarray | None = None
    # Data parallelism: every DP rank's tokens in this step, in DP rank order (the MoE layers gather them); 0 for a
    # rank that runs a one-token dummy step.
    dp_num_tokens: list[int] | None = None
    # Whether logit_rows is every token row in order (a decode-only step's usual case): the model may then give the
    # logits of its whole output without a gather (engine/models/llama.py's decode_logits).
    logits_of_every_row: bool = False

    @classmethod
    def build(cls, input_ids: list[int], starts: list[int], q_lens: list[int], block_tables: np.ndarray,
              block_size: int, logit_rows: list[int] | None = None, lora_slots: list[int] | None = None,
              window_block_tables: list[np.ndarray] = ()) -> ModelInput:
        """Positions and slots of every token, vectorised over the batch (sequence i computes q_lens[i]
        tokens from position starts[i] on, its KV in the blocks of block_tables[i]; with `lora_slots`, its
        adapter's slot, or -1; `window_block_tables`: the other KV cache groups' tables)."""
        num_seqs = len(q_lens)
        num_decodes = next((i for i, n in enumerate(q_lens) if n != 1), num_seqs)
        q_lens_np = np.asarray(q_lens, dtype=np.int64)
        starts_np = np.asarray(starts, dtype=np.int64)
        query_start_loc = np.zeros(num_seqs + 1, dtype=np.int64)
        np.cumsum(q_lens_np, out=query_start_loc[1:])
        num_tokens = int(query_start_loc[-1])
        token_seq = np.repeat(np.arange(num_seqs), q_lens_np)
        positions = np.arange(num_tokens) - query_start_loc[token_seq] + starts_np[token_seq]
        block_index, offset = positions // block_size, positions % block_size
        slot_mapping = block_tables[token_seq, block_index] * block_size + offset
        window_slots = [(t[token_seq, block_index] * block_size + offset).astype(np.int64) for t in window_block_tables]
        token_slots = None
        if lora_slots is not None and max(lora_slots, default=-1) >= 0:
            token_slots = np.repeat(np.asarray(lora_slots, dtype=np.int32), q_lens_np)
        return cls(np.asarray(input_ids, dtype=np.int64), positions, query_start_loc, starts_np + q_lens_np,
                   num_decodes, block_tables, slot_mapping.astype(np.int64),
                   np.asarray(logit_rows if logit_rows is not None else [], dtype=np.int64), lora_slots=token_slots,
                   window_block_tables=list(window_block_tables) or None, window_slot_mappings=window_slots or None,
                   logits_of_every_row=(logit_rows is not None and len(logit_rows) == num_tokens
                                        and logit_rows == list(range(num_tokens))))

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    def attention_metadata(self, device: torch.device, windows: tuple[int | None, ...] = ()) -> AttentionMetadata:
        """`windows`: each KV cache group's window (engine/core/kv_cache_groups.py), the primary's first."""
        groups = zip(windows[1:], self.window_block_tables or (), self.window_slot_mappings or ())
        return AttentionMetadata(
            num_tokens=self.num_tokens,
            num_decodes=self.num_decodes,
            query_start_loc_cpu=self.query_start_loc.tolist(),
            seq_lens_cpu=self.seq_lens.tolist(),
            query_start_loc=torch.from_numpy(self.query_start_loc).to(device, torch.int32),
            seq_lens=torch.from_numpy(self.seq_lens).to(device, torch.int32),
            block_tables=torch.from_numpy(self.block_tables).to(device, torch.int32),
            slot_mapping=torch.from_numpy(self.slot_mapping).to(device),
            window_groups={w: (torch.from_numpy(t).to(device, torch.int32), torch.from_numpy(m).to(device))
                           for w, t, m in groups},
        )
