"""RequestOutput and its parts: pickled (they cross from the engine process every step) and merged."""

from __future__ import annotations

import copy
import pickle

from engine.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput, StepTiming, merge_deltas


def _output(text: str, token_ids: list[int], finished: bool = False) -> RequestOutput:
    logprobs = [{t: Logprob(-0.5, 1, "x"), 3: Logprob(-2.0, 2)} for t in token_ids]
    step = StepTiming(1.0, 1.5, len(token_ids), 4, 64)
    return RequestOutput(
        "r1", "a prompt", [1, 2, 3],
        [CompletionOutput(0, text, token_ids, -0.5, logprobs, "stop" if finished else None)], finished,
        num_cached_tokens=16, metrics=RequestMetrics(0.5, 0.6, 0.9, 1.5, None, len(token_ids), (0.7,), (step,)),
        kv_transfer_params={"block_ids": [4, 5]} if finished else None,
    )


def test_outputs_pickle_and_copy_to_equal_objects():
    output = _output(" hi", [7, 8], finished=True)
    for protocol in range(2, pickle.HIGHEST_PROTOCOL + 1):
        loaded = pickle.loads(pickle.dumps(output, protocol=protocol))
        assert loaded == output and type(loaded.outputs[0].logprobs[0][7]) is Logprob
    assert copy.deepcopy(output) == output and copy.copy(output) == output
    assert copy.deepcopy(output).outputs[0] is not output.outputs[0]


def test_merge_deltas_concatenates_text_tokens_and_steps():
    merged = merge_deltas([_output(" a", [5]), _output(" b", [6], finished=True)])
    assert merged.outputs[0].text == " a b" and merged.outputs[0].token_ids == [5, 6]
    assert merged.finished and merged.outputs[0].finish_reason == "stop" and len(merged.metrics.steps) == 2
