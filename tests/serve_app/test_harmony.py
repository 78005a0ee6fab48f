"""Harmony (gpt-oss's chat format): channels split into reasoning, content and tool calls, whole and streamed
token by token; the built-in gpt-oss's tokenizer and template write Harmony prompts; the chat route keeps
Harmony's special tokens in the text it parses."""

from __future__ import annotations

import json
import re

import pytest

from engine.config import EngineConfig
from engine.frontend.input_processor import InputProcessor
from engine.sampling_params import RequestOutputKind
from engine.tokenizer import resolve_eos_token_ids
from serve_app.chat_tools import ChoiceTools, ToolPlan, plan_tools
from serve_app.harmony import split_output
from serve_app.openai_serving import OpenAIServing
from serve_app.protocol.openai import ChatCompletionRequest, ResponseMessage
from serve_app.tool_parsers import get_tool_parser

THINK = "<|channel|>analysis<|message|>The user wants the weather. I should call get_weather.<|end|>"
ANSWER = THINK + "<|start|>assistant<|channel|>final<|message|>It is sunny in Paris."
CALL = THINK + ('<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>'
                '{"city": "Paris", "unit": "celsius"}')
# The recipient before the channel, a preamble on commentary, two calls, and no <|start|> between messages.
TWO_CALLS = ("<|channel|>commentary<|message|>Looking both up.<|end|>"
             '<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"city":"Paris"}<|call|>'
             '<|channel|>commentary to=functions.get_time<|message|>{"zone": "CET"}')
REASONING = "The user wants the weather. I should call get_weather."
AUTO = ToolPlan("auto", parser=get_tool_parser("hermes"), harmony=True)


def pieces(text: str) -> list[str]:
    """The text as a detokenizer streams it: each special token whole, the rest a few characters at a time."""
    return [p for part in re.split(r"(<\|[a-z]+\|>)", text) if part
            for p in ([part] if part.startswith("<|") else [part[i:i + 3] for i in range(0, len(part), 3)])]


def stream(plan: ToolPlan, text: str, finish: str = "stop"):
    state, reasoning, content, calls, reasons = ChoiceTools(plan), "", "", [], []
    parts = pieces(text)
    for i, piece in enumerate(parts):
        out = state.delta(piece, finish if i == len(parts) - 1 else None)
        reasoning += out.reasoning or ""
        content += out.content or ""
        calls += out.tool_calls or []
        reasons.append(out.finish_reason)
        assert not out.tool_calls or i == len(parts) - 1, "calls come once the turn ends"
    return reasoning, content, calls, reasons[-1]


def test_analysis_is_reasoning_and_final_is_content():
    out = ChoiceTools(AUTO).final(ANSWER, "stop")
    assert (out.reasoning, out.content, out.tool_calls, out.finish_reason) == (
        REASONING, "It is sunny in Paris.", None, "stop")
    assert stream(AUTO, ANSWER) == (REASONING, "It is sunny in Paris.", [], "stop")
    message = ResponseMessage(content=out.content, reasoning=out.reasoning)
    assert message.reasoning_content == REASONING  # the older name, for clients that read it


@pytest.mark.parametrize("text, calls, content", [
    (CALL, [("get_weather", {"city": "Paris", "unit": "celsius"})], None),
    (TWO_CALLS, [("get_weather", {"city": "Paris"}), ("get_time", {"zone": "CET"})], "Looking both up."),
])
def test_calls_come_from_messages_to_functions(text, calls, content):
    out = ChoiceTools(AUTO).final(text, "stop")
    assert out.finish_reason == "tool_calls" and out.content == content
    assert [(c.function.name, json.loads(c.function.arguments)) for c in out.tool_calls] == calls
    _, streamed_content, deltas, reason = stream(AUTO, text)
    assert reason == "tool_calls" and (streamed_content or None) == content
    assert [(d.index, d.function.name, json.loads(d.function.arguments)) for d in deltas] == [
        (i, name, args) for i, (name, args) in enumerate(calls)]


def test_tool_choice_none_returns_no_calls_and_never_the_analysis():
    plan = plan_tools(ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}]),
                      get_tool_parser("hermes"), harmony=True)
    assert plan.reads_harmony
    out = ChoiceTools(plan).final(CALL, "stop")
    assert (out.content, out.tool_calls, out.finish_reason, out.reasoning) == (None, None, "stop", REASONING)


def test_text_without_a_header_is_content_without_special_tokens():
    text = "Just words<|end|> and more"
    assert split_output(text).content == "Just words and more"
    assert stream(AUTO, text) == ("", "Just words and more", [], "stop")


def test_a_turn_cut_by_max_tokens_keeps_what_it_wrote():
    cut = ANSWER[: ANSWER.index("sunny")]
    out = ChoiceTools(AUTO).final(cut, "length")
    assert (out.reasoning, out.content, out.finish_reason) == (REASONING, "It is ", "length")
    header_only = "<|channel|>analysis"
    assert ChoiceTools(AUTO).final(header_only, "length")[:3] == (None, None, "length")


def test_required_tool_choice_reads_the_constrained_json_as_any_model():
    plan = ToolPlan("required", harmony=True)
    assert not plan.reads_harmony
    out = ChoiceTools(plan).final('[{"name": "f", "parameters": {}}]', "stop")
    assert out.tool_calls[0].function.name == "f" and out.reasoning is None


def test_builtin_gpt_oss_writes_harmony_prompts():
    processor = InputProcessor.from_config(EngineConfig(model="pagedserve-tiny-gpt-oss"))
    tokenizer = processor.tokenizer
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                               "parameters": {"type": "object",
                                                              "properties": {"city": {"type": "string"}}}}}]
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "P"}}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    ids = processor.apply_chat_template(messages, True, tools=tools, reasoning_effort="low")
    text = tokenizer.decode(ids, skip_special_tokens=False)
    assert text.startswith("<|start|>system<|message|>") and "Reasoning: low" in text
    assert "<|start|>developer<|message|># Instructions\n\nBe brief.\n\n# Tools" in text
    assert "type get_weather = (_: " in text
    assert ('<|start|>assistant to=functions.get_weather<|channel|>commentary <|constrain|>json<|message|>'
            '{"city": "P"}<|call|>') in text
    assert "<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>sunny<|end|>" in text
    assert text.endswith("<|start|>assistant")
    specials = {t: tokenizer.convert_tokens_to_ids(t) for t in ("<|start|>", "<|return|>", "<|call|>")}
    assert all(i >= 32000 for i in specials.values())
    assert ids.count(specials["<|start|>"]) == text.count("<|start|>") == 6  # each header token is one id
    assert resolve_eos_token_ids(processor.model_config, tokenizer) == {2, specials["<|return|>"], specials["<|call|>"]}

    serving = OpenAIServing(processor, "gpt-oss", engine=None)
    assert serving.harmony
    chat = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}])
    params = serving.sampling_params(chat, len(ids), 8, None, RequestOutputKind.FINAL_ONLY)
    assert not params.skip_special_tokens  # the channels' headers must reach the parser


def test_a_thinking_budget_ends_the_analysis_with_the_final_channels_header():
    """The budget forces HARMONY_END after the analysis tokens (engine/sample/thinking.py): the text that follows
    is the final channel's, so it is content."""
    from serve_app.reasoning_parsers import HARMONY_END, HARMONY_START

    processor = InputProcessor.from_config(EngineConfig(model="pagedserve-tiny-gpt-oss"))
    serving = OpenAIServing(processor, "gpt-oss", engine=None, reasoning_parser="gpt_oss")
    start, end = serving.thinking_tags
    ids = {t: processor.tokenizer.convert_tokens_to_ids(t) for t in ("<|channel|>", "<|end|>", "<|start|>")}
    assert start[0] == ids["<|channel|>"] and end[:2] == [ids["<|end|>"], ids["<|start|>"]]  # header tokens, whole
    out = split_output(HARMONY_START + "cut short by the bud" + HARMONY_END + "Sunny.")
    assert (out.reasoning, out.content) == ("cut short by the bud", "Sunny.")
    chat = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], thinking_token_budget=5)
    assert serving.thinking(chat, None) == {"thinking_token_budget": 5, "thinking_start_token_ids": start,
                                             "thinking_end_token_ids": end}
    forced = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], thinking_token_budget=5,
                                   response_format={"type": "json_object"})
    with pytest.raises(Exception, match="thinking_token_budget: a Harmony model's forced tool call"):
        serving.thinking(forced, object())
