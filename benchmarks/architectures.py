"""Model families' KV memory: what the sliding-window KV cache manager (engine/core/kv_cache_groups.py)
holds for one long request, against holding the whole context on every layer.

    python -m benchmarks.architectures [--block-size 16]

For each shape (the released configs' layer counts, KV heads, head dims and windows; no weights needed) and
context (8k and 32k tokens), a request of that length is prefilled in chunks of 2048 tokens and then decodes
16 tokens through KV cache managers built the way EngineCore builds them; the table gives the blocks it
holds in each group at the end, in bytes (bfloat16), against one pool on every layer, and how many such
requests a 16 GiB KV budget then holds. The blocks are counted from the managers, not from a formula.

Not yet here (issue 35): gpt-oss (not served yet), DeepSeek's latent cache and decode times, and throughput
against vLLM's CPU backend."""

from __future__ import annotations

import argparse

from engine.core.block_pool import BlockPool
from engine.core.kv_cache_groups import KVCacheGroups
from engine.core.kv_cache_manager import KVCacheManager
from engine.core.request import Request
from engine.models.config import ModelConfig
from engine.sampling_params import SamplingParams

CHUNK, DECODE, BUDGET_GIB, DTYPE_BYTES = 2048, 16, 16, 2
# The released configs' attention shapes (layers, KV heads, head dim, window, which layers slide).
SHAPES = {
    "Gemma 3 4B": dict(architectures=["Gemma3ForCausalLM"], num_hidden_layers=34, num_attention_heads=8,
                       num_key_value_heads=4, head_dim=256, sliding_window=1024, sliding_window_pattern=6),
    "Gemma 3 27B": dict(architectures=["Gemma3ForCausalLM"], num_hidden_layers=62, num_attention_heads=32,
                        num_key_value_heads=16, head_dim=128, sliding_window=1024, sliding_window_pattern=6),
}


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--block-size", type=int, default=16)
    bs = parser.parse_args().block_size
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


if __name__ == "__main__":
    main()
