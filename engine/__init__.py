"""pagedserve's inference engine: paged KV cache, continuous batching, prefix caching. No Ray here.

The names below load on first use (PEP 562): a process that needs only part of the engine, such as an
ingress replica that tokenizes, does not import torch and the whole engine with `import engine`."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

# public name -> the module that defines it
_EXPORTS = {
    "LLM": "engine.frontend.llm",
    "AsyncLLM": "engine.frontend.async_llm",
    "LLMEngine": "engine.frontend.llm_engine",
    "LoRARequest": "engine.lora.request",
    "EngineConfig": "engine.config",
    "SpeculativeConfig": "engine.spec_decode.config",
    "SamplingParams": "engine.sampling_params",
    "StructuredOutputsParams": "engine.sampling_params",
    "RequestOutputKind": "engine.sampling_params",
    "RequestOutput": "engine.outputs",
    "CompletionOutput": "engine.outputs",
    "Logprob": "engine.outputs",
    "RequestMetrics": "engine.outputs",
    "PoolingParams": "engine.pooling.params",
    "PoolingRequestOutput": "engine.outputs",
    "EngineStats": "engine.stats",
    "EngineOverloadedError": "engine.errors",
    "EngineDeadError": "engine.errors",
    "RequestFailedError": "engine.errors",
}
__all__ = list(_EXPORTS)

if TYPE_CHECKING:  # for type checkers and IDEs; `as` marks each a re-export
    from engine.config import EngineConfig as EngineConfig
    from engine.errors import EngineDeadError as EngineDeadError
    from engine.errors import EngineOverloadedError as EngineOverloadedError
    from engine.errors import RequestFailedError as RequestFailedError
    from engine.frontend.async_llm import AsyncLLM as AsyncLLM
    from engine.frontend.llm import LLM as LLM
    from engine.frontend.llm_engine import LLMEngine as LLMEngine
    from engine.lora.request import LoRARequest as LoRARequest
    from engine.outputs import CompletionOutput as CompletionOutput
    from engine.outputs import Logprob as Logprob
    from engine.outputs import PoolingRequestOutput as PoolingRequestOutput
    from engine.outputs import RequestMetrics as RequestMetrics
    from engine.outputs import RequestOutput as RequestOutput
    from engine.pooling.params import PoolingParams as PoolingParams
    from engine.sampling_params import RequestOutputKind as RequestOutputKind
    from engine.sampling_params import SamplingParams as SamplingParams
    from engine.sampling_params import StructuredOutputsParams as StructuredOutputsParams
    from engine.spec_decode.config import SpeculativeConfig as SpeculativeConfig
    from engine.stats import EngineStats as EngineStats


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value  # once
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
