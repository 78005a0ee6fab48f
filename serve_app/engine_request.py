"""EngineRequest: what the ingress sends an engine replica. It is the first argument of every
`LLMServer.generate` call, so the request router sees its block hashes (DESIGN.md, "The request path")."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.lora.request import LoRARequest
from engine.sampling_params import SamplingParams


@dataclass
class EngineRequest:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    block_hashes: list[int]  # engine.core.block_hash.hash_block_chain of the prompt: what routing matches on
    priority: int = 0
    cache_salt: str | None = None
    trace_context: dict[str, str] = field(default_factory=dict)  # W3C traceparent/tracestate carrier
    # Filled by the prefix router in the caller's process: prompt blocks each candidate replica is estimated
    # to hold (the P/D orchestrator's uncached length for the replica Serve picked).
    routed_matched_blocks: dict[str, int] = field(default_factory=dict)
    lora_request: LoRARequest | None = None  # the adapter, from the ingress's registry; its digest is in block_hashes
