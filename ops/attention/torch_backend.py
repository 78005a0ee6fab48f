"""Paged attention in torch: the reference backend and the CPU path.

KV layout per layer: [num_blocks, 2, block_size, num_kv_heads, head_dim] (FlashInfer's NHD paged
layout): a block's K and V for every head form one contiguous run of memory. Prefill chunks run one SDPA
call each, causal with their cached context in front. Decodes run, on CPU, through a compiled kernel
that reads the blocks in place (ops/cpu); elsewhere, or without a compiler, as one batched SDPA call
over gathered, padded K/V in which the g query heads sharing a KV head act as g query positions.
A sliding-window layer's prefill gathers only the blocks its window reaches, under a banded mask; its
decodes read only the window's blocks. Attention sinks (gpt-oss's learned per-head logit in the softmax's
denominator) are, for SDPA, one more key whose value is zero and whose score the mask sets to the sink."""

from __future__ import annotations

import ctypes
import sys
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ops.attention.backend import AttentionBackend, AttentionMetadata, kv_rows, store_kv
from ops.cpu import load_cpu_kernels


def _keep_freed_memory_in_heap() -> None:
    # glibc hands large freed buffers back to the OS and page-faults them in again on the next step,
    # which made gathers ~10x slower than memcpy. Keep them in the heap instead.
    if sys.platform != "linux":
        return
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    m_trim_threshold, m_mmap_threshold = -1, -3
    libc.mallopt(m_mmap_threshold, 1 << 30)
    libc.mallopt(m_trim_threshold, (1 << 31) - 1)


@dataclass
class _PrefillPlan:
    q_start: int
    q_end: int
    context_len: int
    mask: torch.Tensor | None  # None: plain causal (no cached context in front)
    # window -> (index of the first block the window reaches, banded mask over the keys from there), for each
    # window the context outgrows; a window it does not outgrow sees what a full layer sees.
    windowed: dict[int, tuple[int, torch.Tensor]]


@dataclass
class _TablePlan:
    """What a step reads from one set of block tables (a KV cache group's)."""

    k_rows: torch.Tensor  # where each new token's K goes (its V: v_rows)
    v_rows: torch.Tensor
    decode_tables: torch.Tensor  # int32 [num_decodes, max_blocks]
    decode_block_ids: torch.Tensor | None  # the decodes' blocks, flattened, for the gather path
    prefill_block_ids: list[torch.Tensor]  # int64, each prefill's blocks


def _heads_contiguous(x: torch.Tensor) -> bool:
    """Whether each token's heads of x [tokens, heads, head_dim] lie in one run (a view of the QKV output does)."""
    return x.stride(-1) == 1 and x.stride(-2) == x.shape[-1]


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def __init__(self, *args, use_cpu_kernel: bool = True, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.group = self.num_heads // self.num_kv_heads
        self._cpu_kernels = None
        if self.device.type == "cpu":
            _keep_freed_memory_in_heap()
            if use_cpu_kernel:
                self._cpu_kernels = load_cpu_kernels()
        self._num_decodes = 0
        self._decode_lens = torch.empty(0, dtype=torch.int32, device=self.device)
        self._no_sinks = torch.empty(0, dtype=torch.float32, device=self.device)  # the CPU kernel's "no sinks"
        self._decode_masks: dict[int | None, torch.Tensor] = {}  # the gather path's, per window
        self._decode_num_blocks = 0
        self._prefills: list[_PrefillPlan] = []
        self._tables: dict[int | None, _TablePlan] = {}  # per window (None: full attention)

    def kv_cache_shape(self) -> tuple[int, ...]:
        return (self.num_blocks, 2, self.block_size, self.num_kv_heads, self.head_dim)

    def plan(self, md: AttentionMetadata) -> None:
        self.metadata = md
        bs, nd = self.block_size, md.num_decodes
        self._num_decodes = nd
        self._decode_lens = md.seq_lens[:nd]
        self._decode_masks = {}
        gather = nd and self._cpu_kernels is None
        if gather:
            self._decode_num_blocks = -(-max(md.seq_lens_cpu[:nd]) // bs)
            positions = torch.arange(self._decode_num_blocks * bs, device=self.device)[None, :]
            lens = md.seq_lens[:nd, None]
            self._decode_masks[None] = (positions < lens)[:, None, None, :]
            for w in self.sliding_windows:
                self._decode_masks[w] = ((positions < lens) & (positions >= lens - w))[:, None, None, :]
        self._prefills = []
        for i in range(nd, md.num_seqs):
            q_start, q_end = md.query_start_loc_cpu[i], md.query_start_loc_cpu[i + 1]
            ctx = md.seq_lens_cpu[i]
            q_len = q_end - q_start
            rows = torch.arange(q_len, device=self.device)[:, None] + (ctx - q_len)  # each query's position
            mask = None
            if ctx != q_len:  # cached context in front: query i sees keys up to ctx - q_len + i
                mask = torch.arange(ctx, device=self.device)[None, :] <= rows
            windowed = {}
            for w in self.sliding_windows:
                if ctx > w:  # the first query sees keys from ctx - q_len - w + 1 on
                    first_block = max(0, ctx - q_len - w + 1) // bs
                    keys = torch.arange(first_block * bs, ctx, device=self.device)[None, :]
                    windowed[w] = (first_block, (keys <= rows) & (keys > rows - w))
            self._prefills.append(_PrefillPlan(q_start, q_end, ctx, mask, windowed))
        self._tables = {}
        for window in (None, *self.sliding_windows):
            if window is not None and window not in md.window_groups:
                self._tables[window] = self._tables[None]  # its layers keep their KV in the primary group
                continue
            block_tables, slot_mapping = md.tables_for(window)
            k_rows, v_rows = kv_rows(slot_mapping, bs)
            prefill_ids = [block_tables[i, : -(-md.seq_lens_cpu[i] // bs)].long() for i in range(nd, md.num_seqs)]
            decode_ids = block_tables[:nd, : self._decode_num_blocks].reshape(-1).long() if gather else None
            self._tables[window] = _TablePlan(k_rows, v_rows, block_tables[:nd], decode_ids, prefill_ids)

    @property
    def decodes_on_cpu_kernels(self) -> bool:
        return self._cpu_kernels is not None

    def cpu_decode_plan(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        md = self.metadata
        if self._cpu_kernels is None or not self._num_decodes == md.num_tokens == md.num_seqs or md.window_groups:
            return None
        tables = self._tables[None]
        return tables.decode_tables, self._decode_lens, tables.k_rows

    def _gather(self, kv_cache: torch.Tensor, block_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of the given blocks, each [num_blocks * block_size, kv_heads, head_dim]."""
        blocks = kv_cache.view(kv_cache.shape[0], -1).index_select(0, block_ids).view(-1, *kv_cache.shape[1:])
        shape = (-1, self.num_kv_heads, self.head_dim)
        return blocks[:, 0].reshape(shape), blocks[:, 1].reshape(shape)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                sliding_window: int | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
        tables = self._tables[sliding_window]
        if self._cpu_kernels is not None and _heads_contiguous(k) and _heads_contiguous(v):
            self._cpu_kernels.store_kv(kv_cache, k, v, tables.k_rows)
        else:
            store_kv(kv_cache, k, v, tables.k_rows, tables.v_rows)
        out = torch.empty_like(q)
        nd = self._num_decodes
        if nd and self._cpu_kernels is not None:  # q may be a view of the QKV output: the kernel takes its stride
            whole = nd == q.shape[0]  # a decode-only step: no slices to dispatch
            if not _heads_contiguous(q):
                q = q.contiguous()
            self._cpu_kernels.paged_decode_attention(out if whole else out[:nd], q if whole else q[:nd], kv_cache,
                                                     tables.decode_tables, self._decode_lens, self.scale,
                                                     sliding_window or 0,
                                                     self._no_sinks if sinks is None else sinks.float().contiguous())
        elif nd:
            keys, values = self._gather(kv_cache, tables.decode_block_ids)
            shape = (nd, self._decode_num_blocks * self.block_size, self.num_kv_heads, self.head_dim)
            keys, values = keys.view(shape).transpose(1, 2), values.view(shape).transpose(1, 2)
            queries = q[:nd].view(nd, self.num_kv_heads, self.group, self.head_dim)
            mask = self._decode_masks[sliding_window]
            if sinks is not None:  # the heads are (KV head, group) here
                keys, values, mask = _with_sinks(keys, values, mask, sinks.view(1, self.num_kv_heads, self.group, 1))
            # reshape, not view: CUDA's kernels may return the heads strided (the GPU check caught a view failing)
            out[:nd] = F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask,
                                                      scale=self.scale).reshape(nd, -1, self.head_dim)
        for p, block_ids in zip(self._prefills, tables.prefill_block_ids):
            first_block, mask = p.windowed.get(sliding_window, (0, p.mask))
            keys, values = self._gather(kv_cache, block_ids[first_block:])
            # [1, heads, tokens, head_dim]: with 3-D inputs torch 2.13 takes its math path on CPU (a full score
            # matrix, 3.3x slower on 256-token prompts); 4-D ones reach its flash kernel, GQA and masks included.
            num_keys = p.context_len - first_block * self.block_size
            keys, values = keys[:num_keys].transpose(0, 1)[None], values[:num_keys].transpose(0, 1)[None]
            queries = q[p.q_start : p.q_end].transpose(0, 1)[None]
            if sinks is not None:
                if mask is None:
                    q_len = p.q_end - p.q_start
                    mask = torch.ones(q_len, num_keys, dtype=torch.bool, device=q.device).tril(num_keys - q_len)
                keys = keys.repeat_interleave(self.group, 1)  # the sink's column is per head: no GQA broadcast
                values = values.repeat_interleave(self.group, 1)
                keys, values, mask = _with_sinks(keys, values, mask, sinks.view(1, -1, 1, 1))
            o = F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask, is_causal=mask is None,
                                               scale=self.scale, enable_gqa=self.group > 1 and sinks is None)
            out[p.q_start : p.q_end] = o[0].transpose(0, 1)
        return out


def _with_sinks(keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
                sinks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Keys and values with one more position (zeros) and an additive float mask that gives it each head's
    sink logit (`sinks` broadcast over the mask's leading dims): softmax then sums exp(sink) into its
    denominator and nothing into the output."""
    zeros = keys.new_zeros(*keys.shape[:-2], 1, keys.shape[-1])
    keys, values = torch.cat([keys, zeros], -2), torch.cat([values, zeros[..., : values.shape[-1]]], -2)
    bias = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device).masked_fill_(~mask, float("-inf"))
    bias = bias.expand(*torch.broadcast_shapes(bias.shape[:-1], sinks.shape[:-1]), bias.shape[-1])
    sink = sinks.float().expand(*bias.shape[:-1], 1)
    return keys, values, torch.cat([bias, sink], -1).to(keys.dtype)
