"""pagedserve's inference engine: paged KV cache, continuous batching, prefix caching. No Ray here."""

from engine.async_llm import AsyncLLM
from engine.config import EngineConfig
from engine.errors import EngineDeadError, EngineOverloadedError, RequestFailedError
from engine.llm import LLM
from engine.llm_engine import LLMEngine
from engine.lora import LoRARequest
from engine.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from engine.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams
from engine.spec_decode.config import SpeculativeConfig
from engine.stats import EngineStats

__all__ = [
    "LLM",
    "AsyncLLM",
    "LLMEngine",
    "LoRARequest",
    "EngineConfig",
    "SpeculativeConfig",
    "SamplingParams",
    "StructuredOutputsParams",
    "RequestOutputKind",
    "RequestOutput",
    "CompletionOutput",
    "Logprob",
    "RequestMetrics",
    "EngineStats",
    "EngineOverloadedError",
    "EngineDeadError",
    "RequestFailedError",
]
