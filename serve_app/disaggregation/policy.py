"""The disaggregated prefill/decode (P/D) decision and the KV-transfer arithmetic, as a pure core: no Ray
here. The decode deployment (the orchestrator, as in Ray Serve LLM 2.60's decode-as-orchestrator) and the
cluster simulator (benchmarks/cluster_sim/pd.py) call it unchanged.

Per request, the prefix router first picks a prefill replica and estimates how much of the prompt that
replica already caches. What is left, the uncached prompt, is what disaggregation would move off the
decode replica. Below `min_uncached_prompt_tokens` it is not worth a second hop and a KV transfer: the
request skips the prefill pool and is prefilled where it is decoded, in the decode replica's token budget
(reference/scale_out.md B8 expects nothing from P/D for short prompts; llm-d's selective P/D uses
such a threshold).

The threshold can be derived rather than guessed (`itl_safe_prompt_tokens`): the cost of prefilling a
prompt on a decode replica is the step it stretches for every stream decoding there; a prompt that fits
in one step next to a full decode batch without that step exceeding the ITL target costs them nothing
that matters, and one that does not is exactly what the prefill pool is for."""

from __future__ import annotations

import math
from dataclasses import dataclass


def should_disaggregate(uncached_prompt_tokens: int, min_uncached_prompt_tokens: int) -> bool:
    """Prefill on the prefill pool (then move the KV), or locally on the decode replica."""
    return uncached_prompt_tokens >= min_uncached_prompt_tokens


def itl_safe_prompt_tokens(itl_target_s: float, step_s: float, prefill_token_s: float, decode_request_s: float,
                           max_decode_batch: int) -> int:
    """A principled min_uncached_prompt_tokens, from the decode replica's step cost (step = step_s +
    prefill_token_s x prefill tokens + decode_request_s x decoding requests, as profiled or fitted) and the
    ITL target: one more than the longest prompt whose prefill fits in one step next to `max_decode_batch`
    decoding requests (max_num_seqs: the worst case) without the step exceeding the target. Prompts below
    it cannot stretch a stream's inter-token gap past the target; 0 (disaggregate everything) when even a
    decode-only step at a full batch misses it. The link does not enter this lower bound: a transfer costs
    the decode replica no step time. What it costs is TTFT, growing with the prompt, so a slow link argues
    against disaggregating the longest prompts, not the short ones (benchmarks/results/simulate_pd.md)."""
    slack = itl_target_s - step_s - decode_request_s * max_decode_batch
    return math.floor(slack / prefill_token_s + 1e-9) + 1 if slack >= 0 else 0


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype_bytes: int, tp: int = 1) -> int:
    """Keys and values of every layer for one token, per tensor-parallel rank."""
    return 2 * num_layers * (num_kv_heads // tp) * head_dim * dtype_bytes


@dataclass(frozen=True)
class KVLink:
    """The network between a prefill and a decode replica: each replica's NIC, full duplex."""

    bandwidth_gbit_s: float  # per NIC, each direction
    latency_s: float = 0.002  # per transfer: the prefill answer's hop back and the pull's setup

    def wire_time_s(self, num_bytes: float) -> float:
        """How long the bytes occupy the link."""
        return num_bytes * 8 / (self.bandwidth_gbit_s * 1e9)

    def transfer_time_s(self, tokens: int, bytes_per_token: int) -> float:
        """An uncontended transfer of `tokens` tokens' KV, from the prefill's answer to usable KV."""
        return self.wire_time_s(tokens * bytes_per_token) + self.latency_s
