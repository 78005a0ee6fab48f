"""EngineCoreOutput: what a step did to one sample, in token ids only (vLLM V1's EngineCoreOutput). The
engine core makes them and the frontend's OutputProcessor turns them into text and RequestOutputs, in the
caller's process: from an engine process they cross a pipe every step, so each carries only what changed
since the sample's previous one."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from engine.outputs import PromptLogprobs, SampleLogprobs, StepTiming, reduce_positional


@dataclass(slots=True)
class EngineCoreOutput:
    request_id: str  # the id the caller knows (the parent's, for one of n samples)
    index: int  # which of the parent's n samples
    new_token_ids: list[int]
    new_logprobs: SampleLogprobs | None = None  # one entry per new token, when the request asked for logprobs
    cumulative_logprob: float = 0.0
    finish_reason: str | None = None  # "stop" (a stop token, EOS or a completed grammar), "length", "abort", "error"
    stop_reason: int | str | None = None  # the stop token id that ended it
    error: str | None = None
    num_cached_tokens: int = 0
    prompt_logprobs: PromptLogprobs | None = None  # once, complete (sample 0 only)
    kv_transfer_params: dict | None = None  # a KV producer's, on its finished output
    # time.monotonic() of the core's process
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    preempted_times: tuple[float, ...] = ()
    steps: tuple[StepTiming, ...] = ()  # steps since the previous output (EngineConfig.collect_step_timings)
    pooled: np.ndarray | None = None  # an embedder's request, on its finished output: the embedding (float32)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    __reduce__ = reduce_positional
