"""The FlashInfer backend's page tables, built on CPU (FlashInfer's kernels need a GPU)."""

from __future__ import annotations

import torch

from ops.attention.flashinfer_backend import paged_kv_csr


def test_csr_page_tables():
    block_size = 4
    seq_lens = [1, 4, 5, 12]
    tables = torch.tensor([[7, 99, 99], [3, 99, 99], [8, 2, 99], [5, 6, 1]], dtype=torch.int32)  # 99: padding
    indptr, indices, last = paged_kv_csr(seq_lens, tables, block_size)
    assert indptr.tolist() == [0, 1, 2, 4, 7]
    assert indices.tolist() == [7, 3, 8, 2, 5, 6, 1]
    assert last.tolist() == [1, 4, 1, 4]
    assert indptr.dtype == indices.dtype == last.dtype == torch.int32
