"""What the engine returns, with vLLM's names so that users' code carries over."""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np


def reduce_positional(self):
    """Pickle as the constructor's positional arguments. Outputs cross from the engine process every step;
    the default for slotted dataclasses (a state list set back attribute by attribute) loads ~4x slower."""
    return type(self), tuple(getattr(self, name) for name in self.__slots__)


@dataclass(slots=True)
class Logprob:
    logprob: float
    rank: int  # 1 = the most likely token
    decoded_token: str | None = None

    __reduce__ = reduce_positional


# One dict per generated token: token id -> Logprob (the sampled token first, then the top-k ones).
SampleLogprobs = list[dict[int, Logprob]]
# One entry per prompt token; the first is None (nothing predicts it).
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: SampleLogprobs | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error" | None while running
    stop_reason: int | str | None = None  # the stop token id or string, when one ended it

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    __reduce__ = reduce_positional


@dataclass(slots=True, frozen=True)
class StepTiming:
    """One engine step a request took part in (EngineConfig.collect_step_timings): when its model
    execution ran (time.monotonic()), this request's scheduled tokens, the whole batch's shape, and the
    encoder's share of the step where it encoded this request's images."""

    start_time: float
    end_time: float
    num_tokens: int
    batch_size: int
    batch_tokens: int
    encoder_seconds: float = 0.0  # the step's time in the vision encoder, where it encoded this request's images

    __reduce__ = reduce_positional


@dataclass(slots=True)
class RequestMetrics:
    """time.monotonic() timestamps of the engine's process; intervals derive from them."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_generation_tokens: int = 0
    preempted_times: tuple[float, ...] = ()
    # Steps since this request's previous output (not cumulative: a stream carries each step once).
    steps: tuple[StepTiming, ...] = ()

    @property
    def queue_time(self) -> float | None:
        return None if self.first_scheduled_time is None else self.first_scheduled_time - self.arrival_time

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def e2e_latency(self) -> float | None:
        return None if self.finished_time is None else self.finished_time - self.arrival_time

    @property
    def mean_inter_token_latency(self) -> float | None:
        if self.num_generation_tokens < 2 or self.first_token_time is None or self.last_token_time is None:
            return None
        return (self.last_token_time - self.first_token_time) / (self.num_generation_tokens - 1)

    __reduce__ = reduce_positional


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    prompt_logprobs: PromptLogprobs | None = None
    metrics: RequestMetrics | None = None
    error: str | None = None  # set when this request failed on its own (finish_reason "error")
    # Set on a KV producer's final output: where a consumer finds the prompt's KV (engine/kv_transfer).
    kv_transfer_params: dict | None = None

    __reduce__ = reduce_positional


@dataclass(slots=True)
class PoolingOutput:
    """An embedder's vector for one prompt (vLLM's PoolingOutput / EmbeddingOutput)."""

    data: np.ndarray  # float32 [dimensions]

    @property
    def embedding(self) -> list[float]:
        return self.data.tolist()

    __reduce__ = reduce_positional


@dataclass(slots=True)
class PoolingRequestOutput:
    """The one, final output of an embedding request (EngineConfig.task 'embed'); `outputs` is None when it
    failed (`error`) or was aborted."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: PoolingOutput | None
    finished: bool = True
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None
    error: str | None = None

    @property
    def finish_reasons(self) -> list[str]:
        """As a RequestOutput's samples say theirs: "stop" once pooled, "error" or "abort" otherwise."""
        if not self.finished:
            return []
        return ["stop" if self.outputs is not None else "error" if self.error else "abort"]

    __reduce__ = reduce_positional


def merge_deltas(outputs: list[RequestOutput]) -> RequestOutput:
    """Coalesce consecutive delta outputs of one request into one, as if they had come in one step."""
    if len(outputs) == 1:
        return outputs[0]
    merged: dict[int, CompletionOutput] = {}
    for out in outputs:
        for c in out.outputs:
            prev = merged.get(c.index)
            if prev is None:
                merged[c.index] = CompletionOutput(
                    c.index, c.text, list(c.token_ids), c.cumulative_logprob,
                    None if c.logprobs is None else list(c.logprobs), c.finish_reason, c.stop_reason,
                )
                continue
            prev.text += c.text
            prev.token_ids.extend(c.token_ids)
            if c.logprobs is not None:
                prev.logprobs = (prev.logprobs or []) + c.logprobs
            prev.cumulative_logprob = c.cumulative_logprob
            prev.finish_reason, prev.stop_reason = c.finish_reason, c.stop_reason
    last = outputs[-1]
    prompt_logprobs = next((o.prompt_logprobs for o in outputs if o.prompt_logprobs is not None), None)
    metrics = last.metrics
    if metrics is not None and any(o.metrics and o.metrics.steps for o in outputs[:-1]):
        metrics = replace(metrics, steps=tuple(s for o in outputs if o.metrics for s in o.metrics.steps))
    return RequestOutput(
        request_id=last.request_id,
        prompt=last.prompt,
        prompt_token_ids=last.prompt_token_ids,
        outputs=sorted(merged.values(), key=lambda c: c.index),
        finished=last.finished,
        num_cached_tokens=last.num_cached_tokens,
        prompt_logprobs=prompt_logprobs,
        metrics=metrics,
        error=last.error,
        kv_transfer_params=last.kv_transfer_params,
    )
