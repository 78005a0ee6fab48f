"""`python -m kernels.cpu`: compile every CPU kernel now, side by side, instead of one by one at first use
(`make install` runs it, so that neither the first `make run` nor the test suite waits for a compiler)."""

from __future__ import annotations

from concurrent.futures import ProcessPoolExecutor

from kernels.cpu import load_cpu_kernels, load_elementwise_kernels, load_linear_kernels, load_moe_kernels


def _build(loader) -> bool:
    return loader() is not None


if __name__ == "__main__":
    loaders = [load_cpu_kernels, load_linear_kernels, load_moe_kernels, load_elementwise_kernels]
    with ProcessPoolExecutor(len(loaders)) as pool:  # one compiler each: a build is one translation unit
        built = list(pool.map(_build, loaders))
    print(f"CPU kernels compiled: {sum(built)} of {len(built)}")
