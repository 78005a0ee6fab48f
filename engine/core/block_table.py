"""A persistent block table: one row per running request, mirrored from the KV cache manager's block
lists. Each step writes only the blocks a request gained since the last one (usually none), instead of
rebuilding every request's row (vLLM's persistent-batch idea)."""

from __future__ import annotations

import numpy as np


class BlockTable:
    def __init__(self, max_rows: int, max_blocks_per_row: int) -> None:
        self.table = np.zeros((max_rows, max_blocks_per_row), dtype=np.int64)
        self._rows: dict[str, tuple[int, list[int], int]] = {}  # request id -> (row, mirrored list, written)
        self._free_rows = list(range(max_rows - 1, -1, -1))

    def sync(self, request_id: str, block_ids: list[int]) -> tuple[int, int]:
        """The request's row, brought up to date with `block_ids`; returns (row, number of blocks)."""
        entry = self._rows.get(request_id)
        if entry is not None and entry[1] is block_ids:
            row, _, written = entry
        else:  # new, or its blocks were freed and reallocated since (a new list)
            row = entry[0] if entry is not None else self._free_rows.pop()
            written = 0
        n = len(block_ids)
        if n > written:
            self.table[row, written:n] = block_ids[written:]
            self._rows[request_id] = (row, block_ids, n)
        return row, n

    def release(self, request_id: str) -> None:
        entry = self._rows.pop(request_id, None)
        if entry is not None:
            self._free_rows.append(entry[0])
