"""A broken kernel is seen: with a toolchain present, a kernel that does not compile fails the build step
(`python -m ops.cpu`, naming the kernel and quoting the compiler) and fails its tests instead of skipping
them. Without a toolchain the engine runs its pure-torch paths after one warning naming every kernel lost.

Each case runs in a child process with a build folder of its own (TORCH_EXTENSIONS_DIR): the failed builds never
reach the shared extension cache."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ops.cpu import missing_toolchain

ROOT = Path(__file__).parents[2]
BAD_FLAG = "-fno-such-flag-pagedserve"  # torch passes it on; no compiler accepts it
KERNELS = {"paged attention": "paged_attention.cpp", "linear": "panel_linear.cpp",
           "mixture-of-experts": "fused_moe.cpp", "elementwise (RMSNorm, rotary)": "elementwise.cpp",
           "decode stack": "decode_stack.cpp", "sampling": "sampling.cpp"}
# The tests of three kernels, less their pure-torch cases (the MoE kernel's test needs the engine's machinery;
# the build step covers that kernel).
KERNEL_TESTS = ["tests/ops/test_quant_linear.py", "tests/ops/test_elementwise.py",
                "tests/ops/test_cpu_linear.py::test_packed_rows_compute_what_the_plain_linear_does",
                "tests/ops/test_torch_attention.py::test_cpu_kernel_head_dims_and_dtypes_match_the_torch_path"]
needs_toolchain = pytest.mark.skipif(bool(missing_toolchain()),
                                     reason=f"CPU kernels not compiled: {missing_toolchain()}")


def _start(args: list[str], build_dir: Path, **env: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, *args], env={**os.environ, "TORCH_EXTENSIONS_DIR": str(build_dir), **env},
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait(proc: subprocess.Popen) -> subprocess.CompletedProcess:
    try:
        stdout, stderr = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


def _run(args: list[str], build_dir: Path, **env: str) -> subprocess.CompletedProcess:
    return _wait(_start(args, build_dir, **env))


@needs_toolchain
def test_a_kernel_that_fails_to_compile_fails_the_build_step_and_its_tests(tmp_path):
    # The build step and the tests side by side (each mostly a Python start-up), in build folders of their own
    tests = _start(["-m", "pytest", "-q", "--tb=line", "-p", "no:cacheprovider", *KERNEL_TESTS], tmp_path / "tests",
                   PAGEDSERVE_CPU_CFLAGS=BAD_FLAG)
    try:
        build = _run(["-m", "ops.cpu"], tmp_path / "build", PAGEDSERVE_CPU_CFLAGS=BAD_FLAG)
    finally:
        tests = _wait(tests)
    assert build.returncode == 1, build.stdout + build.stderr[-3000:]
    for kernel, source in KERNELS.items():
        assert f"error: the {kernel} CPU kernel ({source}) failed to build with" in build.stderr
    lines = build.stderr.splitlines()
    compilers = [line for line in lines if "error:" in line and BAD_FLAG in line and not line.startswith("error: the ")]
    assert compilers, build.stderr[-3000:]  # gcc: "unrecognized command-line option"; clang: "unknown argument"
    assert f"compiled: 0 of {len(KERNELS)}" in build.stdout

    summary = tests.stdout.splitlines()[-1]
    assert tests.returncode == 1 and " failed" in summary and "skipped" not in summary, tests.stdout[-3000:]
    assert "KernelBuildError: the linear CPU kernel" in tests.stdout
    assert "KernelBuildError: the paged attention CPU kernel" in tests.stdout
    assert "KernelBuildError: the elementwise (RMSNorm, rotary) CPU kernel" in tests.stdout


def test_without_a_compiler_the_engine_runs_on_torch_after_one_warning(tmp_path):
    script = ("from engine import LLM, SamplingParams\n"
              "llm = LLM('pagedserve-tiny-moe', dtype='float32', num_kv_blocks=16, max_model_len=64)\n"
              "params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)\n"
              "print('tokens', len(llm.generate([[1, 2, 3, 4, 5]], params, use_tqdm=False)[0].outputs[0].token_ids))\n")
    run = _run(["-c", script], tmp_path, CXX=str(tmp_path / "no-such-c++"))
    assert run.returncode == 0 and "tokens 4" in run.stdout, run.stderr[-3000:]
    warnings = [line for line in run.stderr.splitlines() if "CPU kernels not compiled" in line]
    assert len(warnings) == 1, run.stderr[-3000:]
    assert "no-such-c++" in warnings[0] and all(kernel in warnings[0] for kernel in KERNELS)
    assert not any(tmp_path.iterdir()), "nothing was to be built"


def test_the_venvs_own_ninja_is_found_where_path_has_none(tmp_path):
    """`.venv/bin/python -m ops.cpu` (as `make install` runs it) has no venv on PATH: the ninja we depend on
    is found all the same, rather than the kernels falling back for want of it."""
    pytest.importorskip("ninja")
    compiler = shutil.which(os.environ.get("CXX", "c++"))
    if compiler is None:
        pytest.skip("no C++ compiler")
    script = ("import shutil; from ops.cpu import missing_toolchain; "
              "print(missing_toolchain(), shutil.which('ninja'))")
    run = _run(["-c", script], tmp_path, PATH=str(tmp_path), CXX=compiler)
    assert run.returncode == 0 and run.stdout.startswith("None ") and run.stdout.strip().endswith("ninja"), run
