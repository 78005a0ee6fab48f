"""LLMEngine: requests in, one scheduled step at a time, RequestOutputs out; vLLM's LLMEngine shape. It
prepares requests (InputProcessor), steps the engine core (engine/core/engine_core.py: token ids only) in
this process, and makes text and outputs (OutputProcessor), telling the core which samples a stop string
ended. Synchronous; `LLM` drives it for offline batches. (AsyncLLM pairs the same two processors with a
core on a thread or in a process of its own.)"""

from __future__ import annotations

from collections.abc import Iterable

from engine.config import EngineConfig
from engine.core.core_output import EngineCoreOutput
from engine.core.engine_core import EngineCore
from engine.core.prepared_request import PreparedRequest
from engine.executor import Rendezvous
from engine.frontend.input_processor import InputProcessor, PreparesRequests
from engine.frontend.output_processor import OutputProcessor
from engine.lora.request import LoRARequest
from engine.model_spec import ModelSpec
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from engine.stats import EngineStats
from engine.tokenizer import tokenizer_for


class LLMEngine(PreparesRequests):
    """Not thread-safe: one thread drives it (LLM's caller); other threads
    may only call `prepare_request`, `tokenize` and `apply_chat_template`."""

    def __init__(self, config: EngineConfig, rendezvous: Rendezvous | None = None) -> None:
        """`rendezvous`: workers of a multi-rank engine that a launcher already started; without it a
        multi-rank engine spawns its own (`mp`)."""
        if config.data_parallel_size > 1:
            raise ValueError("data_parallel_size: LLMEngine steps one engine on the caller's thread; DP ranks step in "
                             "lockstep in processes of their own: use LLM, which starts them "
                             "(engine/frontend/data_parallel.py)")
        self.config = config
        spec = ModelSpec.resolve(config)
        self.model_config = spec.model_config
        self.max_model_len = spec.max_model_len
        self.tokenizer = tokenizer_for(config, spec.path)
        self.input_processor = InputProcessor(config, self.model_config, self.tokenizer, self.max_model_len,
                                              spec.path)
        self.output_processor = OutputProcessor(self.tokenizer)
        self.core = EngineCore(config, spec, self.tokenizer, rendezvous)

    def add_prepared(self, prepared: PreparedRequest) -> None:
        """Enqueue a prepared request; engine-thread only."""
        self.core.add_request(prepared)
        self.output_processor.add_request(prepared)

    def add_request(self, prompt: str | list[int], sampling_params: SamplingParams | None = None, **kwargs) -> str:
        """Validate and enqueue a request; returns its id. The engine state is untouched on error."""
        prepared = self.prepare_request(prompt, sampling_params, **kwargs)
        self.add_prepared(prepared)
        return prepared.request_id

    def abort_request(self, request_ids: str | Iterable[str]) -> list[RequestOutput]:
        """Abort requests by the ids callers know; returns their final outputs. Unknown ids are ignored."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        return self._process(self.core.abort(ids))

    def step(self) -> list[RequestOutput]:
        """Run one scheduled step; returns outputs for the requests it advanced (per their output_kind)."""
        return self._process(self.core.step())

    def _process(self, core_outputs: list[EngineCoreOutput]) -> list[RequestOutput]:
        outputs, stopped = self.output_processor.process(core_outputs)
        self.core.stop(stopped)
        return outputs

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests()

    @property
    def num_unfinished_requests(self) -> int:
        return self.core.num_unfinished_requests

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Read an adapter into host memory ahead of its requests (vLLM's add_lora); ValueError if it is bad."""
        return self.core.add_lora(lora_request)

    def remove_lora(self, lora_int_id: int) -> bool:
        """Forget an adapter: a later request with this id reads it from disk again."""
        return self.core.remove_lora(lora_int_id)

    def list_loras(self) -> set[int]:
        return self.core.list_loras()

    def release_kv(self, request_id: str) -> None:
        self.core.release_kv(request_id)

    def poll_kv_leases(self) -> int:
        return self.core.poll_kv_leases()

    def check_health(self) -> str | None:
        return self.core.check_health()

    def shutdown(self) -> None:
        self.core.shutdown()

    def cache_summary(self, max_blocks: int = 65536) -> bytes:
        return self.core.cache_summary(max_blocks)

    @property
    def cache_version(self) -> int:
        return self.core.cache_version

    def get_stats(self) -> EngineStats:
        return self.core.get_stats()
