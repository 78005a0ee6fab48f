"""EngineStats: one immutable snapshot of the engine's load and counters. The engine thread publishes a
new one after every step; readers on other threads just read the reference (no lock)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class EngineStats:
    kv_cache_usage: float  # fraction of KV blocks referenced by requests, 0..1
    num_running: int
    num_waiting: int
    num_kv_blocks: int
    block_size: int
    # Counters since start.
    num_preemptions: int = 0
    prefix_cache_queries: int = 0  # tokens
    prefix_cache_hits: int = 0  # tokens
    prompt_tokens: int = 0
    generation_tokens: int = 0
    num_requests_finished: int = 0
    num_steps: int = 0

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0
