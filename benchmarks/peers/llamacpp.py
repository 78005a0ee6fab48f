"""llama.cpp as a peer: its binaries built once from the sources vendored in the `llama-cpp-python` sdist
(PyPI is the one place we can get them from), and Hugging Face checkpoints converted to GGUF.

    from benchmarks.peers import llamacpp
    llamacpp.build()                                          # LlamaCpp: server, batched_bench, quantize paths
    gguf = llamacpp.convert_to_gguf(hf_dir, out_dir / "model-f32.gguf", "f32")
    q4 = llamacpp.quantize(gguf, out_dir / "model-q4_0.gguf", "Q4_0", leave_output_tensor=True)

Everything lands under $PAGEDSERVE_CACHE/llamacpp/<llama-cpp-python version>/ (default ~/.cache/pagedserve):
`src/` (the unpacked sdist), `build/` (cmake, Release, only the targets below), and a `.built` stamp. A
second call finds the stamp and builds nothing. Nothing here is committed; the first call on a machine
downloads the sdist (~75 MB) with pip and compiles for ~10 minutes on 2 cores."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path

# Pinned: peers are compared across runs and machines, so the llama.cpp inside must not move silently.
LLAMA_CPP_PYTHON_VERSION = "0.3.36"
TARGETS = ("llama-server", "llama-batched-bench", "llama-quantize")

# Release, CPU only, this machine's instruction set (GGML_NATIVE, llama.cpp's default). No curl or OpenSSL
# (no model downloads: we hand it files), and no web UI, whose assets would be fetched from the network.
_CMAKE_OPTIONS = {
    "CMAKE_BUILD_TYPE": "Release",
    "LLAMA_CURL": "OFF",
    "LLAMA_OPENSSL": "OFF",
    "LLAMA_BUILD_UI": "OFF",
    "LLAMA_USE_PREBUILT_UI": "OFF",
    "LLAMA_BUILD_TESTS": "OFF",
    "LLAMA_BUILD_EXAMPLES": "OFF",
    "LLAMA_BUILD_SERVER": "ON",
    "GGML_NATIVE": "ON",
}


@dataclass(frozen=True)
class LlamaCpp:
    """A built llama.cpp: its source tree (for convert_hf_to_gguf.py and gguf-py) and binaries."""

    version: str
    source: Path
    build_dir: Path

    def binary(self, target: str) -> Path:
        return self.build_dir / "bin" / target

    @property
    def server(self) -> Path:
        return self.binary("llama-server")

    @property
    def batched_bench(self) -> Path:
        return self.binary("llama-batched-bench")

    @property
    def quantize(self) -> Path:
        return self.binary("llama-quantize")


def cache_dir(version: str = LLAMA_CPP_PYTHON_VERSION) -> Path:
    root = Path(os.environ.get("PAGEDSERVE_CACHE", Path.home() / ".cache" / "pagedserve"))
    return root / "llamacpp" / version


def build(version: str = LLAMA_CPP_PYTHON_VERSION, jobs: int | None = None, log=print) -> LlamaCpp:
    """The built llama.cpp of `version`, building it first if this machine has not yet."""
    root = cache_dir(version)
    llama = LlamaCpp(version, root / "src" / "vendor" / "llama.cpp", root / "build")
    stamp = root / ".built"
    if stamp.is_file() and all(llama.binary(t).is_file() for t in TARGETS):
        return llama
    root.mkdir(parents=True, exist_ok=True)
    if not (llama.source / "CMakeLists.txt").is_file():
        log(f"llama.cpp: downloading the llama-cpp-python {version} sdist")
        _unpack_sdist(version, root / "src")
    generator = ["-G", "Ninja"] if shutil.which("ninja") else []
    options = [f"-D{k}={v}" for k, v in _CMAKE_OPTIONS.items()]
    log(f"llama.cpp: configuring and building {', '.join(TARGETS)} into {llama.build_dir} (minutes)")
    _run(["cmake", "-S", str(llama.source), "-B", str(llama.build_dir), *generator, *options], root / "cmake.log")
    _run(["cmake", "--build", str(llama.build_dir), "--target", *TARGETS, "-j", str(jobs or os.cpu_count() or 1)],
         root / "build.log")
    stamp.write_text(version)
    return llama


def _unpack_sdist(version: str, dest: Path) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps",
                        "--quiet", "-d", tmp, f"llama-cpp-python=={version}"], check=True)
        (sdist,) = Path(tmp).glob("llama_cpp_python-*.tar.gz")
        with tarfile.open(sdist) as tar:
            tar.extractall(tmp, filter="data")
        if dest.exists():
            shutil.rmtree(dest)
        shutil.move(str(Path(tmp) / f"llama_cpp_python-{version}"), dest)


def _run(cmd: list[str], log_file: Path) -> None:
    with open(log_file, "w") as f:
        done = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT)
    if done.returncode != 0:
        tail = log_file.read_text(errors="replace")[-4000:]
        raise RuntimeError(f"{' '.join(cmd[:3])} ... failed ({done.returncode}); see {log_file}:\n{tail}")


def convert_to_gguf(hf_dir: str | Path, out: str | Path, outtype: str = "f32", llama: LlamaCpp | None = None) -> Path:
    """`hf_dir` (a Hugging Face checkpoint) as a GGUF file at `out`, with llama.cpp's own converter
    (`outtype`: f32, f16, bf16, q8_0, ...). Skipped when `out` is newer than the checkpoint's weights.
    The converter imports `gguf` from the source tree (PYTHONPATH=gguf-py) and needs numpy, pyyaml,
    requests, tqdm, sentencepiece, transformers and torch, all dependencies of this project already."""
    llama = llama or build()
    hf_dir, out = Path(hf_dir), Path(out)
    weights = max((p.stat().st_mtime for p in hf_dir.glob("*.safetensors")), default=0.0)
    if out.is_file() and out.stat().st_mtime >= weights:
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": str(llama.source / "gguf-py"), "NO_LOCAL_GGUF": ""}
    partial = out.with_name(out.name + ".partial")
    done = subprocess.run([sys.executable, str(llama.source / "convert_hf_to_gguf.py"), str(hf_dir),
                           "--outfile", str(partial), "--outtype", outtype], env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"convert_hf_to_gguf.py failed ({done.returncode}):\n{done.stderr[-4000:]}")
    partial.replace(out)
    return out


def quantize(gguf: str | Path, out: str | Path, type: str, leave_output_tensor: bool = False,
             llama: LlamaCpp | None = None, threads: int | None = None) -> Path:
    """`gguf` quantized to `type` (llama-quantize's names: Q8_0, Q4_0, Q4_K_M, ...) at `out`.
    `leave_output_tensor` keeps the LM head unquantized (--leave-output-tensor), as an engine that
    quantizes only the linear layers of the decoder does."""
    llama = llama or build()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    cmd = [str(llama.quantize), *(["--leave-output-tensor"] if leave_output_tensor else []), str(gguf), str(out), type]
    if threads:
        cmd.append(str(threads))
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"llama-quantize failed ({done.returncode}):\n{done.stderr[-4000:]}")
    return out


if __name__ == "__main__":  # python benchmarks/peers/llamacpp.py: build now, print where
    built = build()
    print(built.server, built.batched_bench, built.quantize, sep="\n")
