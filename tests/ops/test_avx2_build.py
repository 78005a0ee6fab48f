"""On an AVX-512 machine the kernels compile to their AVX-512 code, so the AVX2 code that other machines run
would go untested: this builds every kernel's AVX2 variant (PAGEDSERVE_CPU_CFLAGS=-mno-avx512f, builds of their
own) with the build step, then runs every kernel's tests on them in a child process."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from ops.cpu import missing_toolchain

ROOT = Path(__file__).parents[2]
KERNEL_TESTS = ["tests/ops/test_quant_linear.py", "tests/ops/test_cpu_linear.py",
                "tests/ops/test_elementwise.py", "tests/ops/test_torch_attention.py",
                "tests/engine/models/test_moe.py::test_fused_moe_matches_a_per_token_reference"]


def _has_avx512() -> bool:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return False
    return "avx512f" in next((line for line in lines if line.startswith("flags")), "").split()


@pytest.mark.skipif(bool(missing_toolchain()) or not _has_avx512(), reason="no AVX-512 build to test beside")
def test_the_avx2_build_passes_every_kernels_tests():
    env = {**os.environ, "PAGEDSERVE_CPU_CFLAGS": "-mno-avx512f"}
    build = subprocess.run([sys.executable, "-m", "ops.cpu"], env=env, cwd=ROOT, capture_output=True, text=True,
                           timeout=900)
    assert build.returncode == 0, build.stdout[-2000:] + build.stderr[-4000:]
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", *KERNEL_TESTS],
                            env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    skips = [line for line in result.stdout.splitlines() if line.startswith("SKIPPED")]
    expected = ("need AVX512_BF16",)  # skips that say what the AVX2 build lacks
    assert " passed" in result.stdout and all(any(e in line for e in expected) for line in skips), skips
