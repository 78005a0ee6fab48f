"""The GPU check: what a lent GPU runs, through benchmarks/gpu_check.sh (which first installs the wheels the
machine lacks). Every check prints one line, PASS, FAIL or SKIP with why; the JSON of the run goes to
--out (default $OUT/gpu_check.json where the device tool sets OUT). Exits 1 if any check failed.

1. collectives: a process group of one member over the device's backend (NCCL on a GPU, gloo on the CPU),
   driven through GroupCoordinator: NCCL refuses any tensor that is not on the member's GPU, so every
   collective the engine runs (the KV block count's minimum, the barrier, all-reduce, gathers) shows its
   tensors are made on the rank's device (engine/distributed/parallel_state.py). One GPU holds one NCCL
   rank: multi-rank NCCL needs a machine of several GPUs.
2. parity: the engine on the device with the torch attention backend against the engine on the CPU, on a
   small built-in model in float32, greedy with chunked prefill: equal tokens, except at a tie of the CPU's
   top two (their gap under --tie, and the device took the runner-up); the chosen tokens' logprobs within
   --logprob-atol until then. Sampled, seeded, penalized and biased requests must run on the device (their
   random streams differ between devices, so only their lengths are compared).
3. flashinfer: the FlashInfer backend against the torch backend on the device, in bfloat16 (FlashInfer has
   no float32 kernels), where flashinfer imports; its wheel (~100 MB with its dependencies) does not fit
   in what a device run may carry, so this is usually a SKIP naming that.
4. throughput: output tokens per second of the 56M built-in model in bfloat16 on the device, 64 requests of
   benchmarks/throughput.py's workload, ignore_eos, after a warm-up.

`--device cpu` runs the same logic on the CPU (gloo, CPU against CPU, a shorter throughput run): a dry run
on a machine without a GPU."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from benchmarks.throughput import workload
from engine import LLM, SamplingParams
from engine.distributed.parallel_state import GroupCoordinator, collective_backend, collective_device, new_process_group
from engine.executor.worker import rank_device, start_rank

PARITY_ENGINE = {"dtype": "float32", "max_model_len": 512, "num_kv_blocks": 256, "max_num_seqs": 8,
                 "max_num_batched_tokens": 96}


def check_collectives(device: torch.device) -> str:
    start_rank(device)
    backend = collective_backend(device)
    group = new_process_group(dist.HashStore(), 0, 1, backend, datetime.timedelta(seconds=60))
    coordinator = GroupCoordinator([0], 0, group, collective_device(backend, device))
    assert coordinator.all_reduce_min(7) == 7
    coordinator.barrier()
    x = torch.arange(6, dtype=torch.float32, device=device).view(2, 3)
    assert torch.equal(coordinator.all_reduce(x.clone()), x)
    assert torch.equal(coordinator.all_reduce_max(x.clone()), x)
    assert torch.equal(coordinator.all_gather(x), x) and torch.equal(coordinator.gather(x), x)
    if backend == "nccl":
        torch.cuda.synchronize(device)
    return f"{backend} on {coordinator.device}: all_reduce_min, barrier, all_reduce, all_reduce_max, all_gather, gather"


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[1] + [rng.randrange(3, 32000) for _ in range(rng.choice([4, 17, 60, 130, 300]))] for _ in range(n)]


def _greedy(llm: LLM, prompts: list[list[int]], max_tokens: int):
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=2)
    return [out.outputs[0] for out in llm.generate(prompts, params, use_tqdm=False)]


def compare_greedy(reference, ours, tie: float, logprob_atol: float) -> tuple[int, float]:
    """Assert the parity rule (module docstring); returns (ties tolerated, largest logprob difference)."""
    ties, worst = 0, 0.0
    for i, (ref, out) in enumerate(zip(reference, ours)):
        for pos, (a, b) in enumerate(zip(out.token_ids, ref.token_ids)):
            if a != b:
                top = sorted(ref.logprobs[pos].items(), key=lambda kv: kv[1].rank)
                (_, first), (second_id, second) = top[0], top[1]
                gap = first.logprob - second.logprob
                assert gap < tie and a == second_id, (
                    f"prompt {i}, token {pos}: {a} against the CPU's {b}; the CPU's top two are {gap:.2e} apart, "
                    f"no tie (threshold {tie:.0e})")
                ties += 1
                break
            diff = abs(out.logprobs[pos][a].logprob - ref.logprobs[pos][b].logprob)
            worst = max(worst, diff)
            assert diff <= logprob_atol, f"prompt {i}, token {pos}: logprobs {diff:.2e} apart (atol {logprob_atol:.0e})"
    return ties, worst


def check_parity(device: torch.device, model: str, args) -> str:
    prompts = _prompts(8)
    cxx = os.environ.get("CXX")
    if device.type == "cuda" and not args.cpu_kernels:
        # The CPU reference on its pure-torch paths: compiling the CPU kernels would spend a minute of the GPU's.
        # Each kernel is looked for once, by the reference's first step; a JIT (FlashInfer's) gets CXX back.
        os.environ["CXX"] = "/nonexistent/c++"
    cpu = LLM(model, device="cpu", attention_backend="torch", **PARITY_ENGINE)
    try:
        reference = _greedy(cpu, prompts, args.max_tokens)
    finally:
        cpu.shutdown()
        if cxx is None:
            os.environ.pop("CXX", None)
        else:
            os.environ["CXX"] = cxx
    llm = LLM(model, device=device.type, attention_backend="torch", **PARITY_ENGINE)
    try:
        assert llm.llm_engine.core.executor.device.type == device.type
        ties, worst = compare_greedy(reference, _greedy(llm, prompts, args.max_tokens), args.tie, args.logprob_atol)
        varied = [SamplingParams(temperature=0.8, top_p=0.9, top_k=50, max_tokens=16, ignore_eos=True, seed=1),
                  SamplingParams(temperature=1.0, min_p=0.05, max_tokens=16, ignore_eos=True),
                  SamplingParams(temperature=0.7, presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.1,
                                 max_tokens=16, ignore_eos=True, logprobs=3),
                  SamplingParams(temperature=0, logit_bias={7: 5.0}, max_tokens=16, ignore_eos=True, prompt_logprobs=2)]
        outs = llm.generate(prompts[:4], varied, use_tqdm=False)
        assert [len(o.outputs[0].token_ids) for o in outs] == [16] * 4
    finally:
        llm.shutdown()
    return (f"{model} float32, {len(prompts)} prompts x {args.max_tokens} tokens: tokens equal "
            f"({ties} tolerated ties), logprobs within {worst:.1e}; sampled, seeded, penalized, biased requests ran")


def check_flashinfer(device: torch.device, model: str, args) -> str | None:
    """None (a SKIP) where FlashInfer cannot run: not a GPU, or not installed."""
    if device.type != "cuda":
        return None
    try:
        import flashinfer  # noqa: F401
    except ImportError:
        return None
    prompts = _prompts(8, seed=1)
    engine = {**PARITY_ENGINE, "dtype": "bfloat16", "device": "cuda"}
    results = []
    for backend in ("torch", "flashinfer"):
        llm = LLM(model, attention_backend=backend, **engine)
        try:
            results.append(_greedy(llm, prompts, args.max_tokens))
        finally:
            llm.shutdown()
    ties, worst = compare_greedy(*results, tie=args.bf16_tie, logprob_atol=args.bf16_logprob_atol)
    return (f"{model} bfloat16: FlashInfer's tokens equal the torch backend's ({ties} tolerated ties), "
            f"logprobs within {worst:.1e}")


def check_throughput(device: torch.device, model: str, args) -> tuple[str, dict]:
    reqs = workload(args.num_requests, seed=0)
    dtype = "bfloat16" if device.type == "cuda" else "float32"
    llm = LLM(model, device=device.type, dtype=dtype, attention_backend="torch", max_model_len=1024,
              max_num_seqs=256, kv_cache_memory_gb=4 if device.type == "cuda" else 1)
    try:
        params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for _, m in reqs]
        warm = max(1, len(reqs) // 8)
        llm.generate([p for p, _ in reqs[:warm]], params[:warm], use_tqdm=False)  # warm-up
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        outs = llm.generate([p for p, _ in reqs], params, use_tqdm=False)
        elapsed = time.perf_counter() - start
    finally:
        llm.shutdown()
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    assert tokens == sum(m for _, m in reqs)
    numbers = {"model": model, "dtype": dtype, "requests": len(reqs), "output_tokens": tokens, "seconds": elapsed,
               "output_tokens_per_s": tokens / elapsed}
    return (f"{model} {dtype}, {len(reqs)} requests: {tokens / elapsed:,.0f} output tok/s "
            f"({tokens} tokens in {elapsed:.1f} s)", numbers)


def _run(name: str, check: Callable[[], str | None | tuple[str, dict]], report: dict, skip_why: str = "") -> None:
    start = time.perf_counter()
    try:
        result = check()
    except Exception as e:  # noqa: BLE001 - one check's failure is reported and the others still run
        status, detail = "FAIL", f"{type(e).__name__}: {e}"
        report.setdefault("tracebacks", {})[name] = traceback.format_exc()
    else:
        numbers = None
        if isinstance(result, tuple):
            result, numbers = result
        status, detail = ("SKIP", skip_why) if result is None else ("PASS", result)
        if numbers:
            report.setdefault("numbers", {})[name] = numbers
    seconds = time.perf_counter() - start
    report["checks"][name] = {"status": status, "detail": detail, "seconds": round(seconds, 1)}
    print(f"{status:4}  {name:11} {detail}  [{seconds:.1f} s]", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="cpu: a dry run without a GPU")
    parser.add_argument("--model", default="pagedserve-tiny", help="the parity checks' model")
    parser.add_argument("--bench-model", default="pagedserve-56m", help="the throughput check's model")
    parser.add_argument("--num-requests", type=int, default=None, help="throughput requests (default 64; 8 on cpu)")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--tie", type=float, default=1e-4, help="float32 top-2 gap under which tokens may differ")
    parser.add_argument("--logprob-atol", type=float, default=1e-3)
    parser.add_argument("--bf16-tie", type=float, default=5e-2)
    parser.add_argument("--bf16-logprob-atol", type=float, default=1e-1)
    parser.add_argument("--cpu-kernels", action="store_true", help="compile the CPU kernels for the CPU reference")
    parser.add_argument("--skip", nargs="*", default=[], choices=["collectives", "parity", "flashinfer", "throughput"])
    parser.add_argument("--out", default=None, help="JSON report (default: $OUT/gpu_check.json when OUT is set)")
    args = parser.parse_args(argv)
    args.num_requests = args.num_requests or (64 if args.device == "cuda" else 8)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("FAIL  torch sees no GPU; on a machine without one, run with --device cpu", flush=True)
        return 1
    device = rank_device(args.device, 0)
    report: dict = {"device": str(device), "torch": torch.__version__, "python": platform.python_version(),
                    "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None, "checks": {}}
    print(f"gpu_check on {report['gpu'] or 'the CPU'}: torch {torch.__version__}, python {report['python']}",
          flush=True)
    checks = {
        "collectives": (lambda: check_collectives(device), ""),
        "parity": (lambda: check_parity(device, args.model, args), ""),
        "flashinfer": (lambda: check_flashinfer(device, args.model, args),
                       "no GPU" if device.type != "cuda"
                       else "flashinfer is not installed (its wheel is over what a run "
                       "may carry: benchmarks/gpu_check.sh fetch --flashinfer says by how much)"),
        "throughput": (lambda: check_throughput(device, args.bench_model, args), ""),
    }
    for name, (check, skip_why) in checks.items():
        if name in args.skip:
            report["checks"][name] = {"status": "SKIP", "detail": "--skip"}
            print(f"SKIP  {name:11} --skip", flush=True)
            continue
        _run(name, check, report, skip_why)
    out = args.out or (str(Path(os.environ["OUT"]) / "gpu_check.json") if os.environ.get("OUT") else None)
    if out:
        Path(out).write_text(json.dumps(report, indent=2))
    failed = [name for name, c in report["checks"].items() if c["status"] == "FAIL"]
    for name in failed:
        print(f"\n--- {name} ---\n{report['tracebacks'][name]}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
