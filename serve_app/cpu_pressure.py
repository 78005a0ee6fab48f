"""Is the CPU saturated? Linux's pressure stall information (PSI) answers it directly: the share of time in
which some runnable task waited for a CPU. An engine replica reads it to decide whether its streams
should coalesce tokens (serve_app/llm_server.py): every streamed message costs CPU in three processes,
which a saturated machine takes from the engine itself.

The cgroup's own figure comes first (a container sees its limit), then the whole machine's. Without PSI
(another OS, an old kernel, PSI switched off) `share` stays None: streams then coalesce only when their
consumer lags."""

from __future__ import annotations

import time
from pathlib import Path

_SOURCES = (Path("/sys/fs/cgroup/cpu.pressure"), Path("/proc/pressure/cpu"))


def read_stall_us(path: Path) -> int | None:
    """The cumulative microseconds of the `some` line (`some avg10=... total=N`), or None if unreadable."""
    try:
        for line in path.read_text().splitlines():
            if line.startswith("some "):
                return int(line.rsplit("total=", 1)[1])
    except (OSError, ValueError, IndexError):
        pass
    return None


def stall_share(prev: tuple[float, int], cur: tuple[float, int]) -> float:
    """Share of the wall time between two (monotonic seconds, stall microseconds) readings spent stalled."""
    elapsed = cur[0] - prev[0]
    return 0.0 if elapsed <= 0 else min(1.0, max(0.0, (cur[1] - prev[1]) / 1e6 / elapsed))


class CpuPressure:
    """`sample()` once in a while (it reads one small file); `share` is the stall share since the last one."""

    def __init__(self, sources: tuple[Path, ...] = _SOURCES) -> None:
        self.path = next((p for p in sources if read_stall_us(p) is not None), None)
        self.share: float | None = None
        self._last: tuple[float, int] | None = None
        self.sample()

    def sample(self) -> float | None:
        if self.path is None:
            return None
        stall = read_stall_us(self.path)
        if stall is None:
            return self.share
        now = (time.monotonic(), stall)
        if self._last is not None:
            self.share = stall_share(self._last, now)
        self._last = now
        return self.share
