"""The engine process hands memory it freed back to the OS (engine/core/engine_loop.py heap_trimmer): found by
benchmarks/soak.py, where its resident memory kept growing while its live memory stayed flat."""

from __future__ import annotations

import os
import sys

import pytest

from engine.core.engine_loop import heap_trimmer

MiB = 2**20


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc_trim")
def test_freed_heap_memory_goes_back_when_the_loop_goes_idle():
    maybe_trim = heap_trimmer(period_s=3600, idle_gap_s=0)
    maybe_trim(idle=False)  # the first call trims; busy from now on, the next periodic trim is an hour away
    blocks = [bytearray(64 * 1024) for _ in range(3000)]  # ~190 MiB of the main heap (below the mmap threshold)
    pin = bytearray(64 * 1024)  # the heap's top stays in use: free() alone cannot give the space below back
    del blocks
    before = _rss()
    maybe_trim(idle=False)
    assert before - _rss() < 50 * MiB  # still busy: nothing was trimmed
    maybe_trim(idle=True)
    assert before - _rss() > 100 * MiB
    del pin
