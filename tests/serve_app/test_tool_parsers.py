"""Tool-call parsers on each model family's format, and the streamed view of a choice (content until a
call may start, then the calls): deltas must add up to what the whole output gives."""

from __future__ import annotations

import json

import pytest

from serve_app.chat_tools import ChoiceTools, ToolPlan
from serve_app.tool_parsers import get_tool_parser

# case -> (parser, output text, content before the calls)
CASES = {
    "hermes": ("hermes",
               'I will look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
               '<tool_call>{"name": "search", "arguments": {"query": "a<b"}}</tool_call>', "I will look."),
    "llama3_json": ("llama3_json",
                    '{"name": "get_weather", "parameters": {"city": "Paris"}}; '
                    '{"name": "search", "parameters": {"query": "a<b"}}',
                    None),
    "mistral": ("mistral", 'I will look. [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, '
                           '{"name": "search", "arguments": {"query": "a<b"}}]', "I will look."),
    "mistral_v11": ("mistral", 'I will look.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]search[ARGS]'
                               '{"query": "a<b"}', "I will look."),
    "pythonic": ("pythonic", '[get_weather(city="Paris"), search(query=\'a<b\')]', None),
    "pythonic_llama4": ("pythonic", '<|python_start|>[get_weather(city="Paris"), search(query="a<b")]<|python_end|>',
                        None),
}
EXPECTED = [("get_weather", {"city": "Paris"}), ("search", {"query": "a<b"})]


@pytest.mark.parametrize("case", list(CASES))
def test_extract_calls_and_content(case):
    name, text, content = CASES[case]
    parser = get_tool_parser(name)
    got_content, calls = parser.extract(text)
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in calls] == EXPECTED


@pytest.mark.parametrize("case", list(CASES))
def test_no_calls_or_malformed_ones_stay_content(case):
    name, text, _ = CASES[case]
    parser = get_tool_parser(name)
    for plain in ["Just words, {braces} and [brackets].", text[: len(text) // 2]]:
        assert parser.extract(plain) == (plain, [])


def test_mistral_v11_needs_a_name_and_one_object_per_call():
    parser = get_tool_parser("mistral")
    for text in ['[TOOL_CALLS][ARGS]{"a": 1}', "[TOOL_CALLS]f[ARGS][1, 2]", '[TOOL_CALLS]f[ARGS]{"a": 1} {"b": 2}',
                 '[TOOL_CALLS]f[ARGS]{"a": 1}[TOOL_CALLS]g']:
        assert parser.extract(text) == (text, []), text


def test_pythonic_reads_literals_and_never_evaluates():
    parser = get_tool_parser("pythonic")
    [call] = parser.extract('[f(flag=True, none=None, n=-2.5, items=(1, "x"), nested={"k": [False]})]')[1]
    assert (call.name, json.loads(call.arguments)) == ("f", {"flag": True, "none": None, "n": -2.5, "items": [1, "x"],
                                                            "nested": {"k": [False]}})
    assert [c.name for c in parser.extract("[ping()]")[1]] == ["ping"]
    for text in ['[f("positional")]', "[f(x=__import__('os').getcwd())]", "[os.system(cmd='ls')]", "[f(**kw)]",
                 "[f(s={1, 2})]", "[]", "[1, 2]", "Sure: [f(x=1)]"]:
        assert parser.extract(text) == (text, []), text


def test_llama3_only_at_the_start_and_python_tag():
    parser = get_tool_parser("llama3_json")
    assert parser.extract('Sure: {"name": "f", "parameters": {}}')[1] == []
    assert [c.name for c in parser.extract('<|python_tag|>{"name": "f", "arguments": {"x": 1}}')[1]] == ["f"]


def test_auto_picks_the_templates_format():
    assert get_tool_parser("auto", "...[TOOL_CALLS]...").name == "mistral"
    assert get_tool_parser("auto", "...<|python_start|>...ipython...").name == "pythonic"
    assert get_tool_parser("auto", "...<|python_tag|>...").name == "llama3_json"
    assert get_tool_parser("auto", "<tool_call>").name == "hermes"
    with pytest.raises(ValueError, match="tool_call_parser"):
        get_tool_parser("nope")


def _stream(plan: ToolPlan, pieces: list[str], finish: str = "stop"):
    state = ChoiceTools(plan)
    content, calls, reasons = "", [], []
    for i, piece in enumerate(pieces):
        c, deltas, reason, _ = state.delta(piece, finish if i == len(pieces) - 1 else None)
        content += c or ""
        calls += deltas or []
        reasons.append(reason)
    return content, calls, reasons


@pytest.mark.parametrize("case", list(CASES))
def test_streamed_auto_matches_the_whole(case):
    name, text, content = CASES[case]
    plan = ToolPlan("auto", parser=get_tool_parser(name))
    for size in (1, 3, 17):
        streamed, calls, reasons = _stream(plan, [text[i : i + size] for i in range(0, len(text), size)])
        assert streamed.strip() == (content or "")
        assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == EXPECTED
        assert reasons[-1] == "tool_calls" and set(reasons[:-1]) <= {None}
        assert "[TOOL" not in streamed and "<tool" not in streamed  # a marker is never shown as content


def test_streamed_auto_without_calls_is_all_content():
    plan = ToolPlan("auto", parser=get_tool_parser("hermes"))
    text = "a < b and <tool but no call"
    streamed, calls, reasons = _stream(plan, list(text), finish="length")
    assert streamed == text and not calls and reasons[-1] == "length"


def test_named_streams_argument_deltas_and_required_sends_calls_at_the_end():
    named = ToolPlan("named", function="get_weather")
    _, calls, reasons = _stream(named, ['{"city": ', '"Paris"', "}"])
    assert calls[0].id and calls[0].function.name == "get_weather" and all(c.id in (None, calls[0].id) for c in calls)
    assert "".join(c.function.arguments for c in calls) == '{"city": "Paris"}' and reasons[-1] == "tool_calls"
    required = ToolPlan("required")
    text = '[{"name": "a", "parameters": {"x": 1}}, {"name": "b", "parameters": {}}]'
    content, calls, reasons = _stream(required, [text[:10], text[10:]])
    assert content == "" and [c.index for c in calls] == [0, 1] and reasons == [None, "tool_calls"]
    assert [json.loads(c.function.arguments) for c in calls] == [{"x": 1}, {}]
    content, calls, reasons = _stream(required, [text[:10]], finish="length")  # cut short: text, no calls
    assert content == text[:10] and not calls and reasons == ["length"]
