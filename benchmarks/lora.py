"""Multi-LoRA throughput: many adapters mixed in one batch against the base model alone, and against
serving each adapter merged into its own engine, one after another.

    python benchmarks/lora.py [--num-requests 64] [--num-adapters 8] [--rank 16] [--rounds 3]

Workload (fixed seed, DESIGN.md's "Numbers to beat"): the 56M built-in model in float32, random token prompts
of 32-256 tokens, outputs of 16-128 (ignore_eos, greedy), all requests submitted at once. Adapters: PEFT
folders of rank `--rank` on all seven projections (q, k, v, o, gate, up, down), random weights; request i
uses adapter i mod num_adapters. Systems:
  base         the plain engine (enable_lora off), every request on the base model
  mixed L=8    enable_lora, max_loras=8: every adapter in one batch
  mixed L=4    enable_lora, max_loras=4: adapters wait for slots, slots are evicted and refilled
  merged       per adapter, an engine whose weights are W + scale * B @ A, serving that adapter's requests;
               the engines one after another (engine construction not counted, shown apart)
The timed systems run in alternation for `--rounds` rounds (the machine is shared: compare the ratios of
one run); the table shows each system's median. Target: mixed L=8 >= 0.8x base."""

from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from engine import LLM, LoRARequest, SamplingParams
from engine.models.builtin import materialize_builtin
from engine.models.config import ModelConfig

MODEL = "pagedserve-56m"
PROJECTIONS = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
               "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}


def workload(n: int, seed: int, max_output: int) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [([1] + [rng.randrange(3, 32000) for _ in range(rng.randint(32, 256) - 1)], rng.randint(16, max_output))
            for _ in range(n)]


def write_adapter(folder: Path, cfg: ModelConfig, rank: int, seed: int) -> None:
    """A PEFT adapter folder (the format peft's save_pretrained writes), random weights."""
    h, i = cfg.hidden_size, cfg.intermediate_size
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    shapes = {"q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q),
              "gate_proj": (i, h), "up_proj": (i, h), "down_proj": (h, i)}
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(cfg.num_hidden_layers):
        for module, (out_features, in_features) in shapes.items():
            prefix = f"base_model.model.model.layers.{layer}.{PROJECTIONS[module]}.{module}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, in_features, generator=gen) / in_features**0.5
            tensors[f"{prefix}.lora_B.weight"] = 0.02 * torch.randn(out_features, rank, generator=gen)
    folder.mkdir(parents=True)
    save_file(tensors, folder / "adapter_model.safetensors")
    (folder / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": 2 * rank, "lora_dropout": 0.0,
        "target_modules": sorted(shapes), "bias": "none", "use_rslora": False, "use_dora": False,
    }))


def write_merged(base: Path, adapter: Path, out: Path, weights: dict[str, torch.Tensor]) -> None:
    """The base checkpoint with the adapter merged into each targeted weight (W + scale * B @ A)."""
    config = json.loads((adapter / "adapter_config.json").read_text())
    scale = config["lora_alpha"] / config["r"]
    lora = load_file(adapter / "adapter_model.safetensors")
    merged = dict(weights)
    for key, a in lora.items():
        if ".lora_A." in key:
            name = key.replace("base_model.model.", "").replace(".lora_A.weight", ".weight")
            b = lora[key.replace("lora_A", "lora_B")]
            merged[name] = weights[name] + scale * (b @ a)
    out.mkdir(parents=True)
    save_file(merged, out / "model.safetensors")
    for f in base.iterdir():
        if f.is_file() and not f.name.endswith(".safetensors") and f.name != "model.safetensors.index.json":
            shutil.copy(f, out / f.name)


def timed_generate(llm: LLM, reqs, loras=None) -> tuple[int, float]:
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for _, m in reqs]
    start = time.perf_counter()
    outs = llm.generate([p for p, _ in reqs], params, use_tqdm=False, lora_request=loras)
    elapsed = time.perf_counter() - start
    assert all(len(o.outputs[0].token_ids) == m for o, (_, m) in zip(outs, reqs))
    return sum(m for _, m in reqs), elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--num-adapters", type=int, default=8)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--max-output", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--kv-gb", type=float, default=0.5)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    base = materialize_builtin(MODEL)
    cfg = ModelConfig.from_pretrained(base)
    reqs = workload(args.num_requests, args.seed, args.max_output)
    tmp = Path(tempfile.mkdtemp(prefix="pagedserve-lora-bench-"))
    try:
        adapters = [tmp / f"adapter{k}" for k in range(args.num_adapters)]
        for k, folder in enumerate(adapters):
            write_adapter(folder, cfg, args.rank, seed=k)
        loras = [LoRARequest(f"adapter{k}", k + 1, str(adapters[k])) for k in range(args.num_adapters)]
        per_request = [loras[i % args.num_adapters] for i in range(len(reqs))]
        common = dict(dtype="float32", max_model_len=1024, kv_cache_memory_gb=args.kv_gb, num_threads=args.threads,
                      max_num_seqs=256, enable_prefix_caching=False)
        lora_common = dict(enable_lora=True, max_lora_rank=args.rank, max_cpu_loras=max(args.num_adapters, 8))
        engines = {
            "base": (LLM(MODEL, **common), None),
            "mixed L=8": (LLM(MODEL, max_loras=8, **lora_common, **common), per_request),
            "mixed L=4": (LLM(MODEL, max_loras=4, **lora_common, **common), per_request),
        }
        for llm, loras_of in engines.values():  # warm-up: oneDNN primitives, adapters read into host memory
            timed_generate(llm, reqs[:8], loras_of[:8] if loras_of else None)
        weights = load_file(base / "model.safetensors")
        results: dict[str, list[float]] = {name: [] for name in [*engines, "merged"]}
        slot_loads: dict[str, int] = {}
        build_s = 0.0
        print(f"{len(reqs)} requests, {sum(len(p) for p, _ in reqs)} prompt tokens, {sum(m for _, m in reqs)} output "
              f"tokens, {args.num_adapters} adapters of rank {args.rank}, {args.threads} threads", flush=True)
        for round_ in range(args.rounds):
            names = list(engines)
            for name in names[round_ % len(names):] + names[: round_ % len(names)]:  # alternate who goes first
                llm, loras_of = engines[name]
                before = llm.llm_engine.get_stats().num_lora_slot_loads
                tokens, seconds = timed_generate(llm, reqs, loras_of)
                slot_loads[name] = llm.llm_engine.get_stats().num_lora_slot_loads - before
                results[name].append(tokens / seconds)
                print(f"  round {round_}: {name}: {tokens / seconds:.0f} tok/s", flush=True)
            tokens, seconds = 0, 0.0  # merged: each adapter's requests on its own engine, in turn
            for k, adapter in enumerate(adapters):
                folder = tmp / f"merged{k}"
                t = time.perf_counter()
                write_merged(base, adapter, folder, weights)
                llm = LLM(str(folder), **common)
                timed_generate(llm, reqs[:2])  # warm-up, as the others had
                build_s += time.perf_counter() - t
                mine = [r for i, r in enumerate(reqs) if i % args.num_adapters == k]
                n, s = timed_generate(llm, mine)
                tokens, seconds = tokens + n, seconds + s
                del llm
                shutil.rmtree(folder)
            results["merged"].append(tokens / seconds)
            print(f"  round {round_}: merged: {tokens / seconds:.0f} tok/s", flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    base_rate = statistics.median(results["base"])
    print()
    print("| system | output tok/s (median) | / base | slot loads per run |")
    print("|---|---:|---:|---:|")
    for name, rates in results.items():
        rate = statistics.median(rates)
        loads = slot_loads.get(name, "-")
        print(f"| {name} | {rate:.0f} | {rate / base_rate:.2f}x | {loads} |")
    print(f"\nmerged engines: {build_s / args.rounds:.1f} s per round to write and load {args.num_adapters} merged "
          "checkpoints (not counted above)")
    print(f"target: mixed L=8 >= 0.80x base: "
          f"{'met' if statistics.median(results['mixed L=8']) >= 0.8 * base_rate else 'NOT met'}")


if __name__ == "__main__":
    main()
