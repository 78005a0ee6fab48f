"""CPU kernels compiled on first use (torch.utils.cpp_extension, into torch's extension cache), one
build per CPU type.

`load_cpu_kernels()` returns the compiled module, or None when no compiler is available; callers then
fall back to the pure-torch path."""

from __future__ import annotations

import functools
import hashlib
import logging
import platform
from pathlib import Path

logger = logging.getLogger(__name__)

_SOURCES = [Path(__file__).parent / "paged_attention.cpp"]


def _cpu_signature() -> str:
    # -march=native code must not run on another CPU: key the build folder by the CPU's flags.
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        flags = platform.processor()
    return hashlib.sha256(f"{platform.machine()} {flags}".encode()).hexdigest()[:10]


@functools.cache
def load_cpu_kernels():
    try:
        from torch.utils.cpp_extension import load

        return load(
            name=f"pagedserve_cpu_kernels_{_cpu_signature()}",
            sources=[str(s) for s in _SOURCES],
            extra_cflags=["-O3", "-march=native", "-fopenmp"],
            extra_ldflags=["-fopenmp"],
        )
    except Exception as e:  # no compiler, no ninja, no headers: slower but correct
        logger.warning("CPU attention kernel unavailable (%s); using the pure-torch path", e)
        return None
