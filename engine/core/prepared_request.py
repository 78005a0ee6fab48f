"""PreparedRequest: a request validated, tokenized and hashed once, by whoever received it."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.lora.request import LoRARequest
from engine.multimodal.inputs import MultiModalInput
from engine.pooling.params import PoolingParams
from engine.sampling_params import SamplingParams


@dataclass  # not frozen: the prefix router notes routed_matched_blocks on it
class PreparedRequest:
    """A validated, tokenized request: the one type that crosses from whoever prepared it (an ingress,
    `LLM`, `AsyncLLM`) through an engine replica to the engine core, never prepared again on the way. It is
    the first argument of every `LLMServer.generate` call, so Serve's request router reads its block hashes."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float  # time.monotonic() of the process that holds it (an engine replica restamps it)
    priority: int = 0
    cache_salt: str | None = None
    kv_transfer_params: dict | None = None  # engine/kv_transfer: produce KV for, or load it from, another engine
    lora_request: LoRARequest | None = None
    # engine/core/block_hash.py's chain of the prompt's full blocks under this cache_salt and the adapter of
    # digest `lora_digest`: what routers match on and the prefix cache keys by. The core recomputes them only
    # for an adapter whose digest it finds different (or when they are missing).
    block_hashes: list[int] | None = None
    lora_digest: str | None = None
    trace_context: dict[str, str] = field(default_factory=dict)  # W3C traceparent/tracestate carrier
    mm_inputs: list[MultiModalInput] = field(default_factory=list)  # the prompt's images, by offset
    # Filled by the prefix router in the caller's process: prompt blocks each candidate replica is estimated
    # to hold (the P/D orchestrator's uncached length for the replica Serve picked).
    routed_matched_blocks: dict[str, int] = field(default_factory=dict)
    # An embedding request (EngineConfig.task 'embed'): it pools its prompt; its sampling_params are
    # POOLING_SAMPLING_PARAMS, which only the engine's per-request bookkeeping reads.
    pooling_params: PoolingParams | None = None

    @property
    def is_pooling(self) -> bool:
        return self.pooling_params is not None
