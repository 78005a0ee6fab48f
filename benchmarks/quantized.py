"""Decode throughput of quantized weights: float32 (the prepacked dense path), bfloat16, int8 and int4
(online, weight-only), w8a8 (int8 weights and activations) and w4a8 (int4 weights, int8 activations), side
by side with llama.cpp's f32, q8_0 and q4_0 on the same weights.

    python -m benchmarks.quantized [--models pagedserve-56m pagedserve-600m] [--batches 1 16 64]
                                   [--decode-tokens 64] [--threads 2] [--rounds 2] [--no-llamacpp]

Run it from the repository root with `-m` (so that this checkout's engine is imported). Each batch size
runs B requests of --prompt-len random tokens, greedy, ignore_eos, T + 1 output tokens; decode tokens/s =
B * T / the time from the step where every request has its first token to the last step. Each system
runs --rounds times, interleaved with the others, and its best round counts; ratios are the median of the
ratios round by round, each round running our formats, then llama.cpp's, back to back (on a host whose speed
moves by a fifth between minutes, best against best compared rounds minutes apart). llama.cpp:
`llama-batched-bench -npp P -ntg T -npl B` on GGUF files converted from the same checkpoint, quantized with
`llama-quantize --leave-output-tensor` so that its LM head stays f32 as ours does (S_TG: its decode rate).
llama.cpp is built by benchmarks/peers/llamacpp.py. `python -m benchmarks.peers --formats` runs this after
the served side, in the same run.
`--vllm`: vLLM's CPU backend too (benchmarks/peers/vllm_cpu.py), float32 and bfloat16 on the same checkpoint,
and W8A8 on a compressed-tensors checkpoint of it written by the compressed-tensors package (weights per
channel, activations per token: RedHatAI's format), which both engines load in bfloat16 ("ct w8a8").
vLLM cannot be stepped by hand: per batch size it runs the B requests with one output token (prefill) and
with T + 1, in one process, and its decode rate is B * T / the difference of the two times.

Beside the rates it prints the bytes of weights a decode step reads (all weights but the embedding) and
the speed-up those bytes allow over float32: with an unquantized LM head that ceiling is low on a small
model (the 56M model's 32k x 512 head is two fifths of its float32 bytes). Bytes bound batch 1; at batch
16 a step is bound by arithmetic instead, so it also prints the multiply-adds per second of one layer's
2048 x 1536 layer (600M shape, cache-resident) at 1, 16, 64 and 256 rows for each weight format, bfloat16 both
through our vdpbf16ps kernel (where the CPU has AVX512_BF16) and through oneDNN's bfloat16 matmul: float32's at
256 rows is the most this machine's float32 FMAs give, and so the most any weight-only format (which widens
its weights to float32 and multiplies in float32) can reach; bfloat16 and W8A8 multiply narrower numbers."""

from __future__ import annotations

import argparse
import random
import re
import statistics
import subprocess
import time
from pathlib import Path

import torch

from engine import LLM, RequestOutputKind, SamplingParams
from engine.models.builtin import materialize_builtin
from engine.models.loader import weight_bytes

OURS = {"float32": dict(dtype="float32"), "bfloat16": dict(dtype="bfloat16"),
        "int8": dict(dtype="float32", quantization="int8"), "int4": dict(dtype="float32", quantization="int4"),
        "w8a8": dict(dtype="float32", quantization="w8a8"), "w4a8": dict(dtype="float32", quantization="w4a8")}
LLAMACPP = {"f32": None, "q8_0": "Q8_0", "q4_0": "Q4_0"}


def prompts(batch: int, length: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[1] + [rng.randrange(3, 32000) for _ in range(length - 1)] for _ in range(batch)]


def decode_rate(llm: LLM, batch: int, prompt_len: int, tokens: int, sampling: dict | None = None) -> float:
    """Steps the engine by hand: the clock starts once every request has its first token (prefill done).
    Greedy, unless `sampling` (SamplingParams keywords) says otherwise."""
    engine = llm.llm_engine
    params = SamplingParams(**{"temperature": 0, **(sampling or {})}, max_tokens=tokens + 1, ignore_eos=True,
                            output_kind=RequestOutputKind.DELTA)
    for prompt in prompts(batch, prompt_len):
        engine.add_prepared(engine.prepare_request(prompt, params))
    started: set[str] = set()
    while len(started) < batch:
        started.update(out.request_id for out in engine.step() if out.outputs[0].token_ids)
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    return batch * tokens / (time.perf_counter() - start)


def read_bytes(llm: LLM) -> int:
    """Weight bytes one decode step reads: everything but the embedding table (a lookup)."""
    model = llm.llm_engine.core.executor.driver_worker.model
    embed = model.model.embed_tokens.weight
    return weight_bytes(model) - (0 if model.config.tie_word_embeddings else embed.numel() * embed.element_size())


def bench_ours(model: str, args, peer_round=None) -> tuple[dict, dict]:
    """(name, batch) -> decode tokens/s of every round; name -> weight bytes a step reads. `peer_round(batch)`:
    a peer's {(name, batch): tokens/s}, run in each round right after ours, whose rates join the rounds."""
    blocks_per_request = -(-(args.prompt_len + args.decode_tokens + 2) // 16)
    blocks = max(args.batches) * blocks_per_request + 8
    checkpoints = {name: model for name in OURS if name in args.systems}
    systems = {name: kwargs for name, kwargs in OURS.items() if name in args.systems}
    if args.vllm:  # the W8A8 checkpoint vLLM runs, as we load it
        checkpoints["ct w8a8"], systems["ct w8a8"] = str(w8a8_checkpoint(model)), dict(dtype="bfloat16")
    engines = {name: LLM(checkpoints[name], num_kv_blocks=blocks, max_num_seqs=max(args.batches),
                         max_model_len=16 * blocks_per_request, num_threads=args.threads, **kwargs)
               for name, kwargs in systems.items()}
    for llm in engines.values():  # warm-up: kernels built, first allocations made
        decode_rate(llm, 1, args.prompt_len, 2)
    rounds: dict[tuple[str, int], list[float]] = {}
    for batch in args.batches:
        for _ in range(args.rounds):
            for name, llm in engines.items():  # interleaved: load changes hit every system alike
                rounds.setdefault((name, batch), []).append(decode_rate(llm, batch, args.prompt_len,
                                                                        args.decode_tokens))
            for key, rate in (peer_round(batch) if peer_round else {}).items():
                rounds.setdefault(key, []).append(rate)
    return rounds, {name: read_bytes(llm) for name, llm in engines.items()}


def paired_ratio(rounds: dict[tuple[str, int], list[float]], a: str, b: str, batch: int) -> float | None:
    """a / b as the median of their ratios round by round: each round runs our formats (and llama.cpp's) back to
    back, seconds apart, where best-of-rounds rates may come from rounds minutes apart (this host's memory
    bandwidth moved 30-47 GB/s within an hour, and batch 1 follows it)."""
    if (a, batch) not in rounds or (b, batch) not in rounds:
        return None
    return statistics.median(x / y for x, y in zip(rounds[a, batch], rounds[b, batch]))


VLLM = ("float32", "bfloat16", "ct w8a8")


def w8a8_checkpoint(model: str) -> Path:
    """The built-in `model` as compressed-tensors W8A8, written once into the built-ins' cache."""
    from benchmarks.checkpoints import write_compressed_tensors

    dense = materialize_builtin(model)
    out = dense.with_name(dense.name + "-w8a8-compressed-tensors")
    if not (out / "config.json").is_file():
        write_compressed_tensors(dense, out, 8, "channel", True, activations=True)
    return out


def bench_vllm(model: str, args) -> dict:
    """(name, batch) -> vLLM CPU's decode tokens/s (best of --rounds; see the module docstring)."""
    from benchmarks.peers import vllm_cpu

    runs = [[(prompt, tokens) for prompt in prompts(batch, args.prompt_len)]
            for batch in args.batches for tokens in (1, args.decode_tokens + 1)] * args.rounds
    rates: dict[tuple[str, int], float] = {}
    for name in VLLM:
        path, dtype = (w8a8_checkpoint(model), "bfloat16") if name == "ct w8a8" else (materialize_builtin(model), name)
        results = vllm_cpu.offline_runs(path, runs, dtype=dtype, max_num_seqs=max(args.batches),
                                        max_model_len=args.prompt_len + args.decode_tokens + 16)
        if results[0].error:
            print(f"vLLM CPU, {model} {name}: {results[0].error}")
            continue
        for i in range(0, len(results), 2):
            batch = args.batches[(i // 2) % len(args.batches)]
            decode_s = results[i + 1].seconds - results[i].seconds
            if decode_s > 0:
                rates["vLLM " + name, batch] = max(rates.get(("vLLM " + name, batch), 0.0),
                                                   batch * args.decode_tokens / decode_s)
    return rates


def llamacpp_rounds(model: str, args):
    """llama.cpp's formats of `model` (GGUFs written once), and a function that runs each once at one batch size:
    batch -> {("llama.cpp <format>", batch): decode tokens/s}."""
    from benchmarks.peers import llamacpp

    built = llamacpp.build()
    path = materialize_builtin(model)
    folder = llamacpp.cache_dir() / "models"
    f32 = llamacpp.convert_to_gguf(path, folder / f"{path.name}-f32.gguf", "f32", llama=built)
    ggufs = {}
    for name, qtype in LLAMACPP.items():
        ggufs[name] = f32 if qtype is None else folder / f"{path.name}-{name}-keep-output.gguf"
        if qtype is not None and not ggufs[name].is_file():
            llamacpp.quantize(f32, ggufs[name], qtype, leave_output_tensor=True, llama=built)

    def run(batch: int) -> dict[tuple[str, int], float]:
        rates = {}
        for name, gguf in ggufs.items():
            ctx = batch * (args.prompt_len + args.decode_tokens) + 64
            cmd = [str(built.batched_bench), "-m", str(gguf), "-c", str(ctx), "-b", "2048", "-ub", "512",
                   "-npp", str(args.prompt_len), "-ntg", str(args.decode_tokens), "-npl", str(batch),
                   "-t", str(args.threads)]
            out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
            for row in re.finditer(r"^\|\s*\d+\s*\|\s*\d+\s*\|\s*(\d+)\s*\|(?:[^|]*\|){4}\s*([\d.]+)\s*\|", out, re.M):
                rates[f"llama.cpp {name}", int(row.group(1))] = float(row.group(2))
        return rates

    return run


RATE_ROWS = (1, 16, 64, 256)


def compute_rates(threads: int, n: int = 2048, k: int = 1536, group: int = 128) -> dict[tuple[str, int], float]:
    """GMAC/s of one n x k linear layer per weight format and rows of x (weights cache-resident: arithmetic,
    not memory, is what this measures). Formats are timed in turns, best of 5 rounds each."""
    from ops.cpu.linear import (
        bfloat16_linear,
        bfloat16_panels_preferred,
        instruction_sets,
        onednn_packs,
        pack_weight,
        packed_linear,
        to_unit_panels,
    )
    from ops.cpu.quant_linear import (
        int4_linear,
        int8_linear,
        pack_int4,
        pack_int4_params,
        pack_int8,
        pack_w4a8,
        pack_w8a8,
        w4a8_linear,
        w8a8_linear,
    )

    torch.set_num_threads(threads)
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(n, k, generator=gen)
    packed = pack_weight(w, 16)
    q8, s8 = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8), torch.rand(n, generator=gen) / 100
    q4, s4 = pack_int4(torch.randint(0, 16, (n, k), generator=gen)), torch.rand(n, k // group, generator=gen) / 100
    p4, p8, w8 = pack_int4_params(s4, -8 * s4), pack_int8(q8), pack_w8a8(q8)
    w4, w4_scales = pack_w4a8(torch.randint(-7, 8, (n, k), generator=gen), s4)
    bf16 = w.bfloat16()
    bf16_panels = to_unit_panels(bf16, 2)
    calls = {"float32": lambda x: packed_linear(x, packed, None),
             "int8": lambda x: int8_linear(x, p8, s8, None), "int4": lambda x: int4_linear(x, q4, p4, group, n, None),
             "w8a8": lambda x: w8a8_linear(x, w8, s8, None),
             "w4a8": lambda x: w4a8_linear(x, w4, w4_scales, group, n, None)}
    if onednn_packs(torch.bfloat16):  # its bfloat16 matmul needs AVX512BW or AVX_NE_CONVERT
        onednn = {rows: torch.ops.mkldnn._reorder_linear_weight(bf16, rows) for rows in RATE_ROWS}  # packed per batch
        calls["bfloat16 oneDNN"] = lambda x: torch.ops.mkldnn._linear_pointwise(x, onednn[x.shape[0]], None, "none",
                                                                                [], "")
    if instruction_sets()["avx512_bf16"] or bfloat16_panels_preferred():  # vdpbf16ps, or widened to float32
        calls["bfloat16"] = lambda x: bfloat16_linear(x, bf16_panels, None)
    inputs = {rows: torch.randn(rows, k, generator=gen) for rows in RATE_ROWS}
    best: dict[tuple[str, int], float] = {}
    for _ in range(5):
        for rows, x in inputs.items():
            for name, call in calls.items():
                xx = x.bfloat16() if name.startswith("bfloat16") else x
                call(xx)
                start = time.perf_counter()
                for _ in range(4):
                    call(xx)
                best[name, rows] = min(best.get((name, rows), float("inf")), (time.perf_counter() - start) / 4)
    return {key: key[1] * n * k / seconds / 1e9 for key, seconds in best.items()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["pagedserve-56m", "pagedserve-600m"])
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 16, 64])
    parser.add_argument("--systems", nargs="+", default=list(OURS), choices=list(OURS))
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--no-llamacpp", action="store_true")
    parser.add_argument("--vllm", action="store_true", help="vLLM CPU's float32 and bfloat16 beside ours")
    parser.add_argument("--no-rates", action="store_true", help="skip the one-layer GMAC/s table")
    args = parser.parse_args(argv)

    for model in args.models:
        rounds, nbytes = bench_ours(model, args, None if args.no_llamacpp else llamacpp_rounds(model, args))
        best = {key: max(rates) for key, rates in rounds.items()}  # ours and llama.cpp's
        vllm = bench_vllm(model, args) if args.vllm else {}
        print(f"\n## {model}: decode tokens/s ({args.prompt_len}-token prompts, {args.decode_tokens} decoded, "
              f"{args.threads} threads, best of {args.rounds})\n")
        names = ([n for n in [*OURS, "ct w8a8"] if (n, args.batches[0]) in best]
                 + [f"llama.cpp {n}" for n in LLAMACPP if (f"llama.cpp {n}", args.batches[0]) in best]
                 + [f"vLLM {d}" for d in VLLM if any(key[0] == f"vLLM {d}" for key in vllm)])
        ratios = [("int8/f32", "int8", "float32"), ("int4/f32", "int4", "float32"), ("bf16/f32", "bfloat16", "float32"),
                  ("w8a8/bf16", "w8a8", "bfloat16"), ("f32/llama f32", "float32", "llama.cpp f32"),
                  ("int8/q8_0", "int8", "llama.cpp q8_0"),
                  ("w8a8/q8_0", "w8a8", "llama.cpp q8_0"), ("int4/q4_0", "int4", "llama.cpp q4_0"),
                  ("w4a8/q4_0", "w4a8", "llama.cpp q4_0"), ("f32/vLLM f32", "float32", "vLLM float32"),
                  ("bf16/vLLM bf16", "bfloat16", "vLLM bfloat16"), ("w8a8/vLLM w8a8", "ct w8a8", "vLLM ct w8a8")]
        ratios = [r for r in ratios if r[1] in names and r[2] in names]
        print("| batch | " + " | ".join(names) + " | " + " | ".join(r[0] for r in ratios) + " |")
        print("|---:|" + "---:|" * (len(names) + len(ratios)))
        for batch in args.batches:
            row = ({n: rate for (n, b), rate in best.items() if b == batch}
                   | {name: rate for (name, b), rate in vllm.items() if b == batch})
            cells = [f"{row[n]:.1f}" if row.get(n) else "-" for n in names]
            for _, a, b in ratios:  # paired round by round, but against vLLM (its runs are not interleaved)
                ratio = (paired_ratio(rounds, a, b, batch) if not b.startswith("vLLM")
                         else row[a] / row[b] if row.get(a) and row.get(b) else None)
                cells.append(f"{ratio:.2f}x" if ratio else "-")
            print(f"| {batch} | " + " | ".join(cells) + " |")
        print("\n(rates: the best round; ratios: the median over rounds of each round's ratio, llama.cpp run in each "
              "round right after ours; to vLLM: best round against best round)")
        if "float32" in nbytes:
            print("\nweight bytes read per decode step, and the speed-up over float32 those bytes allow:")
            for name, n in nbytes.items():
                print(f"  {name:9s} {n / 2**20:9.1f} MiB   ceiling {nbytes['float32'] / n:.2f}x")

    if args.no_rates:
        return
    rates = compute_rates(args.threads)
    names = [name for name in ("float32", "bfloat16", "bfloat16 oneDNN", "int8", "int4", "w8a8", "w4a8")
             if (name, RATE_ROWS[0]) in rates]
    print(f"\nmultiply-adds per second, one 2048 x 1536 layer (cache-resident), {args.threads} threads (GMAC/s):\n")
    print("| rows | " + " | ".join(names) + " | bfloat16/oneDNN | w8a8/bfloat16 |")
    print("|---:|" + "---:|" * (len(names) + 2))
    for rows in RATE_ROWS:
        row = {name: rates[name, rows] for name in names}
        ratios = [row[a] / row[b] if a in row and b in row else None
                  for a, b in (("bfloat16", "bfloat16 oneDNN"), ("w8a8", "bfloat16"))]
        print(f"| {rows} | " + " | ".join(f"{row[name]:.1f}" for name in names) + " | "
              + " | ".join(f"{r:.2f}x" if r else "-" for r in ratios) + " |")
    peak = rates["float32", 256]
    print(f"\nfloat32 at 256 rows, {peak:.1f} GMAC/s, is the machine's float32 FMA throughput: a batch-16 step "
          f"bound by arithmetic allows a weight-only format at most {peak / rates['float32', 16]:.2f}x float32 on its "
          "linear layers; bfloat16 (vdpbf16ps) and w8a8 (vpdpbusd) multiply 2 and 4 numbers per float32 lane")


if __name__ == "__main__":
    main()
