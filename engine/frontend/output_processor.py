"""OutputProcessor: the frontend's half of a request, in the caller's process (vLLM V1's shape). It keeps a
mirror of each sample from the core's per-step EngineCoreOutputs (token ids only), makes the text, applies
stop strings, gathers the n samples of a request, and shapes each output as a delta, a cumulative view or a
final result (SamplingParams.output_kind). A stop string ends a sample here; `process` returns those still
running in the core, for the caller to stop there (EngineCore.stop). Tokens the core made past a stop
string are dropped, from the text, the token ids and the usage alike. One thread calls it."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from transformers import PreTrainedTokenizerBase

from engine.core.core_output import EngineCoreOutput
from engine.core.prepared_request import PreparedRequest
from engine.frontend.detokenizer import IncrementalDetokenizer, text_token_ids
from engine.outputs import (
    CompletionOutput,
    PoolingOutput,
    PoolingRequestOutput,
    PromptLogprobs,
    RequestMetrics,
    RequestOutput,
    SampleLogprobs,
    StepTiming,
)
from engine.sampling_params import RequestOutputKind, SamplingParams


@dataclass
class _Sample:
    index: int
    detokenizer: IncrementalDetokenizer | None  # None when the caller wants token ids only
    incremental: bool  # detokenize every step, or once when the sample finishes
    token_ids: list[int] = field(default_factory=list)
    logprobs: SampleLogprobs | None = None
    cumulative_logprob: float = 0.0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    error: str | None = None
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    preempted_times: tuple[float, ...] = ()
    steps: list[StepTiming] = field(default_factory=list)  # not yet sent in an output
    num_detokenized: int = 0
    num_sent_tokens: int = 0
    num_sent_logprobs: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def update(self, out: EngineCoreOutput) -> None:
        self.token_ids.extend(out.new_token_ids)
        if out.new_logprobs is not None and self.logprobs is not None:
            self.logprobs.extend(out.new_logprobs)
        self.cumulative_logprob = out.cumulative_logprob
        self.finish_reason, self.stop_reason, self.error = out.finish_reason, out.stop_reason, out.error
        self.first_scheduled_time, self.first_token_time = out.first_scheduled_time, out.first_token_time
        self.last_token_time, self.finished_time = out.last_token_time, out.finished_time
        self.preempted_times = out.preempted_times
        self.steps.extend(out.steps)

    def drop_tokens_after(self, keep: int) -> None:
        """Cut the output after its first `keep` tokens (a stop string ended it there)."""
        if self.logprobs is not None:
            for token, logprobs in zip(self.token_ids[keep:], self.logprobs[keep:]):
                self.cumulative_logprob -= logprobs[token].logprob
            del self.logprobs[keep:]
        del self.token_ids[keep:]


@dataclass
class _ParentState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    samples: list[_Sample]
    num_cached_tokens: int = 0
    prompt_logprobs: PromptLogprobs | None = None
    prompt_logprobs_sent: bool = False
    kv_transfer_params: dict | None = None
    pooling: bool = False  # an embedding request: one PoolingRequestOutput, when it finishes
    pooled: PoolingOutput | None = None

    @property
    def finished(self) -> bool:
        samples = self.samples
        return samples[0].finish_reason is not None if len(samples) == 1 else all(s.finished for s in samples)


class OutputProcessor:
    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer = tokenizer
        self._parents: dict[str, _ParentState] = {}

    def add_request(self, prepared: PreparedRequest) -> None:
        params = prepared.sampling_params
        # Offline results without stop strings are decoded once at the end; everything else per step.
        incremental = params.output_kind is not RequestOutputKind.FINAL_ONLY or bool(params.stop)
        samples = [
            _Sample(
                i,
                IncrementalDetokenizer(
                    self.tokenizer, prepared.prompt_token_ids, params.skip_special_tokens, params.stop,
                    params.include_stop_str_in_output,
                ) if params.detokenize else None,
                incremental,
                logprobs=[] if params.logprobs is not None else None,
            )
            for i in range(params.n)
        ]
        self._parents[prepared.request_id] = _ParentState(
            prepared.request_id, prepared.prompt, prepared.prompt_token_ids, params, prepared.arrival_time, samples,
            pooling=prepared.is_pooling,
        )

    def discard(self, request_id: str) -> None:
        """Forget a request the core refused."""
        self._parents.pop(request_id, None)

    @property
    def num_requests(self) -> int:
        return len(self._parents)

    def process(self, core_outputs: list[EngineCoreOutput]) -> tuple[list[RequestOutput], list[tuple[str, int]]]:
        """A step's outputs: one RequestOutput per request it touched (none for an unfinished FINAL_ONLY),
        and the (request id, index) of the samples a stop string ended while the core still runs them."""
        touched: dict[str, list[int]] = {}
        stopped = []
        for out in core_outputs:
            state = self._parents.get(out.request_id)
            if state is None:
                continue
            sample = state.samples[out.index]
            if sample.finished:
                continue  # ended here by a stop string before the core heard of it
            sample.update(out)
            if out.index == 0:
                state.num_cached_tokens = out.num_cached_tokens
                if out.prompt_logprobs is not None:
                    state.prompt_logprobs = out.prompt_logprobs
            if out.kv_transfer_params is not None:
                state.kv_transfer_params = out.kv_transfer_params
            if out.pooled is not None:
                state.pooled = PoolingOutput(out.pooled)
            if self._detokenize(state.params, sample):
                stopped.append((out.request_id, out.index))
            touched.setdefault(out.request_id, []).append(out.index)
        outputs = []
        for request_id, indices in touched.items():
            state = self._parents[request_id]
            finished, kind, samples = state.finished, state.params.output_kind, state.samples
            if kind is RequestOutputKind.FINAL_ONLY and not finished:
                continue
            if len(samples) > 1 and kind is RequestOutputKind.DELTA:
                samples = [samples[i] for i in sorted(set(indices))]
            outputs.append(self._make_output(state, samples, finished))
            if finished:
                del self._parents[request_id]
        return outputs, stopped

    def _detokenize(self, params: SamplingParams, sample: _Sample) -> bool:
        """Make the text of what `sample` gained; True when a stop string ended it while the core runs it."""
        if sample.detokenizer is None or not (sample.incremental or sample.finished):
            return False
        first = sample.num_detokenized
        new = text_token_ids(sample.token_ids[first:], sample.finish_reason == "stop",
                             params.include_stop_str_in_output)
        sample.num_detokenized = len(sample.token_ids)
        stop = sample.detokenizer.update(new, check_stop=len(sample.token_ids) >= params.min_tokens,
                                         final=sample.finished)
        if stop is None:
            return False
        # Speculative decoding (or a step the core ran before hearing of the stop) may have appended tokens
        # after the one completing the stop string.
        if sample.detokenizer.num_tokens_to_stop is not None:
            sample.drop_tokens_after(first + sample.detokenizer.num_tokens_to_stop)
            sample.num_detokenized = len(sample.token_ids)
        sample.stop_reason = stop
        if sample.finish_reason == "length":  # hit on its last token: the stop wins
            sample.finish_reason = "stop"
            return False
        if sample.finished:
            return False
        sample.finish_reason, sample.finished_time = "stop", time.monotonic()
        return True

    def _make_output(self, state: _ParentState, samples: list[_Sample],
                     finished: bool) -> RequestOutput | PoolingRequestOutput:
        error = next((s.error for s in state.samples if s.error), None)
        if state.pooling:
            return PoolingRequestOutput(state.request_id, state.prompt_token_ids, state.pooled, finished,
                                        state.num_cached_tokens, _metrics(state, finished), error)
        prompt_logprobs = None
        if state.prompt_logprobs is not None:
            if state.params.output_kind is not RequestOutputKind.DELTA or not state.prompt_logprobs_sent:
                prompt_logprobs = state.prompt_logprobs
                state.prompt_logprobs_sent = True
        return RequestOutput(
            request_id=state.request_id,
            prompt=state.prompt,
            prompt_token_ids=state.prompt_token_ids,
            outputs=[_completion(s, state.params.output_kind) for s in samples],
            finished=finished,
            num_cached_tokens=state.num_cached_tokens,
            prompt_logprobs=prompt_logprobs,
            metrics=_metrics(state, finished),
            error=error,
            kv_transfer_params=state.kv_transfer_params if finished else None,
        )


def _completion(sample: _Sample, kind: RequestOutputKind) -> CompletionOutput:
    finished = sample.finished
    if kind is RequestOutputKind.DELTA:
        token_ids = sample.token_ids[sample.num_sent_tokens :]
        logprobs = None if sample.logprobs is None else sample.logprobs[sample.num_sent_logprobs :]
    else:
        token_ids, logprobs = list(sample.token_ids), sample.logprobs
    text = ""
    if sample.detokenizer is not None:
        delta = sample.detokenizer.get_delta(finished)
        text = delta if kind is RequestOutputKind.DELTA else sample.detokenizer.sent_text
    sample.num_sent_tokens = len(sample.token_ids)
    sample.num_sent_logprobs = len(sample.logprobs or ())
    return CompletionOutput(
        index=sample.index,
        text=text,
        token_ids=token_ids,
        cumulative_logprob=sample.cumulative_logprob if sample.logprobs is not None else None,
        logprobs=logprobs,
        finish_reason=sample.finish_reason,
        stop_reason=sample.stop_reason if finished else None,
    )


def _metrics(state: _ParentState, finished: bool) -> RequestMetrics:
    samples = state.samples
    if len(samples) == 1:  # the common case, on the per-step path of every stream
        s = samples[0]
        return RequestMetrics(
            state.arrival_time, s.first_scheduled_time, s.first_token_time, s.last_token_time,
            s.finished_time if finished else None, len(s.token_ids), s.preempted_times, _take_steps(samples),
        )

    def earliest(values):
        values = [v for v in values if v is not None]
        return min(values) if values else None

    last_tokens = [s.last_token_time for s in samples if s.last_token_time is not None]
    return RequestMetrics(
        arrival_time=state.arrival_time,
        first_scheduled_time=earliest(s.first_scheduled_time for s in samples),
        first_token_time=earliest(s.first_token_time for s in samples),
        last_token_time=max(last_tokens) if last_tokens else None,
        finished_time=max(s.finished_time or 0.0 for s in samples) if finished else None,
        num_generation_tokens=sum(len(s.token_ids) for s in samples),
        preempted_times=tuple(sorted(t for s in samples for t in s.preempted_times)),
        steps=_take_steps(samples),
    )


def _take_steps(samples: list[_Sample]) -> tuple[StepTiming, ...]:
    if not any(s.steps for s in samples):
        return ()
    # n > 1: the samples of one step share its timing; one entry per step
    steps = tuple(sorted({t.start_time: t for s in samples for t in s.steps}.values(), key=lambda t: t.start_time))
    for s in samples:
        s.steps.clear()
    return steps
