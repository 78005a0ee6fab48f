"""The thinking budget (engine/sample/thinking.py) on the random-weight tiny model: the end tag is forced once the
budget is spent and not before, an output that must open its thinking does so only by the start tag, a grammar
constrains the answer after the thinking only, and speculative decoding leaves the tokens unchanged."""

from __future__ import annotations

import re

import pytest

from engine import LLM, SamplingParams
from engine.sampling_params import StructuredOutputsParams
from tests.conftest import TINY

PROMPTS = ["Think about the sea.", "Count the stars, slowly", "Why is the sky blue?"]


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(TINY, max_model_len=512)


@pytest.fixture(scope="module")
def tags(llm) -> tuple[list[int], list[int]]:
    tok = llm.get_tokenizer()
    return tok.encode("<think>", add_special_tokens=False), tok.encode("</think>", add_special_tokens=False)


def _tokens(llm: LLM, params: SamplingParams, prompts=PROMPTS) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]


def test_budget_forces_the_end_tag_after_exactly_that_many_tokens(llm, tags):
    _, end = tags
    plain = _tokens(llm, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    for budget in (0, 1, 6):
        params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, thinking_token_budget=budget,
                                thinking_end_token_ids=end)
        for free, thought in zip(plain, _tokens(llm, params)):
            assert thought[:budget] == free[:budget]  # the thinking itself is the model's own
            assert thought[budget : budget + len(end)] == end
            assert end not in [thought[i : i + len(end)] for i in range(budget + len(end), len(thought))]
    # Without a budget the tags change nothing.
    unbounded = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, thinking_end_token_ids=end)
    assert _tokens(llm, unbounded) == plain


def test_budget_counts_from_the_start_tag_when_the_output_must_open_it(llm, tags):
    start, end = tags
    plain = _tokens(llm, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    opening = dict(thinking_start_token_ids=start, thinking_end_token_ids=end, thinking_token_budget=0)
    # The model does not write <think>: no thinking, so nothing is forced.
    assert _tokens(llm, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, **opening)) == plain
    # Biased to write a one-token start tag (as Qwen3's <think> is), it thinks; then the budget of 2 ends it.
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logit_bias={start[0]: 100.0},
                            **(opening | {"thinking_start_token_ids": start[:1], "thinking_token_budget": 2}))
    for out in _tokens(llm, params):
        assert out[:3] == start[:1] * 3 and out[3 : 3 + len(end)] == end


def test_a_grammar_constrains_only_the_answer_after_the_thinking(llm, tags):
    start, end = tags
    tok = llm.get_tokenizer()
    regex = StructuredOutputsParams(regex="[a-z]{3,8}")
    params = SamplingParams(temperature=1.0, seed=7, max_tokens=40, structured_outputs=regex,
                            thinking_token_budget=5, thinking_end_token_ids=end)
    for out in _tokens(llm, params):
        assert out[5 : 5 + len(end)] == end
        assert re.fullmatch("[a-z]{3,8}", tok.decode(out[5 + len(end) :], skip_special_tokens=True))
    # An output that may open its thinking: either it opens it (biased to), thinks and then answers by the
    # grammar, or (unbiased) its first token is already the grammar's.
    # With a grammar to follow, a begun start tag is completed.
    for bias, opens in (({start[0]: 100.0}, True), (None, False)):
        params = SamplingParams(temperature=0, max_tokens=40, structured_outputs=regex, logit_bias=bias,
                                thinking_start_token_ids=start, thinking_end_token_ids=end, thinking_token_budget=3)
        for out in _tokens(llm, params):
            answer = out[len(start) + 3 + len(end) :] if opens else out
            if opens:
                assert out[: len(start)] == start and out[len(start) + 3 : len(start) + 3 + len(end)] == end
            assert re.fullmatch("[a-z]{3,8}", tok.decode(answer, skip_special_tokens=True))


def test_speculative_decoding_keeps_the_forced_tokens(tags):
    _, end = tags
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, thinking_token_budget=7,
                            thinking_end_token_ids=end)
    engine = dict(max_model_len=512, block_size=4, max_num_batched_tokens=64)
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
    plain = _tokens(LLM(TINY, **engine), params)
    assert _tokens(LLM(TINY, **engine, speculative_config=spec), params) == plain


def test_thinking_parameters_are_validated_by_name():
    with pytest.raises(ValueError, match="thinking_token_budget: needs thinking_end_token_ids"):
        SamplingParams(thinking_token_budget=8)
    with pytest.raises(ValueError, match="thinking_start_token_ids: needs thinking_end_token_ids"):
        SamplingParams(thinking_start_token_ids=[1])
    with pytest.raises(ValueError, match="thinking_token_budget"):
        SamplingParams(thinking_token_budget=-1, thinking_end_token_ids=[2])
    with pytest.raises(ValueError, match="thinking_end_token_ids: must be non-negative"):
        SamplingParams(thinking_end_token_ids=[-2])
