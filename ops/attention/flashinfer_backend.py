"""FlashInfer paged attention, for CUDA: decodes through BatchDecodeWithPagedKVCacheWrapper, prefill
chunks (with cached context in front) through BatchPrefillWithPagedKVCacheWrapper, both over the NHD
layout the torch backend uses too. FlashInfer wants each sequence's pages as CSR (indptr, indices,
last page length); `paged_kv_csr` builds them from the block tables once per step, and `plan` hands
them to both wrappers, which then serve every layer of the step. Sliding-window layers get a pair of
wrappers of their own per window, planned with FlashInfer's `window_left` (window - 1: the query's own
position plus that many before it).

Unverified here: our CPU-only machines cannot run FlashInfer's kernels. benchmarks/gpu_check.sh compares
them with the torch backend on a GPU where flashinfer can be installed (its wheel is larger than what a run
on our lent GPUs may carry, so there it has not run either). The CSR construction is tested on CPU
(tests/ops/test_flashinfer_plan.py)."""

from __future__ import annotations

import torch

from ops.attention.backend import AttentionBackend, AttentionMetadata, kv_rows, store_kv

_WORKSPACE_BYTES = 256 * 2**20


def paged_kv_csr(seq_lens: list[int], block_tables: torch.Tensor, block_size: int):
    """(indptr [n+1] int32, indices int32, last_page_len [n] int32) of n sequences whose KV is
    `seq_lens[i]` tokens in the blocks `block_tables[i]`. indptr and last_page_len stay on the CPU (the
    wrappers' plan reads them on the host); indices live with the block tables."""
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    num_pages = (lens + block_size - 1) // block_size
    indptr = torch.zeros(len(seq_lens) + 1, dtype=torch.int32)
    torch.cumsum(num_pages, 0, out=indptr[1:])
    width = block_tables.shape[1]
    mask = torch.arange(width)[None, :] < num_pages[:, None]
    indices = block_tables[mask.to(block_tables.device)].to(torch.int32)  # row-major: each sequence's pages in order
    last_page_len = lens - (num_pages - 1) * block_size
    return indptr, indices, last_page_len


class FlashInferAttentionBackend(AttentionBackend):
    name = "flashinfer"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        import flashinfer

        group = self.num_heads // self.num_kv_heads
        # window (None: full attention) -> (decode wrapper, prefill wrapper); each pair plans into its own workspace
        self._wrappers = {}
        for window in (None, *self.sliding_windows):
            workspace = torch.empty(_WORKSPACE_BYTES, dtype=torch.uint8, device=self.device)
            self._wrappers[window] = (
                flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD", use_tensor_cores=group >= 4),
                flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD"))
        self._num_decodes = 0
        self._num_decode_tokens = 0
        self._has_prefill = False
        self._rows: dict[int | None, tuple[torch.Tensor, torch.Tensor]] = {}  # per window: where new K and V go

    def kv_cache_shape(self) -> tuple[int, ...]:
        return (self.num_blocks, 2, self.block_size, self.num_kv_heads, self.head_dim)

    def plan(self, md: AttentionMetadata) -> None:
        self.metadata = md
        nd = md.num_decodes
        self._num_decodes, self._num_decode_tokens = nd, md.query_start_loc_cpu[nd]
        self._has_prefill = md.num_seqs > nd
        for window, (decode, prefill) in self._wrappers.items():
            block_tables, slot_mapping = md.tables_for(window)  # the window's KV cache group, if it has one
            self._rows[window] = kv_rows(slot_mapping, self.block_size)
            indptr, indices, last_page_len = paged_kv_csr(md.seq_lens_cpu, block_tables, self.block_size)
            common = dict(q_data_type=self.dtype, kv_data_type=self.dtype, sm_scale=self.scale,
                          window_left=-1 if window is None else window - 1)
            if nd:
                decode.plan(indptr[: nd + 1], indices[: int(indptr[nd])], last_page_len[:nd], self.num_heads,
                            self.num_kv_heads, self.head_dim, self.block_size, **common)
            if self._has_prefill:
                qo_indptr = torch.tensor(md.query_start_loc_cpu[nd:], dtype=torch.int32) - md.query_start_loc_cpu[nd]
                start = int(indptr[nd])
                prefill.plan(qo_indptr, indptr[nd:] - start, indices[start:], last_page_len[nd:], self.num_heads,
                             self.num_kv_heads, self.head_dim, self.block_size, causal=True, **common)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                sliding_window: int | None = None) -> torch.Tensor:
        store_kv(kv_cache, k, v, *self._rows[sliding_window])
        out = torch.empty_like(q)
        t = self._num_decode_tokens
        decode, prefill = self._wrappers[sliding_window]
        if self._num_decodes:
            out[:t] = decode.run(q[:t].contiguous(), kv_cache)
        if self._has_prefill:
            out[t:] = prefill.run(q[t:].contiguous(), kv_cache)
        return out
