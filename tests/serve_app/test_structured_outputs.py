"""Structured outputs and tool calling through the `openai` SDK against the running app (random-weight
tiny model: every valid output below is the grammar's doing), and the 400s for bad formats and tools."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import openai
import pytest

from engine.sampling_params import MAX_GRAMMAR_BYTES

MODEL = "pagedserve-tiny"

# Finite on purpose (maxLength, maxItems, ranges, enums): see tests/engine/structured_output/test_structured_output.py.
ORDER_SCHEMA = {
    "type": "object",
    "properties": {
        "customer": {
            "type": "object",
            "properties": {"name": {"type": "string", "maxLength": 10}, "tier": {"enum": ["gold", "silver"]}},
            "required": ["name", "tier"],
        },
        "items": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {"sku": {"type": "string", "pattern": "^[A-Z]{3}[0-9]{2}$"},
                               "qty": {"type": "integer", "minimum": 1, "maximum": 9}},
                "required": ["sku", "qty"],
            },
            "minItems": 1, "maxItems": 3,
        },
        "gift": {"type": "boolean"},
    },
    "required": ["customer", "items", "gift"],
}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city", "parameters": {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "Rome", "Oslo"]}, "unit": {"enum": ["C", "F"]},
                   "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "unit", "days"]}}}
SEARCH = {"type": "function", "function": {"name": "search", "parameters": {
    "type": "object",
    "properties": {"query": {"type": "string", "minLength": 1, "maxLength": 12},
                   "filters": {"type": "array", "items": {"enum": ["news", "images"]}, "maxItems": 2}},
    "required": ["query"]}}}
NO_ARGS = {"type": "function", "function": {"name": "ping"}}
TOOLS = [WEATHER, SEARCH, NO_ARGS]
SCHEMAS = {t["function"]["name"]: t["function"].get("parameters", {"type": "object", "properties": {}}) for t in TOOLS}


@pytest.fixture(scope="module")
def client(serve_app_url) -> openai.OpenAI:
    return openai.OpenAI(base_url=serve_app_url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _chat(client, i: int, **kwargs):
    kwargs = {"temperature": 1.0, "max_tokens": 400, **kwargs}
    return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": f"Request {i}"}], **kwargs)


def _parallel(fn, n: int) -> list:
    with ThreadPoolExecutor(n) as pool:
        return list(pool.map(fn, range(n)))


def test_chat_json_schema(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "order", "schema": ORDER_SCHEMA}}
    responses = _parallel(lambda i: _chat(client, i, response_format=fmt), 8)
    for r in responses:
        assert r.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(r.choices[0].message.content), ORDER_SCHEMA)


def test_completions_json_schema_streamed_and_regex(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "order", "schema": ORDER_SCHEMA}}
    chunks = list(client.completions.create(model=MODEL, prompt="An order:", max_tokens=400, stream=True,
                                            extra_body={"response_format": fmt}))
    jsonschema.validate(json.loads("".join(c.choices[0].text for c in chunks if c.choices)), ORDER_SCHEMA)
    assert chunks[-1].choices[0].finish_reason == "stop"
    regex = r"\d{3}-[a-z]{2,5}"
    r = client.completions.create(model=MODEL, prompt=["A code:", "Another:"], max_tokens=40, n=2,
                                  extra_body={"structured_outputs": {"regex": regex}})
    assert len(r.choices) == 4
    assert all(c.finish_reason == "stop" and re.fullmatch(regex, c.text) for c in r.choices)


def test_vllm_structural_tag_and_structured_outputs_options(client):
    # A regex inside the tag: finite. (xgrammar's JSON inside a tag allows free whitespace, which a
    # random model pads without end.)
    fmt = {"type": "structural_tag", "format": {
        "type": "tag", "begin": "<d>", "content": {"type": "regex", "pattern": "[0-9]{2}-[a-z]{2}"}, "end": "</d>"}}
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "A code"}], max_tokens=60,
                                       n=2, response_format=fmt)
    assert all(c.finish_reason == "stop" and re.fullmatch(r"<d>\d\d-[a-z]{2}</d>", c.message.content)
               for c in r.choices)
    digit = {"type": "object", "properties": {"d": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["d"]}
    so = {"json": digit, "disable_any_whitespace": True, "disable_fallback": True,
          "disable_additional_properties": True}
    r = client.completions.create(model=MODEL, prompt="A digit:", max_tokens=60, extra_body={"structured_outputs": so})
    assert r.choices[0].finish_reason == "stop" and re.fullmatch(r'\{"d": \d\}', r.choices[0].text)


def test_choice_and_json_object(client):
    choices = ["positive", "negative", "neutral"]
    r = _chat(client, 0, n=3, extra_body={"structured_outputs": {"choice": choices}})
    assert all(c.finish_reason == "stop" and c.message.content in choices for c in r.choices)
    r = _chat(client, 1, response_format={"type": "json_object"}, max_tokens=300)
    text = r.choices[0].message.content
    assert text.startswith("{")
    if r.choices[0].finish_reason == "stop":  # any object: a random model may write a long one
        assert isinstance(json.loads(text), dict)


def _check_calls(calls, expect_name=None):
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert expect_name in (None, call.function.name)
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_tool_choice_required(client):
    # Seeded: unseeded, a random model now and then writes arguments until max_tokens (finish "length").
    responses = _parallel(lambda i: _chat(client, i, tools=TOOLS, tool_choice="required", seed=i), 6)
    names = set()
    for r in responses:
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        _check_calls(choice.message.tool_calls)
        names |= {c.function.name for c in choice.message.tool_calls}
    assert len(names) >= 2  # not one tool forced: the grammar lets the model pick
    single = _chat(client, 9, tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
    assert len(single.choices[0].message.tool_calls) == 1


def test_tool_choice_required_streamed(client):
    stream = _chat(client, 3, tools=TOOLS, tool_choice="required", stream=True)
    calls: dict[int, dict] = {}
    finish = None
    for chunk in stream:
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            for d in choice.delta.tool_calls or []:
                call = calls.setdefault(d.index, {"id": d.id, "name": d.function.name, "arguments": ""})
                call["arguments"] += d.function.arguments or ""
    assert finish == "tool_calls" and calls
    for call in calls.values():
        assert call["id"].startswith("call_")
        jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])


def test_named_tool_choice_whole_and_streamed(client):
    named = {"type": "function", "function": {"name": "get_weather"}}
    r = _chat(client, 0, tools=TOOLS, tool_choice=named)
    assert r.choices[0].finish_reason == "tool_calls"
    _check_calls(r.choices[0].message.tool_calls, "get_weather")
    arguments, ids, finish = "", set(), None
    for chunk in _chat(client, 1, tools=TOOLS, tool_choice=named, stream=True):
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            for d in choice.delta.tool_calls or []:
                ids |= {d.id} - {None}
                arguments += d.function.arguments or ""
    assert finish == "tool_calls" and len(ids) == 1
    jsonschema.validate(json.loads(arguments), SCHEMAS["get_weather"])


def test_auto_reads_the_models_tool_call_format(client):
    """The built-in template is Mistral's, so `auto` parses [TOOL_CALLS]. A random model never writes
    one on its own: a regex makes it write one, and the parser must read it back, whole and streamed."""
    call = (r'Let me check\. \[TOOL_CALLS\] \[\{"name": "get_weather", "arguments": '
            r'\{"city": "(Paris|Rome)", "unit": "C", "days": [1-7]\}\}\]')
    kwargs = dict(tools=TOOLS, tool_choice="auto", seed=4, extra_body={"structured_outputs": {"regex": call}})
    r = _chat(client, 0, **kwargs)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me check."
    _check_calls(choice.message.tool_calls, "get_weather")
    content, calls, finish = "", [], None
    for chunk in _chat(client, 0, stream=True, **kwargs):
        for c in chunk.choices:
            content += c.delta.content or ""
            calls += c.delta.tool_calls or []
            finish = c.finish_reason or finish
    assert content.strip() == "Let me check." and finish == "tool_calls"
    assert [c.function.name for c in calls] == ["get_weather"]
    assert json.loads(calls[0].function.arguments) == json.loads(choice.message.tool_calls[0].function.arguments)
    plain = _chat(client, 1, tools=TOOLS, max_tokens=8)  # auto by default; gibberish is content
    assert plain.choices[0].message.tool_calls is None and plain.choices[0].finish_reason == "length"


def test_tool_results_go_through_the_chat_template(client):
    base = [{"role": "user", "content": "Weather in Paris?"}]
    turn = base + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": json.dumps({"city": "Paris", "unit": "C", "days": 1})}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
        {"role": "user", "content": "And tomorrow?"},
    ]
    short = client.chat.completions.create(model=MODEL, messages=base, max_tokens=1)
    with_tools = client.chat.completions.create(model=MODEL, messages=base, tools=TOOLS, max_tokens=1)
    full = client.chat.completions.create(model=MODEL, messages=turn, tools=TOOLS, max_tokens=1)
    assert short.usage.prompt_tokens < with_tools.usage.prompt_tokens < full.usage.prompt_tokens


@pytest.mark.parametrize(
    "route, body, param",
    [
        ("/v1/chat/completions",
         {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
         "response_format"),
        ("/v1/chat/completions", {"response_format": {"type": "json_schema"}}, "response_format"),
        ("/v1/completions", {"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs"),
        ("/v1/completions", {"structured_outputs": {"grammar": "root ::= missing_rule"}}, "structured_outputs"),
        ("/v1/completions", {"structured_outputs": {"json": {"type": "object"}, "whitespace_pattern": " "}},
         "structured_outputs"),
        ("/v1/chat/completions", {"response_format": {"type": "structural_tag"}}, "response_format"),
        ("/v1/chat/completions", {"response_format": {"type": "structural_tag", "format": {"type": "no_such_format"}}},
         "response_format"),
        ("/v1/completions", {"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
        ("/v1/completions", {"structured_outputs": {"json": {"type": "object"}},
                             "response_format": {"type": "json_object"}}, "response_format"),
        ("/v1/completions", {"structured_outputs": {"grammar": 'root ::= "' + "a" * MAX_GRAMMAR_BYTES + '"'}},
         "structured_outputs"),
        ("/v1/chat/completions",
         {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 3}}}]},
         "tools.0.function.parameters"),
        ("/v1/chat/completions", {"tools": [{"type": "function", "function": {"name": "bad name!"}}]},
         "tools.0.function.name"),
        ("/v1/chat/completions", {"tools": [WEATHER, WEATHER]}, "tools"),
        ("/v1/chat/completions", {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
         "tool_choice"),
        ("/v1/chat/completions", {"tool_choice": "required"}, "tool_choice"),
        ("/v1/chat/completions",
         {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
         "tool_choice"),
        # Valid to the JSON Schema meta-schema, but no regex xgrammar can compile: caught by the ingress's compile.
        ("/v1/chat/completions", {"tools": [{"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "properties": {"s": {"type": "string", "pattern": "(a)\\1"}}}}}],
            "tool_choice": "required"},
         "tools"),
        ("/v1/completions", {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
            "type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}}}}, "response_format"),
    ],
)
def test_bad_formats_and_tools_are_400_naming_the_field(serve_app_url, route, body, param):
    """400 from the ingress (a format failing on a replica would be a 500), naming the field."""
    payload = {"max_tokens": 4, **body}
    payload.update({"prompt": "x"} if route == "/v1/completions" else {"messages": [{"role": "user", "content": "x"}]})
    response = httpx.post(serve_app_url + route, json=payload, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error", error
    assert error["message"].startswith(param.split(".")[0]), error
