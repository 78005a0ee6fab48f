"""Offline throughput: our engine against Hugging Face transformers, on the same requests, in one process.

    python benchmarks/throughput.py [--num-requests 200] [--skip-hf]

Workload (fixed seed): random token prompts of uniform length in [32, 512], outputs of uniform length in
[16, 256], ignore_eos, greedy, the 56M built-in model in float32. Systems, one after another:
  (a) pagedserve `LLM.generate`
  (b) transformers `generate`, static batches of 32 with left padding (each batch runs to its longest
      output; only the requested tokens count)
  (c) transformers continuous batching (`init_continuous_batching`, attention "paged|sdpa"), per-request
      max_new_tokens
Then the engine's CPU time per step outside the model (scheduling, input preparation, output handling)
with all requests running."""

from __future__ import annotations

import argparse
import random
import time
from collections import defaultdict

import torch

from engine import LLM, RequestOutputKind, SamplingParams
from engine.models.builtin import materialize_builtin

MODEL = "pagedserve-56m"


def workload(n: int, seed: int) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [
        ([1] + [rng.randrange(3, 32000) for _ in range(rng.randint(32, 512) - 1)], rng.randint(16, 256))
        for _ in range(n)
    ]


def make_llm(args) -> LLM:
    return LLM(
        MODEL, dtype="float32", max_model_len=1024, kv_cache_memory_gb=args.kv_gb,
        max_num_seqs=256, max_num_batched_tokens=args.max_num_batched_tokens,
    )


def run_ours(llm: LLM, reqs) -> tuple[int, float]:
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for _, m in reqs]
    llm.generate([p for p, _ in reqs[:8]], params[:8], use_tqdm=False)  # warm-up
    start = time.perf_counter()
    outs = llm.generate([p for p, _ in reqs], params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    assert all(len(o.outputs[0].token_ids) == m for o, (_, m) in zip(outs, reqs))
    return sum(m for _, m in reqs), elapsed


@torch.inference_mode()
def run_hf_static(model, reqs, batch_size: int = 32) -> tuple[int, float]:
    start = time.perf_counter()
    for i in range(0, len(reqs), batch_size):
        batch = reqs[i : i + batch_size]
        width = max(len(p) for p, _ in batch)
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        mask = torch.zeros(len(batch), width, dtype=torch.long)
        for row, (p, _) in enumerate(batch):
            ids[row, width - len(p) :] = torch.tensor(p)
            mask[row, width - len(p) :] = 1
        n = max(m for _, m in batch)
        model.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0
        )
    return sum(m for _, m in reqs), time.perf_counter() - start


@torch.inference_mode()
def run_hf_continuous(model, reqs) -> tuple[int, float]:
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    gen = GenerationConfig(max_new_tokens=256, do_sample=False, eos_token_id=-1, pad_token_id=0)
    cb = ContinuousBatchingConfig(max_batch_tokens=2048, num_blocks=4096, page_size=16, use_cuda_graph=False)
    manager = model.init_continuous_batching(generation_config=gen, continuous_batching_config=cb)
    manager.start()
    start = time.perf_counter()
    for i, (p, m) in enumerate(reqs):
        manager.add_request(p, request_id=f"r{i}", max_new_tokens=m, eos_token_id=-1)
    tokens, done = 0, 0
    for result in manager:
        if result.is_finished():
            tokens += len(result.generated_tokens)
            done += 1
            if done == len(reqs):
                break
    elapsed = time.perf_counter() - start
    manager.stop(block=True)
    return tokens, elapsed


def step_overhead(llm: LLM, reqs, kind: RequestOutputKind, steps: int = 20) -> dict[str, float]:
    """Mean ms per decode step with every request running, split into the model (forward, logits,
    sampler), scheduling + input preparation, and output processing (token bookkeeping, stop checks, the
    core's token-id outputs, then detokenization and RequestOutputs). FINAL_ONLY is LLM.generate's mode;
    DELTA is a server streaming every request, which detokenizes and builds an output per request per step."""
    engine = llm.llm_engine
    core = engine.core
    model = core.executor.driver_worker.model
    for p, _ in reqs:
        engine.add_request(p, SamplingParams(temperature=0, max_tokens=1000, ignore_eos=True, output_kind=kind))
    while engine.core.scheduler.waiting or any(r.num_computed_tokens < r.num_prompt_tokens
                                               for r in engine.core.scheduler.running):
        engine.step()
    timings: dict[str, float] = defaultdict(float)
    hooks = [(model, "forward"), (model, "compute_logits"), (core.step_sampler, "sampler"), (core, "_execute"),
             (core.scheduler, "schedule"), (core.scheduler, "update_from_output"), (core, "_emit"),
             (engine, "_process")]
    originals = []
    for obj, name in hooks:
        fn = getattr(obj, name)
        originals.append((obj, name, fn))

        def wrapper(*a, _fn=fn, _name=name, **k):
            t = time.perf_counter()
            r = _fn(*a, **k)
            timings[_name] += time.perf_counter() - t
            return r

        setattr(obj, name, wrapper)
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    total = time.perf_counter() - start
    for obj, name, fn in originals:
        setattr(obj, name, fn)
    running = engine.core.scheduler.num_running
    engine.abort_request([r.external_id for r in list(engine.core.scheduler.running)])
    ms = {k: v / steps * 1e3 for k, v in timings.items()}
    model = ms["forward"] + ms["compute_logits"] + ms["sampler"]
    return {
        "running": running,
        "step_ms": total / steps * 1e3,
        "model_ms": model,
        "schedule_ms": ms["schedule"],
        "input_prep_ms": ms["_execute"] - model,
        "output_ms": ms["update_from_output"] + ms["_emit"] + ms["_process"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-requests", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--kv-gb", type=float, default=4.0)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--skip-hf", action="store_true", help="only our engine (quick iterations)")
    args = ap.parse_args()
    reqs = workload(args.num_requests, args.seed)
    print(f"{len(reqs)} requests, {sum(len(p) for p, _ in reqs)} prompt tokens, "
          f"{sum(m for _, m in reqs)} output tokens; torch threads {torch.get_num_threads()}")

    rows = []
    llm = make_llm(args)
    rows.append(("(a) pagedserve LLM.generate", *run_ours(llm, reqs)))
    print(f"  {rows[-1][0]}: {rows[-1][1] / rows[-1][2]:.0f} tok/s", flush=True)
    overheads = {kind: step_overhead(llm, reqs, kind)
                 for kind in (RequestOutputKind.FINAL_ONLY, RequestOutputKind.DELTA)}
    del llm
    if not args.skip_hf:
        from transformers import AutoModelForCausalLM

        path = materialize_builtin(MODEL)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa").eval()
        rows.append(("(b) HF generate, static batch 32", *run_hf_static(model, reqs)))
        print(f"  {rows[-1][0]}: {rows[-1][1] / rows[-1][2]:.0f} tok/s", flush=True)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="paged|sdpa").eval()
        rows.append(("(c) HF continuous batching paged|sdpa", *run_hf_continuous(model, reqs)))

    ours = rows[0][1] / rows[0][2]
    print()
    print("| system | output tokens | seconds | output tok/s | pagedserve / system |")
    print("|---|---:|---:|---:|---:|")
    for name, tokens, seconds in rows:
        rate = tokens / seconds
        print(f"| {name} | {tokens} | {seconds:.1f} | {rate:.0f} | {ours / rate:.2f}x |")
    print()
    print("| decode step, 200 running | step ms | model (forward+logits+sampler) "
          "| scheduling + input prep (target < 2 ms) | output processing |")
    print("|---|---:|---:|---:|---:|")
    for kind, o in overheads.items():
        print(f"| outputs {kind.value} | {o['step_ms']:.1f} | {o['model_ms']:.1f} | "
              f"{o['schedule_ms']:.2f} + {o['input_prep_ms']:.2f} = {o['schedule_ms'] + o['input_prep_ms']:.2f} | "
              f"{o['output_ms']:.2f} |")


if __name__ == "__main__":
    main()
