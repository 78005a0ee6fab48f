"""Turns engine-side request progress into RequestOutputs: detokenizes, applies stop strings, gathers
the n samples of a parent request, and shapes each output as a delta, a cumulative view or a final
result (SamplingParams.output_kind). Two phases per step: `detokenize` finds the requests a stop string
ends (the engine then finishes them), `make_outputs` builds what callers see."""

from __future__ import annotations

from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase

from engine.core.request import Request, RequestStatus
from engine.frontend.detokenizer import IncrementalDetokenizer, text_token_ids
from engine.outputs import CompletionOutput, RequestMetrics, RequestOutput, StepTiming
from engine.sampling_params import RequestOutputKind


@dataclass
class _Sample:
    request: Request
    detokenizer: IncrementalDetokenizer | None  # None when the caller wants token ids only
    incremental: bool  # detokenize every step, or once when the request finishes
    num_detokenized: int = 0
    num_sent_tokens: int = 0
    num_sent_logprobs: int = 0


@dataclass
class _ParentState:
    request_id: str
    prompt: str | None
    samples: list[_Sample]
    kind: RequestOutputKind
    prompt_logprobs_sent: bool = False


class OutputProcessor:
    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer = tokenizer
        self._parents: dict[str, _ParentState] = {}

    def add_request(self, request_id: str, prompt: str | None, children: list[Request]) -> None:
        params = children[0].sampling_params
        # Offline results without stop strings are decoded once at the end; everything else per step.
        incremental = params.output_kind is not RequestOutputKind.FINAL_ONLY or bool(params.stop)
        samples = [
            _Sample(
                c,
                IncrementalDetokenizer(
                    self.tokenizer, c.prompt_token_ids, params.skip_special_tokens, params.stop,
                    params.include_stop_str_in_output,
                ) if params.detokenize else None,
                incremental,
            )
            for c in children
        ]
        self._parents[request_id] = _ParentState(request_id, prompt, samples, params.output_kind)

    def detokenize(self, updated: list[Request]) -> list[Request]:
        """Detokenize what `updated` generated this step; returns the running ones a stop string ended."""
        stopped = []
        for request in updated:
            state = self._parents.get(request.external_id)
            if state is None:
                continue
            sample = state.samples[request.index]
            if sample.detokenizer is None or not (sample.incremental or request.is_finished):
                continue
            params = request.sampling_params
            first = sample.num_detokenized
            new = text_token_ids(request.output_token_ids[first:], request.status is RequestStatus.FINISHED_STOPPED,
                                 params.include_stop_str_in_output)
            sample.num_detokenized = request.num_output_tokens
            stop = sample.detokenizer.update(
                new, check_stop=request.num_output_tokens >= params.min_tokens, final=request.is_finished
            )
            if stop is not None:
                # Speculative decoding may have appended tokens after the one completing the stop string.
                if sample.detokenizer.num_tokens_to_stop is not None:
                    _drop_output_tokens(request, first + sample.detokenizer.num_tokens_to_stop)
                    sample.num_detokenized = request.num_output_tokens
                request.stop_reason = stop
                if request.status is RequestStatus.FINISHED_LENGTH:  # hit on its last token: the stop wins
                    request.status = RequestStatus.FINISHED_STOPPED
                elif not request.is_finished:
                    stopped.append(request)
        return stopped

    def make_outputs(self, updated: list[Request]) -> list[RequestOutput]:
        """One RequestOutput per parent request touched this step (none for an unfinished FINAL_ONLY)."""
        touched: dict[str, list[int]] = {}
        for request in updated:
            if request.external_id in self._parents:
                touched.setdefault(request.external_id, []).append(request.index)
        outputs = []
        for request_id, indices in touched.items():
            state = self._parents[request_id]
            samples = state.samples
            finished = (samples[0].request.is_finished if len(samples) == 1
                        else all(s.request.is_finished for s in samples))
            if state.kind is RequestOutputKind.FINAL_ONLY and not finished:
                continue
            chosen = sorted(set(indices)) if state.kind is RequestOutputKind.DELTA else range(len(state.samples))
            outputs.append(self._make_output(state, [state.samples[i] for i in chosen], finished))
            if finished:
                del self._parents[request_id]
        return outputs

    def _make_output(self, state: _ParentState, samples: list[_Sample], finished: bool) -> RequestOutput:
        requests = [s.request for s in state.samples]
        first = requests[0]
        prompt_logprobs = None
        if first.prompt_logprobs is not None and not first.wants_prompt_logprobs:
            if state.kind is not RequestOutputKind.DELTA or not state.prompt_logprobs_sent:
                prompt_logprobs = first.prompt_logprobs
                state.prompt_logprobs_sent = True
        errors = [r.error for r in requests if r.error]
        return RequestOutput(
            request_id=state.request_id,
            prompt=state.prompt,
            prompt_token_ids=first.prompt_token_ids,
            outputs=[self._completion(s, state.kind) for s in samples],
            finished=finished,
            num_cached_tokens=max(first.num_cached_tokens, 0),
            prompt_logprobs=prompt_logprobs,
            metrics=_metrics(requests, finished),
            error=errors[0] if errors else None,
            kv_transfer_params=first.kv_transfer_result if finished else None,
        )

    def _completion(self, sample: _Sample, kind: RequestOutputKind) -> CompletionOutput:
        request, detok = sample.request, sample.detokenizer
        finished = request.is_finished
        if kind is RequestOutputKind.DELTA:
            token_ids = request.output_token_ids[sample.num_sent_tokens :]
            logprobs = None if request.logprobs is None else request.logprobs[sample.num_sent_logprobs :]
        else:
            token_ids, logprobs = list(request.output_token_ids), request.logprobs
        text = ""
        if detok is not None:
            delta = detok.get_delta(finished)
            text = delta if kind is RequestOutputKind.DELTA else detok.sent_text
        sample.num_sent_tokens = request.num_output_tokens
        sample.num_sent_logprobs = len(request.logprobs or ())
        return CompletionOutput(
            index=request.index,
            text=text,
            token_ids=token_ids,
            cumulative_logprob=request.cumulative_logprob if request.logprobs is not None else None,
            logprobs=logprobs,
            finish_reason=request.finish_reason,
            stop_reason=request.stop_reason if finished else None,
        )


def _drop_output_tokens(request: Request, keep: int) -> None:
    """Cut the request's output after its first `keep` tokens (a finishing request: its KV is freed next)."""
    extra = request.num_output_tokens - keep
    if extra <= 0:
        return
    if request.logprobs is not None:
        for token, logprobs in zip(request.output_token_ids[keep:], request.logprobs[keep:]):
            request.cumulative_logprob -= logprobs[token].logprob
        del request.logprobs[keep:]
    del request.output_token_ids[keep:]
    del request.all_token_ids[-extra:]


def _metrics(requests: list[Request], finished: bool) -> RequestMetrics:
    if len(requests) == 1:  # the common case, on the per-step path of every stream
        r = requests[0]
        return RequestMetrics(
            r.arrival_time, r.first_scheduled_time, r.first_token_time, r.last_token_time,
            r.finished_time if finished else None, len(r.output_token_ids), tuple(r.preempted_times),
            _take_steps(requests),
        )

    def earliest(values):
        values = [v for v in values if v is not None]
        return min(values) if values else None

    last_tokens = [r.last_token_time for r in requests if r.last_token_time is not None]
    return RequestMetrics(
        arrival_time=requests[0].arrival_time,
        first_scheduled_time=earliest(r.first_scheduled_time for r in requests),
        first_token_time=earliest(r.first_token_time for r in requests),
        last_token_time=max(last_tokens) if last_tokens else None,
        finished_time=max(r.finished_time or 0.0 for r in requests) if finished else None,
        num_generation_tokens=sum(r.num_output_tokens for r in requests),
        preempted_times=tuple(sorted(t for r in requests for t in r.preempted_times)),
        steps=_take_steps(requests),
    )


def _take_steps(requests: list[Request]) -> tuple[StepTiming, ...]:
    if not any(r.step_timings for r in requests):
        return ()
    # n > 1: the samples of one step share its timing; one entry per step
    steps = tuple(sorted({s.start_time: s for r in requests for s in r.step_timings}.values(),
                         key=lambda s: s.start_time))
    for r in requests:
        r.step_timings.clear()
    return steps
