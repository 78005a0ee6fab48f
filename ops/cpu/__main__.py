"""`python -m ops.cpu`: compile every CPU kernel now, side by side, instead of one by one at first use
(`make install` runs it, so that neither the first `make run` nor the test suite waits for a compiler).

Exits non-zero, naming each kernel that failed and the compiler's error, when a toolchain is present and a
kernel does not build; exits 0 with the one fallback warning where there is no toolchain."""

from __future__ import annotations

import logging
import sys
from concurrent.futures import ProcessPoolExecutor

from ops.cpu import (
    KernelBuildError,
    load_cpu_kernels,
    load_decode_stack,
    load_elementwise_kernels,
    load_linear_kernels,
    load_moe_kernels,
    load_sampling_kernels,
    missing_toolchain,
)


def _build(loader) -> str | None:
    """None when built, else the build error's message (the compiler's output in it)."""
    try:
        loader()
    except KernelBuildError as e:
        return str(e)
    return None


def main() -> int:
    loaders = [load_cpu_kernels, load_linear_kernels, load_moe_kernels, load_elementwise_kernels, load_decode_stack,
               load_sampling_kernels]
    if missing_toolchain():
        logging.basicConfig(format="%(levelname)s %(name)s: %(message)s")
        for load in loaders:  # None each, after one warning naming every kernel lost
            load()
        print(f"CPU kernels compiled: 0 of {len(loaders)} ({missing_toolchain()}: pure-torch paths)")
        return 0
    import torch.utils.cpp_extension  # noqa: F401  once, here: the forked builders inherit it

    with ProcessPoolExecutor(len(loaders)) as pool:  # one compiler each: a build is one translation unit
        errors = [e for e in pool.map(_build, loaders) if e]
    for error in errors:
        print(f"error: {error}", file=sys.stderr)
    print(f"CPU kernels compiled: {len(loaders) - len(errors)} of {len(loaders)}")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
