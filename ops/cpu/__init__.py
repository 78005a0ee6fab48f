"""CPU kernels compiled on first use (torch.utils.cpp_extension, into torch's extension cache), one
build per CPU type; `make install` compiles them all ahead, side by side (`python -m ops.cpu`).

`load_cpu_kernels()` (paged attention), `load_linear_kernels()` (linear layers over float32, int8 and int4
weight panels), `load_moe_kernels()` (mixture-of-experts layers), `load_elementwise_kernels()` (RMSNorm,
rotary embeddings), `load_decode_stack()` (a decode step through a model's layers, calling the others' kernels)
and `load_sampling_kernels()` (sampling's masks and draw) return a compiled module. One module each: each rebuilds only
when its own sources change, and a model compiles only the kernels it runs.

Where there is no toolchain (no compiler, or no ninja) they return None, after one warning naming every
kernel lost, and callers fall back to their pure-torch paths. Where there is one, a kernel that fails to build
raises KernelBuildError with the compiler's output: a C++ regression must fail the build step and the tests,
not pass unseen as a slower engine."""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import shlex
import shutil
from pathlib import Path

logger = logging.getLogger(__name__)

# kernel -> (module name, source): the names the build errors and the one fallback warning give.
_KERNELS = {
    "paged attention": ("pagedserve_cpu_kernels", "paged_attention.cpp"),
    "linear": ("pagedserve_linear_kernels", "panel_linear.cpp"),
    "mixture-of-experts": ("pagedserve_moe_kernels", "fused_moe.cpp"),
    "elementwise (RMSNorm, rotary)": ("pagedserve_elementwise_kernels", "elementwise.cpp"),
    "decode stack": ("pagedserve_decode_stack", "decode_stack.cpp"),
    "sampling": ("pagedserve_sampling_kernels", "sampling.cpp"),
}
# torch keys a build by its sources only: the shared headers are part of our build signature
_HEADERS = [Path(__file__).parent / h for h in ("work_sharing.h", "vec16.h", "fast_exp.h", "kernel_capsules.h")]
# Extra compiler flags, e.g. "-mno-avx512f" to build (and test) the AVX2 paths on an AVX-512 machine.
_EXTRA_CFLAGS = os.environ.get("PAGEDSERVE_CPU_CFLAGS", "").split()


class KernelBuildError(RuntimeError):
    """A CPU kernel failed to compile although a toolchain is present."""


def missing_toolchain() -> str | None:
    """What torch's extension builder lacks here (the compiler it would run, or ninja), or None."""
    cxx = os.environ.get("CXX", "c++")  # torch's own choice (cpp_extension.get_cxx_compiler)
    if not shutil.which((shlex.split(cxx) or [""])[0]):
        return f"no C++ compiler: {cxx!r}{' (from $CXX)' if 'CXX' in os.environ else ''} not found"
    if not shutil.which("ninja") and not _put_pip_ninja_on_path():
        return "no ninja on PATH"
    return None


def _put_pip_ninja_on_path() -> bool:
    # torch runs `ninja` from PATH, where a venv's own (the pip package we depend on) is only once activated:
    # `.venv/bin/python -m ops.cpu`, as `make install` runs it, would otherwise build nothing.
    try:
        import ninja
    except ImportError:
        return False
    os.environ["PATH"] = f"{ninja.BIN_DIR}{os.pathsep}{os.environ.get('PATH', '')}"
    return shutil.which("ninja") is not None


@functools.cache
def _warn_fallback_once() -> None:
    logger.warning("CPU kernels not compiled (%s): the %s kernels are lost, using the slower pure-torch paths "
                   "instead. Install a C++ compiler and ninja (or set CXX) to compile them.",
                   missing_toolchain(), ", ".join(_KERNELS))


def _build_signature() -> str:
    # -march=native code must not run on another CPU: key the build folder by the CPU's flags, by the extra
    # compiler flags, and by the shared headers, whose changes torch's extension versioning would not see. And
    # by where the sources and torch live: two checkouts sharing torch's cache otherwise rewrite one build
    # folder in turn, each rebuilding it under the lock the other waits on.
    import torch

    flags = " ".join(sorted(cpu_flags())) or platform.processor()
    headers = b"".join(h.read_bytes() for h in _HEADERS)
    where = f"{Path(__file__).resolve().parent} {Path(torch.__file__).resolve().parent}"
    return hashlib.sha256(f"{platform.machine()} {flags} {_EXTRA_CFLAGS} {where}".encode() + headers).hexdigest()[:10]


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (/proc/cpuinfo's first `flags` line; empty where there is none)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return frozenset()
    return frozenset(next((line for line in lines if line.startswith("flags")), "").split()[2:])


@functools.cache
def load_cpu_kernels():
    return _load("paged attention")


@functools.cache
def load_linear_kernels():
    return _load("linear")


def linear_kernels_available() -> bool:
    return load_linear_kernels() is not None


@functools.cache
def load_moe_kernels():
    return _load("mixture-of-experts")


@functools.cache
def load_elementwise_kernels():
    return _load("elementwise (RMSNorm, rotary)")


@functools.cache
def load_decode_stack():
    return _load("decode stack")


@functools.cache
def load_sampling_kernels():
    return _load("sampling")


_build_errors: dict[str, KernelBuildError] = {}  # a kernel that failed to build is not rebuilt at every call


def _load(kernel: str):
    if missing_toolchain():
        _warn_fallback_once()
        return None
    if kernel in _build_errors:
        raise _build_errors[kernel]
    from torch.utils.cpp_extension import load

    name, source = _KERNELS[kernel]
    try:
        return load(
            name=f"{name}_{_build_signature()}",
            sources=[str(Path(__file__).parent / source)],
            # -fno-trapping-math: no kernel reads the floating-point exception flags, and with them kept GCC
            # leaves a loop scalar for each compare it would turn into a select (a clamp, a mask, exp's range).
            extra_cflags=["-O3", "-march=native", "-fopenmp", "-fno-trapping-math", *_EXTRA_CFLAGS],
            extra_ldflags=["-fopenmp"],
        )
    except (RuntimeError, OSError, ImportError) as e:  # the compiler's or linker's error, or a .so that won't load
        cxx = os.environ.get("CXX", "c++")
        flags = f" and PAGEDSERVE_CPU_CFLAGS={' '.join(_EXTRA_CFLAGS)!r}" if _EXTRA_CFLAGS else ""
        _build_errors[kernel] = KernelBuildError(
            f"the {kernel} CPU kernel ({source}) failed to build with {cxx}{flags}; fix what the compiler "
            f"reports, then rebuild with `python -m ops.cpu`. {e}")
        raise _build_errors[kernel] from e
