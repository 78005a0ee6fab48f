"""Mixture of experts on CPU: the built-in pagedserve-56m-moe against dense models of the same active and the
same total parameters, and against Hugging Face `generate` on the same checkpoint.

    python -m benchmarks.moe [--rounds 5] [--num-requests 64] [--skip-hf]

Models, float32, random weights, the same tokenizer and attention (hidden 512, 8 layers, 8 / 4 heads):
  pagedserve-56m-moe   8 experts of intermediate size 704, top-2: ~108M parameters, ~56M active per token
  pagedserve-56m       a dense MLP of 1376: about the same active parameters (a token's 2 x 704 = 1408)
  dense, same total    a dense MLP of 5632 (8 x 704): the MoE model's total parameters (dummy weights)

(1) Decode step time at batch 1, 8 and 32 (benchmarks/parallel.py's decode_step): all three engines live at
    once and are measured in turns, `--rounds` times, medians reported, so that load on the host hits
    them alike. Weights read per step decide CPU decode speed: at batch 1 a token reads 2 of 8 experts
    (close to the same-active model); at batch 32 nearly every expert is read (close to the same-total one).
(2) Output tokens/s on benchmarks/throughput.py's workload (`--num-requests` requests): `LLM.generate` on
    the MoE model against transformers `generate` (static batches of 32, left padding, experts
    implementation `grouped_mm`) on the same checkpoint.
Targets: batch 1 MoE <= 1.3x the same-active model's step; batch 32 <= 1.2x the same-total model's; >= 3x
Hugging Face's throughput."""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
from pathlib import Path

import torch

from benchmarks.parallel import decode_step
from benchmarks.throughput import run_hf_static, run_ours, workload
from engine import LLM
from engine.models.builtin import BUILTIN_MODELS, materialize_builtin
from engine.models.loader import weight_bytes

MOE, SAME_ACTIVE = "pagedserve-56m-moe", "pagedserve-56m"
BATCHES = [1, 8, 32]
QUANT_SCHEMES = ("int8", "int4", "w8a8")  # online quantization of the MoE model, rows beside float32
ENGINE = dict(dtype="float32", max_model_len=1024, kv_cache_memory_gb=0.5, max_num_seqs=256)


def same_total_dense(folder: Path) -> Path:
    """A dense checkpoint folder (config and tokenizer; weights drawn with load_format='dummy') whose MLP has
    all the MoE model's expert parameters: intermediate size num_experts x 704."""
    moe = BUILTIN_MODELS[MOE]
    spec = {**BUILTIN_MODELS[SAME_ACTIVE], "intermediate_size": moe["num_local_experts"] * moe["intermediate_size"]}
    (folder / "config.json").write_text(json.dumps(spec, indent=2))
    source = materialize_builtin(SAME_ACTIVE)
    for f in source.iterdir():
        if f.name not in ("config.json", "model.safetensors"):
            shutil.copy(f, folder / f.name)
    return folder


def params_m(llm: LLM) -> float:
    """Millions of float32 weights held (weight_bytes counts the dense layers' prepacked buffers too)."""
    return weight_bytes(llm.llm_engine.core.executor.driver_worker.model) / 4 / 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5, help="turns of decode-step measurements per model")
    parser.add_argument("--decode-steps", type=int, default=24, help="decode steps per measurement")
    parser.add_argument("--num-requests", type=int, default=64, help="requests of the throughput comparison")
    parser.add_argument("--skip-hf", action="store_true", help="only the decode steps")
    args = parser.parse_args()
    print(f"torch threads {torch.get_num_threads()}", flush=True)

    with tempfile.TemporaryDirectory(prefix="pagedserve-dense-total-") as tmp:
        engines = {
            "pagedserve-56m-moe": LLM(MOE, **ENGINE),
            "pagedserve-56m (same active)": LLM(SAME_ACTIVE, **ENGINE),
            "dense, same total": LLM(str(same_total_dense(Path(tmp))), load_format="dummy", **ENGINE),
            # Online quantization of every projection, experts included (expert by expert through the kernels).
            **{f"pagedserve-56m-moe, {q}": LLM(MOE, quantization=q, **ENGINE) for q in QUANT_SCHEMES},
            # bfloat16 weights and activations: the experts through vdpbf16ps where the CPU has AVX512_BF16.
            "pagedserve-56m-moe, bfloat16": LLM(MOE, **{**ENGINE, "dtype": "bfloat16"}),
        }
        steps: dict[tuple[str, int], list[float]] = {}
        for r in range(args.rounds):
            for batch in BATCHES:
                for name, llm in engines.items():
                    steps.setdefault((name, batch), []).append(decode_step(llm, batch, rounds=args.decode_steps)[0])
            print(f"round {r + 1}/{args.rounds} done", flush=True)
        # Quantized weights are buffers, not parameters: those rows count the float32 model's parameters.
        sizes = {name: params_m(engines["pagedserve-56m-moe" if name.endswith((*QUANT_SCHEMES, "bfloat16")) else name])
                 for name in engines}
        moe_llm = engines.pop("pagedserve-56m-moe")
        del engines

    median = {key: statistics.median(v) for key, v in steps.items()}
    names = list(sizes)
    print(f"\nDecode step (ms, median of {args.rounds} turns of {args.decode_steps} steps), float32 activations "
          "(bfloat16 in its row)\n")
    print("| model | parameters (M) | " + " | ".join(f"batch {b}" for b in BATCHES) + " |")
    print("|---|---:|" + "---:|" * len(BATCHES))
    for name in names:
        print(f"| {name} | {sizes[name]:.0f} | " + " | ".join(f"{median[name, b]:.2f}" for b in BATCHES) + " |")

    def ratios(name: str) -> str:  # the float32 MoE's step over `name`'s, per batch
        return ", ".join(f"batch {b} {median[names[0], b] / median[name, b]:.2f}x" for b in BATCHES)

    for name, target in ((names[1], "<= 1.3x at batch 1"), (names[2], "<= 1.2x at batch 32")):
        print(f"MoE / {name}: {ratios(name)} (target {target})")
    for name in names[3:]:
        print(f"{name} speed-up over float32: {ratios(name)}")

    if args.skip_hf:
        return
    reqs = workload(args.num_requests, seed=0)
    ours_tokens, ours_s = run_ours(moe_llm, reqs)
    moe_llm.shutdown()
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(materialize_builtin(MOE), dtype=torch.float32,
                                                 attn_implementation="sdpa",
                                                 experts_implementation="grouped_mm").eval()
    hf_tokens, hf_s = run_hf_static(model, reqs)
    ours, hf = ours_tokens / ours_s, hf_tokens / hf_s
    print(f"\n{len(reqs)} requests of benchmarks/throughput.py's workload, {MOE}, float32\n")
    print("| system | output tokens | seconds | output tok/s |")
    print("|---|---:|---:|---:|")
    print(f"| pagedserve LLM.generate | {ours_tokens} | {ours_s:.1f} | {ours:.0f} |")
    print(f"| HF generate, static batch 32 (grouped_mm experts) | {hf_tokens} | {hf_s:.1f} | {hf:.0f} |")
    print(f"pagedserve / HF: {ours / hf:.2f}x (target >= 3x)")


if __name__ == "__main__":
    main()
