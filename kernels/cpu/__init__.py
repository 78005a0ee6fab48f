"""CPU kernels compiled on first use (torch.utils.cpp_extension, into torch's extension cache), one
build per CPU type; `make install` compiles them all ahead, side by side (`python -m kernels.cpu`).

`load_cpu_kernels()` (paged attention), `load_linear_kernels()` (linear layers over float32, int8 and int4
weight panels), `load_moe_kernels()` (mixture-of-experts layers) and `load_elementwise_kernels()` (RMSNorm,
rotary embeddings) return a compiled module, or None when no
compiler is available; callers then fall back to a pure-torch path. One module each: each rebuilds only when
its own sources change, and a model compiles only the kernels it runs."""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
from pathlib import Path

logger = logging.getLogger(__name__)

_SOURCES = [Path(__file__).parent / "paged_attention.cpp"]
_LINEAR_SOURCES = [Path(__file__).parent / "panel_linear.cpp"]
_MOE_SOURCES = [Path(__file__).parent / "fused_moe.cpp"]
_ELEMENTWISE_SOURCES = [Path(__file__).parent / "elementwise.cpp"]
_HEADERS = [Path(__file__).parent / h for h in ("work_sharing.h", "vec16.h")]  # torch keys a build by its sources only
# Extra compiler flags, e.g. "-mno-avx512f" to build (and test) the AVX2 paths on an AVX-512 machine.
_EXTRA_CFLAGS = os.environ.get("PAGEDSERVE_CPU_CFLAGS", "").split()


def _build_signature() -> str:
    # -march=native code must not run on another CPU: key the build folder by the CPU's flags, by the extra
    # compiler flags, and by the shared headers, whose changes torch's extension versioning would not see.
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        flags = platform.processor()
    headers = b"".join(h.read_bytes() for h in _HEADERS)
    return hashlib.sha256(f"{platform.machine()} {flags} {_EXTRA_CFLAGS}".encode() + headers).hexdigest()[:10]


@functools.cache
def load_cpu_kernels():
    return _load("pagedserve_cpu_kernels", _SOURCES, "CPU attention kernel")


@functools.cache
def load_linear_kernels():
    return _load("pagedserve_linear_kernels", _LINEAR_SOURCES, "CPU linear kernels")


def linear_kernels_available() -> bool:
    return load_linear_kernels() is not None


@functools.cache
def load_moe_kernels():
    return _load("pagedserve_moe_kernels", _MOE_SOURCES, "CPU mixture-of-experts kernel")


@functools.cache
def load_elementwise_kernels():
    return _load("pagedserve_elementwise_kernels", _ELEMENTWISE_SOURCES, "CPU elementwise kernels")


def _load(name: str, sources: list[Path], what: str):
    try:
        from torch.utils.cpp_extension import load

        return load(
            name=f"{name}_{_build_signature()}",
            sources=[str(s) for s in sources],
            extra_cflags=["-O3", "-march=native", "-fopenmp", *_EXTRA_CFLAGS],
            extra_ldflags=["-fopenmp"],
        )
    except Exception as e:  # no compiler, no ninja, no headers: slower but correct
        logger.warning("%s unavailable (%s); using the pure-torch path", what, e)
        return None
