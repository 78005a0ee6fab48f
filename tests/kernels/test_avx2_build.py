"""On an AVX-512 machine the kernels compile to their AVX-512 code, so the AVX2 code that other machines run
would go untested: this builds it (PAGEDSERVE_CPU_CFLAGS=-mno-avx512f, a build of its own) and runs the
linear kernels' tests on it in a child process."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kernels.cpu import linear_kernels_available


def _has_avx512() -> bool:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return False
    return "avx512f" in next((line for line in lines if line.startswith("flags")), "").split()


@pytest.mark.skipif(not linear_kernels_available() or not _has_avx512(), reason="no AVX-512 build to test beside")
def test_the_avx2_build_passes_the_linear_kernels_tests():
    here = Path(__file__).parent
    env = {**os.environ, "PAGEDSERVE_CPU_CFLAGS": "-mno-avx512f"}
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(here / "test_quant_linear.py"),
         str(here / "test_cpu_linear.py")],
        env=env, capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert " passed" in result.stdout and "skipped" not in result.stdout.splitlines()[-1]
