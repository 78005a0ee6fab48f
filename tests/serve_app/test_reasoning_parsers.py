"""Reasoning parsers (serve_app/reasoning_parsers.py) and their place in a chat choice (serve_app/chat_tools.py):
the thinking split from the answer, the same whole as streamed in any chunking; tool calls read from the answer
only; include_reasoning=false drops it."""

from __future__ import annotations

import json
import re

import pytest

from serve_app.chat_tools import ChoiceTools, plan_tools
from serve_app.protocol.openai import ChatCompletionRequest
from serve_app.reasoning_parsers import think_format
from serve_app.tool_parsers import get_tool_parser
from tests.serve_app.conftest import SMALL_APP_KEYS

CASES = [  # (parser, output, reasoning, answer)
    ("deepseek_r1", "Let me think.</think>\n\nThe answer is 4.", "Let me think.", "The answer is 4."),
    ("deepseek_r1", "<think>Opened again.</think>Four.", "Opened again.", "Four."),
    ("deepseek_r1", "Still thinking when max_tokens came", "Still thinking when max_tokens came", ""),
    ("qwen3", "<think>\nHmm.\n</think>\n\nFour.", "\nHmm.\n", "Four."),
    ("qwen3", "Four, without thinking.", None, "Four, without thinking."),
    ("qwen3", "<thinking is a word>", None, "<thinking is a word>"),
    ("qwen3", "<think>a < b and </thin is not the end</think>yes", "a < b and </thin is not the end", "yes"),
]


@pytest.mark.parametrize("parser, output, reasoning, answer", CASES)
def test_whole_and_streamed_in_every_chunking(parser, output, reasoning, answer):
    fmt = think_format(parser)
    assert fmt.split(output) == (reasoning, answer)
    for size in (1, 2, 3, 7):
        chunks = [output[i : i + size] for i in range(0, len(output), size)]
        tools = ChoiceTools(plan_tools(ChatCompletionRequest(messages=[{"role": "user", "content": "x"}]),
                                       get_tool_parser("auto", None), think=fmt))
        parts = [tools.delta(chunk, "stop" if i == len(chunks) - 1 else None) for i, chunk in enumerate(chunks)]
        assert "".join(p.reasoning or "" for p in parts) == (reasoning or "")
        assert "".join(p.content or "" for p in parts) == answer


def test_a_tool_call_inside_the_thinking_is_not_a_call():
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    req = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], tools=tools)
    plan = plan_tools(req, get_tool_parser("mistral", None), think=think_format("deepseek_r1"))
    thought = 'I could write [TOOL_CALLS] [{"name": "f", "arguments": {}}] but will not.</think>Done.'
    out = ChoiceTools(plan).final(thought, "stop")
    assert out.tool_calls is None and out.content == "Done." and "[TOOL_CALLS]" in out.reasoning
    called = ChoiceTools(plan).final('Call it.</think>[TOOL_CALLS] [{"name": "f", "arguments": {"a": 1}}]', "stop")
    assert called.reasoning == "Call it." and called.tool_calls[0].function.name == "f"
    assert called.finish_reason == "tool_calls"


def test_include_reasoning_false_drops_it():
    req = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], include_reasoning=False)
    out = ChoiceTools(plan_tools(req, get_tool_parser("auto", None), think=think_format("deepseek_r1"))).final(
        "secret</think>shown", "stop")
    assert out.reasoning is None and out.content == "shown"


def test_a_thinking_block_without_its_text_is_refused_naming_it():
    from pydantic import ValidationError

    from serve_app.protocol.anthropic import MessagesRequest

    turns = [{"role": "user", "content": "a"}, {"role": "assistant", "content": [{"type": "thinking"}]}]
    with pytest.raises(ValidationError, match="block 0: a thinking block needs a string `thinking`"):
        MessagesRequest.model_validate({"model": "m", "max_tokens": 5, "messages": turns})


def test_unknown_parser_is_refused_by_name():
    with pytest.raises(ValueError, match="reasoning_parser: 'o1' is not one of"):
        think_format("o1")


# --- over HTTP: an app with reasoning_parser deepseek_r1 (the output starts inside the thinking) -------------
# The random-weight model never ends its thinking itself: a budget of 4 tokens does, and a regex then constrains
# the answer (only the answer: the engine starts the grammar after the end tag).
SHAPED = {"thinking_token_budget": 4, "structured_outputs": {"regex": "[a-z]{3,8}"}}
KEY = SMALL_APP_KEYS[0]


@pytest.fixture(scope="module")
def reasoning_url(small_app) -> str:
    return small_app.url  # small_app has the reasoning parser (and API keys: the SDKs send KEY)


def test_chat_returns_reasoning_apart_whole_and_streamed(reasoning_url):
    import openai

    client = openai.OpenAI(base_url=reasoning_url + "/v1", api_key=KEY, max_retries=0, timeout=60)
    ask = dict(model="pagedserve-tiny", messages=[{"role": "user", "content": "Think, then answer."}],
               temperature=0, max_tokens=32, extra_body=SHAPED)
    message = client.chat.completions.create(**ask).choices[0].message
    assert message.reasoning and re.fullmatch("[a-z]{3,8}", message.content) and "</think>" not in message.reasoning
    assert message.reasoning_content == message.reasoning
    chunks = list(client.chat.completions.create(**ask, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(d.reasoning or "" for d in deltas) == message.reasoning
    assert "".join(d.content or "" for d in deltas) == message.content
    hidden = client.chat.completions.create(**{**ask, "extra_body": {**SHAPED, "include_reasoning": False}})
    assert hidden.choices[0].message.reasoning is None and hidden.choices[0].message.content == message.content
    # A budget of 0 ends the thinking at once (the tiny tokenizer's "▁</" leaves a space before the tag); without
    # one the thinking runs to max_tokens, all reasoning.
    unthought = client.chat.completions.create(**{**ask, "extra_body": {"thinking_token_budget": 0}})
    assert not (unthought.choices[0].message.reasoning or "").strip() and unthought.choices[0].message.content
    endless = client.chat.completions.create(**{**ask, "extra_body": {}}).choices[0].message
    assert endless.reasoning and not endless.content
    # A forced tool call thinks first, then its arguments follow the tool's schema.
    tool = {"type": "function", "function": {"name": "pick", "parameters": {
        "type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["n"]}}}
    named = {"type": "function", "function": {"name": "pick"}}
    called = client.chat.completions.create(**{**ask, "max_tokens": 64, "extra_body": {"thinking_token_budget": 3}},
                                            tools=[tool], tool_choice=named)
    call = called.choices[0].message
    assert call.reasoning and json.loads(call.tool_calls[0].function.arguments)["n"] in range(10)


def test_a_budget_without_a_reasoning_parser_is_refused_by_name(serve_app_url):
    import openai

    client = openai.OpenAI(base_url=serve_app_url + "/v1", api_key="unused", max_retries=0, timeout=60)
    with pytest.raises(openai.BadRequestError, match="thinking_token_budget: .* without a reasoning_parser"):
        client.chat.completions.create(model="pagedserve-tiny", messages=[{"role": "user", "content": "x"}],
                                       max_tokens=2, extra_body={"thinking_token_budget": 3})
    with pytest.raises(openai.BadRequestError, match="reasoning.effort"):
        client.responses.create(model="pagedserve-tiny", input="x", max_output_tokens=2, reasoning={"effort": "low"})


def test_anthropic_thinking_blocks_when_enabled(reasoning_url):
    """Anthropic's route takes no regex, so the random-weight output never closes its thinking: all of it is
    reasoning, which comes as a thinking block only when the request enables thinking."""
    import anthropic
    import openai

    chat = openai.OpenAI(base_url=reasoning_url + "/v1", api_key=KEY, max_retries=0, timeout=60)
    expected = chat.chat.completions.create(model="pagedserve-tiny", temperature=0, max_tokens=16, messages=[
        {"role": "user", "content": "Think first."}]).choices[0].message.reasoning
    client = anthropic.Anthropic(base_url=reasoning_url, api_key=KEY, max_retries=0, timeout=60)
    ask = dict(model="pagedserve-tiny", max_tokens=16, messages=[{"role": "user", "content": "Think first."}],
               extra_body={"temperature": 0})
    plain = client.messages.create(**ask)
    assert [b.type for b in plain.content] == ["text"] and plain.content[0].text == ""
    # Anthropic: 1024 <= budget < max_tokens. The budget ends the thinking, and the answer follows.
    enabled = dict(ask, max_tokens=1030, extra_body={"temperature": 0})
    thought = client.messages.create(**enabled, thinking={"type": "enabled", "budget_tokens": 1024})
    assert [b.type for b in thought.content] == ["thinking", "text"] and thought.content[1].text
    assert thought.content[0].thinking.startswith(expected)
    with client.messages.stream(**enabled, thinking={"type": "enabled", "budget_tokens": 1024}) as stream:
        final = stream.get_final_message()
    assert final.content[0].type == "thinking" and final.content[0].thinking == thought.content[0].thinking
    # A client sends the thinking back with its signature in the next turn: accepted, left out of the prompt.
    again = client.messages.create(**{**ask, "messages": [
        {"role": "user", "content": "Think first."},
        {"role": "assistant", "content": [b.model_dump() for b in thought.content]},
        {"role": "user", "content": "And now?"}]})
    assert again.content
    with pytest.raises(anthropic.BadRequestError, match="budget_tokens"):
        client.messages.create(**ask, thinking={"type": "enabled", "budget_tokens": 1024})  # not below max_tokens


def test_responses_carry_reasoning_items(reasoning_url):
    import openai

    client = openai.OpenAI(base_url=reasoning_url + "/v1", api_key=KEY, max_retries=0, timeout=60)
    r = client.responses.create(model="pagedserve-tiny", input="Think.", temperature=0, max_output_tokens=8)
    # Unconstrained, the output never closes its thinking: all reasoning, cut at max_output_tokens.
    assert [item.type for item in r.output] == ["reasoning"] and r.status == "incomplete"
    assert r.output[0].content[0].text and r.output_text == ""
    assert 0 < r.usage.output_tokens_details.reasoning_tokens <= 16
    # reasoning.effort is a budget: "none" thinks not at all, "minimal" 256 tokens and then answers.
    none = client.responses.create(model="pagedserve-tiny", input="Think.", temperature=0, max_output_tokens=8,
                                   reasoning={"effort": "none"})
    assert none.output[-1].type == "message" and none.output_text
    assert all(not part.text.strip() for item in none.output[:-1] for part in item.content)  # "▁</": a space at most
    minimal = client.responses.create(model="pagedserve-tiny", input="Think.", temperature=0, max_output_tokens=264,
                                      reasoning={"effort": "minimal"})
    assert [item.type for item in minimal.output] == ["reasoning", "message"] and minimal.output_text
