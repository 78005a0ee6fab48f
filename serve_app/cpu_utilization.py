"""Is the CPU saturated? The busy share of the CPUs this process may use: an engine replica reads it to
decide whether its streams should coalesce tokens (serve_app/llm_server.py). Every streamed message costs
CPU in three processes, which a saturated machine takes from the engine itself.

Busy time comes from the cgroup first (a container sees its own use, and its CPU limit), v2 then v1, else
from the whole machine's /proc/stat. Not from the CPU pressure (PSI), which this used before: on 2 cores
under the same 64-requests-at-once load PSI's `some` share read 0.5-0.9 in one run and 0.37-0.47 in the
next (and ~0.1 on an idle VM), so streams coalesced in one run and not the other, while the busy share read
0.97-1.0 in both, against 0.7-0.9 at 4 requests/s."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

Reading = tuple[float, float]  # (busy CPU-seconds so far, the CPUs they are a share of)


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None


def cgroup_v2(root: Path, cpus: int) -> Reading | None:
    stat = _read(root / "sys/fs/cgroup/cpu.stat")
    usage = next((line.split()[1] for line in (stat or "").splitlines() if line.startswith("usage_usec ")), None)
    if usage is None:
        return None
    quota, period = ((_read(root / "sys/fs/cgroup/cpu.max") or "max").split() + ["100000"])[:2]
    return int(usage) / 1e6, cpus if quota == "max" else min(cpus, int(quota) / int(period))


def cgroup_v1(root: Path, cpus: int) -> Reading | None:
    usage = _read(root / "sys/fs/cgroup/cpuacct/cpuacct.usage")
    if usage is None or not usage.strip().isdigit():
        return None
    quota, period = (_read(root / "sys/fs/cgroup/cpu/cpu.cfs_quota_us"),
                     _read(root / "sys/fs/cgroup/cpu/cpu.cfs_period_us"))
    limited = quota is not None and period is not None and int(quota) > 0
    return int(usage) / 1e9, min(cpus, int(quota) / int(period)) if limited else cpus


def proc_stat(root: Path, cpus: int) -> Reading | None:
    """The whole machine's busy time, a share of all its CPUs (whatever this process's affinity)."""
    lines = (_read(root / "proc/stat") or "").splitlines()
    if not lines or not lines[0].startswith("cpu "):
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in lines[0].split()[1:9])
    machine = sum(1 for line in lines if line.startswith("cpu") and line[3:4].isdigit())
    # Stolen time counts as busy: the hypervisor ran someone else while this machine wanted its CPU.
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK"), float(machine)


_SOURCES: tuple[Callable[[Path, int], Reading | None], ...] = (cgroup_v2, cgroup_v1, proc_stat)


class CpuUtilization:
    """`sample()` once in a while (it reads one or two small files); `share` is the busy share of the
    usable CPUs since the sample before, None until two samples or without any source."""

    def __init__(self, root: Path = Path("/"), cpus: int | None = None) -> None:
        self.root = root
        self.cpus = cpus or len(os.sched_getaffinity(0))
        self.source = next((s for s in _SOURCES if s(root, self.cpus) is not None), None)
        self.share: float | None = None
        self._last: tuple[float, float] | None = None
        self.sample()

    def sample(self) -> float | None:
        reading = self.source(self.root, self.cpus) if self.source is not None else None
        if reading is None:
            return self.share
        busy, usable = reading
        now = (time.monotonic(), busy)
        if self._last is not None and now[0] > self._last[0]:
            self.share = min(1.0, max(0.0, (now[1] - self._last[1]) / (now[0] - self._last[0]) / usable))
        self._last = now
        return self.share
