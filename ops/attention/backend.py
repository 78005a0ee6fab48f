"""The attention backend interface.

A step's tokens arrive as one flattened varlen batch: sequence i owns query rows
`query_start_loc[i]:query_start_loc[i+1]` and, after this step, has `seq_lens[i]` tokens of context
whose KV lives in the blocks `block_tables[i]`. Sequences with a single query token (decodes) come
first, so backends can treat `[:num_decodes]` as a uniform decode batch. Each backend owns its KV-cache
layout; `slot_mapping[t]` is the flat slot (block_id * block_size + offset) where token t's K and V go."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import torch


@dataclass
class AttentionMetadata:
    num_tokens: int
    num_decodes: int
    query_start_loc_cpu: list[int]  # [num_seqs + 1]
    seq_lens_cpu: list[int]  # [num_seqs]
    query_start_loc: torch.Tensor  # int32, on device
    seq_lens: torch.Tensor  # int32, on device
    # int32 [num_seqs, max_blocks]; entries past a sequence's blocks hold some valid block id (the null
    # block or a stale one): backends may read them only under a mask.
    block_tables: torch.Tensor
    slot_mapping: torch.Tensor  # int64 [num_tokens]
    # window -> (block_tables, slot_mapping) of the layers of that window where they keep KV blocks of their own
    # (a KV cache group, engine/core/kv_cache_groups.py): blocks out of the window are the null block there.
    # A window not listed uses the fields above.
    window_groups: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    def tables_for(self, window: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(block_tables, slot_mapping) of the layers with this window (None: full attention)."""
        return self.window_groups.get(window, (self.block_tables, self.slot_mapping))

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)


def kv_rows(slot_mapping: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of K and of V for each slot, in the NHD paged layout [num_blocks, 2, block_size, kv_heads,
    head_dim] viewed as [num_blocks * 2 * block_size, kv_heads, head_dim]. Both backends use this layout
    (it is FlashInfer's), so both store KV the same way."""
    block, offset = slot_mapping // block_size, slot_mapping % block_size
    k_rows = block * (2 * block_size) + offset
    return k_rows, k_rows + block_size


def store_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_rows: torch.Tensor,
             v_rows: torch.Tensor) -> None:
    rows = kv_cache.view(-1, kv_cache.shape[-2], kv_cache.shape[-1])
    rows.index_copy_(0, k_rows, k)
    rows.index_copy_(0, v_rows, v)


class AttentionBackend(ABC):
    name: str

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        block_size: int,
        num_blocks: int,
        dtype: torch.dtype,
        device: torch.device,
        scale: float | None = None,
        sliding_windows: tuple[int, ...] = (),
    ) -> None:
        """`scale`: of the attention scores (default head_dim ** -0.5); `sliding_windows`: the windows some
        layers attend over (each `forward` names its layer's), so that a plan can prepare for each."""
        if num_heads % num_kv_heads:
            raise ValueError(f"num_attention_heads {num_heads} is not a multiple of num_key_value_heads {num_kv_heads}")
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.dtype = dtype
        self.device = device
        self.scale = head_dim**-0.5 if scale is None else scale
        self.sliding_windows = tuple(sorted(set(sliding_windows)))
        # The step's metadata, kept by plan(): layers that attend on their own read it (DeepSeek's latent
        # attention, engine/models/deepseek.py).
        self.metadata: AttentionMetadata | None = None

    @abstractmethod
    def kv_cache_shape(self) -> tuple[int, ...]:
        """Shape of one layer's KV cache tensor."""

    @abstractmethod
    def plan(self, metadata: AttentionMetadata) -> None:
        """Prepare for one step's forward; called once per step, before any layer. Keeps `metadata`."""

    @abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                sliding_window: int | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
        """Store k, v [num_tokens, num_kv_heads, head_dim] in kv_cache, then attend q
        [num_tokens, num_heads, head_dim] causally over each sequence's context (with `sliding_window`, one of
        the backend's: over the last this-many positions, the query's own included; with `sinks` [num_heads],
        each head's learned logit joins its softmax's denominator). Returns q's shape."""

    def cpu_decode_plan(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """(block_tables int32, seq_lens int32, k_rows int64) of a planned step whose every token decodes, for
        ops/cpu/decode_stack.py's one-call layers, where this backend runs the CPU kernels; else None."""
        return None

    @property
    def decodes_on_cpu_kernels(self) -> bool:
        """Whether this backend attends decode tokens with the CPU kernels, which decode_stack.cpp calls itself:
        a step whose every token decodes may then skip `plan` and run there (engine/models/llama.py's
        decode_logits)."""
        return False
