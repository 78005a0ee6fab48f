"""KV cache groups: the layers that attend alike share a block table and a pool of blocks. A model whose
layers all attend over the full context has one group; one with sliding-window layers (Gemma 3, gpt-oss,
Mistral) has a group per window besides, whose requests hold only the blocks the window still reaches
(vLLM's hybrid allocator idea, at our size: a pool per group rather than one pool shared through equal
page sizes). The primary group, the one whose blocks the prefix router, the KV metrics and the KV connectors
see, is the full-attention layers' where there are any.

A window group's pool never needs more than what every running request's window plus one step's tokens
cover, so it gets that many blocks at most; the rest of the KV budget goes to the primary group."""

from __future__ import annotations

from dataclasses import dataclass

from engine.models.config import ModelConfig


@dataclass(frozen=True)
class KVCacheGroups:
    windows: tuple[int | None, ...]  # each group's window (None: full attention), the primary group's first
    layer_groups: tuple[int, ...]  # each layer's group

    @classmethod
    def of(cls, cfg: ModelConfig) -> KVCacheGroups:
        layer_windows = [cfg.sliding_window_of(i) for i in range(cfg.num_hidden_layers)]
        windows = sorted(set(layer_windows), key=lambda w: (w is not None, w or 0))
        return cls(tuple(windows), tuple(windows.index(w) for w in layer_windows))

    @property
    def has_window_groups(self) -> bool:
        return any(w is not None for w in self.windows)

    def pool_sizes(self, num_blocks: int, block_size: int, max_num_seqs: int,
                   max_num_batched_tokens: int) -> list[int]:
        """Blocks of each group's pool (the null block included) when the primary group has `num_blocks`."""
        return [num_blocks if i == 0 else min(num_blocks, window_pool_ceiling(w, block_size, max_num_seqs,
                                                                                max_num_batched_tokens))
                for i, w in enumerate(self.windows)]

    def primary_blocks(self, budget_bytes: float, bytes_per_block: list[int], block_size: int, max_num_seqs: int,
                       max_num_batched_tokens: int) -> int:
        """The most primary-group blocks a budget holds when each window group takes what pool_sizes gives it
        (`bytes_per_block[g]`: one block of group g over this rank's layers of it)."""
        ceilings = [window_pool_ceiling(w, block_size, max_num_seqs, max_num_batched_tokens)
                    for w in self.windows[1:]]
        windows_bytes = sum(c * b for c, b in zip(ceilings, bytes_per_block[1:]))
        capped = (budget_bytes - windows_bytes) // max(bytes_per_block[0], 1)
        if capped >= max(ceilings, default=0):  # every window group at its ceiling, the rest to the primary
            return int(capped)
        return int(budget_bytes // max(sum(bytes_per_block), 1))  # a small budget: equal pools


    def describe(self, pool_sizes: list[int], cfg: ModelConfig, block_size: int, dtype_bytes: int) -> str:
        """Each group's pool, and the KV memory the window groups save against a pool as large as the
        primary's on every layer (the whole model's: all its KV heads)."""
        layer_block = 2 * cfg.num_key_value_heads * cfg.head_dim * block_size * dtype_bytes  # K and V
        parts, saved = [], 0
        for group, (window, size) in enumerate(zip(self.windows, pool_sizes)):
            layers = self.layer_groups.count(group)
            kind = "full attention" if window is None else f"{window}-token window"
            parts.append(f"{kind} ({layers} layers): {size - 1} blocks")
            saved += (pool_sizes[0] - size) * layers * layer_block
        return f"{'; '.join(parts)}; the windows save {saved / 2**20:.1f} MiB"


def window_pool_ceiling(window: int, block_size: int, max_num_seqs: int, max_num_batched_tokens: int) -> int:
    """The most blocks a window group can hold at once: per running request, the blocks of the window - 1
    tokens before its step's first, and of the step's new tokens (with one more each for where they start and
    end in a block); plus the null block."""
    per_request = -(-(window - 1) // block_size) + 3
    return max_num_seqs * per_request + -(-max_num_batched_tokens // block_size) + 1
