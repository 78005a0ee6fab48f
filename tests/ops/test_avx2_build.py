"""On an AVX-512 machine the kernels compile to their AVX-512 code, so the AVX2 code that other machines run
would go untested: this builds every kernel's AVX2 variant (PAGEDSERVE_CPU_CFLAGS=-mno-avx512f, builds of their
own) with the build step, then runs every kernel's tests on them in a child process. Where that variant still
has AVX-VNNI, W8A8 and W4A8 use its vpdpbusd: AVX2's own path (vpmaddubsw) then gets a build of the linear
kernel alone without it (-mno-avxvnni) and those two kernels' tests, beside the rest."""

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from ops.cpu import cpu_flags, missing_toolchain

ROOT = Path(__file__).parents[2]
KERNEL_TESTS = ["tests/ops/test_quant_linear.py", "tests/ops/test_cpu_linear.py",
                "tests/ops/test_elementwise.py", "tests/ops/test_torch_attention.py", "tests/ops/test_sampling.py",
                "tests/engine/models/test_moe.py::test_fused_moe_matches_a_per_token_reference"]
AVX2 = "-mno-avx512f"


def _defines_avx_vnni(flags: str) -> bool:
    """Whether the compiler, as the kernels' build runs it with `flags`, targets AVX-VNNI."""
    cxx = shlex.split(os.environ.get("CXX", "c++"))
    macros = subprocess.run([*cxx, "-march=native", *flags.split(), "-dM", "-E", "-x", "c++", "-"], input="",
                            capture_output=True, text=True, timeout=60)
    return "__AVXVNNI__" in macros.stdout


def _pytest(*args: str) -> list[str]:
    return [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", *args]


def _env(cflags: str) -> dict[str, str]:
    # Idle OpenMP threads sleep instead of spinning: the child's two threads share 2 cores with whatever else runs
    # (a busy machine made its kernel tests 3x slower). What the kernels compute and on how many threads is the same.
    return {"OMP_WAIT_POLICY": "PASSIVE", **os.environ, "PAGEDSERVE_CPU_CFLAGS": cflags}


@pytest.mark.skipif(bool(missing_toolchain()) or "avx512f" not in cpu_flags(), reason="no AVX-512 build to test beside")
def test_the_avx2_build_passes_every_kernels_tests():
    env = _env(AVX2)
    plain = None
    if _defines_avx_vnni(AVX2):
        plain = subprocess.Popen(_pytest("tests/ops/test_quant_linear.py", "-k", "w8a8 or w4a8"),
                                 env=_env(f"{AVX2} -mno-avxvnni"), cwd=ROOT, stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True)
    try:
        build = subprocess.run([sys.executable, "-m", "ops.cpu"], env=env, cwd=ROOT, capture_output=True, text=True,
                               timeout=900)
        assert build.returncode == 0, build.stdout[-2000:] + build.stderr[-4000:]
        # The attention tests' pure-torch cases run no compiled code: the main run has them, whatever the flags.
        result = subprocess.run(_pytest(*KERNEL_TESTS, "-k", "not pure-torch"), env=env, cwd=ROOT, capture_output=True,
                                text=True, timeout=600)
        assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
        skips = [line for line in result.stdout.splitlines() if line.startswith("SKIPPED")]
        expected = ("need AVX512_BF16",)  # skips that say what the AVX2 build lacks
        assert " passed" in result.stdout and all(any(e in line for e in expected) for line in skips), skips
        if plain:
            stdout, stderr = plain.communicate(timeout=900)
            assert plain.returncode == 0 and " passed" in stdout and "skipped" not in stdout, \
                stdout[-4000:] + stderr[-2000:]
    finally:
        if plain and plain.poll() is None:
            plain.kill()
            plain.communicate()
