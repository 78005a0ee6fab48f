"""The Anthropic Messages route (`POST /v1/messages`) through the official `anthropic` SDK and raw HTTP,
against the running app."""

from __future__ import annotations

import json

import anthropic
import httpx
import pytest

MODEL = "pagedserve-tiny"
HELLO = [{"role": "user", "content": "Hello there"}]
# The installed SDK (2.x) has no temperature/top_p/top_k arguments; this server takes them as body fields.
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def client(serve_app_url) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=serve_app_url, api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def chat_tokens(serve_app_url):
    """Prompt length of a chat, through the same chat template (/tokenize)."""

    def count(messages: list[dict]) -> int:
        r = httpx.post(serve_app_url + "/tokenize", json={"messages": messages})
        assert r.status_code == 200, r.text
        return r.json()["count"]

    return count


def _input_tokens(usage) -> int:
    """Anthropic counts cache reads apart: the whole prompt is their sum."""
    return usage.input_tokens + (usage.cache_read_input_tokens or 0)


def _raw_events(url: str, body: dict) -> list[tuple[str, dict]]:
    events, name = [], None
    with httpx.stream("POST", url + "/v1/messages", json=body, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("event: "):
                name = line[len("event: "):]
            elif line.startswith("data: "):
                events.append((name, json.loads(line[len("data: "):])))
                name = None
    return events


def test_message(client, chat_tokens):
    r = client.messages.create(model=MODEL, max_tokens=8, extra_body=GREEDY, messages=HELLO)
    assert r.id.startswith("msg_") and r.type == "message" and r.role == "assistant" and r.model == MODEL
    assert [b.type for b in r.content] == ["text"] and r.content[0].text
    assert r.stop_reason == "max_tokens" and r.stop_sequence is None
    assert r.usage.output_tokens == 8
    assert _input_tokens(r.usage) == chat_tokens(HELLO)
    again = client.messages.create(model=MODEL, max_tokens=8, extra_body=GREEDY, messages=HELLO)
    assert again.content[0].text == r.content[0].text  # greedy is deterministic


def test_system_prompt_and_text_blocks(client, chat_tokens):
    system = "Be terse."
    r = client.messages.create(model=MODEL, max_tokens=6, extra_body=GREEDY, system=system, messages=HELLO)
    assert _input_tokens(r.usage) == chat_tokens([{"role": "system", "content": system}, *HELLO])
    assert _input_tokens(r.usage) > chat_tokens(HELLO)
    # The same prompt as lists of text blocks (with cache_control, which is ignored).
    blocks = client.messages.create(
        model=MODEL, max_tokens=6, extra_body=GREEDY,
        system=[{"type": "text", "text": "Be ", "cache_control": {"type": "ephemeral"}},
                {"type": "text", "text": "terse."}],
        messages=[{"role": "user", "content": [{"type": "text", "text": "Hello "}, {"type": "text", "text": "there"}]}],
        metadata={"user_id": "someone"},
    )
    assert blocks.content[0].text == r.content[0].text and blocks.usage.input_tokens + (
        blocks.usage.cache_read_input_tokens or 0) == _input_tokens(r.usage)


def test_prefill_and_consecutive_turns(client):
    plain = client.messages.create(model=MODEL, max_tokens=3, extra_body=GREEDY, messages=HELLO)
    # A final assistant turn is continued, not closed; consecutive user turns are merged into one.
    prefilled = client.messages.create(model=MODEL, max_tokens=3, extra_body=GREEDY, messages=[
        {"role": "user", "content": "Hello"}, {"role": "user", "content": "there"},
        {"role": "assistant", "content": "The answer is"},
    ])
    assert prefilled.stop_reason == "max_tokens" and _input_tokens(prefilled.usage) > _input_tokens(plain.usage)


def test_count_tokens_matches_what_a_message_costs(serve_app_url, client, chat_tokens):
    system = [{"type": "text", "text": "Be terse."}]
    counted = client.messages.count_tokens(model=MODEL, system=system, messages=HELLO)
    assert counted.input_tokens == chat_tokens([{"role": "system", "content": "Be terse."}, *HELLO])
    r = client.messages.create(model=MODEL, max_tokens=2, extra_body=GREEDY, system=system, messages=HELLO)
    assert _input_tokens(r.usage) == counted.input_tokens
    # merged, continued
    prefill = [*HELLO, {"role": "user", "content": "again"}, {"role": "assistant", "content": "Sure"}]
    r = client.messages.create(model=MODEL, max_tokens=2, extra_body=GREEDY, messages=prefill)
    assert client.messages.count_tokens(model=MODEL, messages=prefill).input_tokens == _input_tokens(r.usage)
    assert "model" in _error(httpx.post(serve_app_url + "/v1/messages/count_tokens", json={"messages": HELLO}),
                             400, "invalid_request_error")
    assert "nope" in _error(httpx.post(serve_app_url + "/v1/messages/count_tokens",
                                       json={"model": "nope", "messages": HELLO}),
                            404, "not_found_error")


def test_stream_event_sequence(serve_app_url, client, chat_tokens):
    body = {"model": MODEL, "max_tokens": 10, "temperature": 0, "messages": HELLO, "stream": True}
    events = _raw_events(serve_app_url, body)
    names = [name for name, _ in events]
    assert all(name == data["type"] for name, data in events)
    deltas = names.count("content_block_delta")
    assert deltas >= 1 and names == (["message_start", "content_block_start", "ping"] + ["content_block_delta"] * deltas
                                     + ["content_block_stop", "message_delta", "message_stop"])
    start, delta = events[0][1]["message"], events[-2][1]
    assert start["id"].startswith("msg_") and start["content"] == [] and start["stop_reason"] is None
    assert start["role"] == "assistant" and start["model"] == MODEL
    assert start["usage"]["input_tokens"] + start["usage"]["cache_read_input_tokens"] == chat_tokens(HELLO)
    assert events[1][1] == {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}
    assert all(d["index"] == 0 and d["delta"]["type"] == "text_delta" for n, d in events if n == "content_block_delta")
    assert delta["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
    assert delta["usage"]["output_tokens"] == 10
    text = "".join(d["delta"]["text"] for n, d in events if n == "content_block_delta")
    full = client.messages.create(model=MODEL, max_tokens=10, extra_body=GREEDY, messages=HELLO)
    assert text == full.content[0].text


def test_stream_through_the_sdk(client):
    full = client.messages.create(model=MODEL, max_tokens=8, extra_body=GREEDY, messages=HELLO)
    with client.messages.stream(model=MODEL, max_tokens=8, extra_body=GREEDY, messages=HELLO) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == full.content[0].text == final.content[0].text
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 8
    assert _input_tokens(final.usage) == _input_tokens(full.usage)
    # Raw events (the SDK drops pings).
    types = [e.type for e in client.messages.create(model=MODEL, max_tokens=4, extra_body=GREEDY, messages=HELLO,
                                                    stream=True)]
    assert types[:2] == ["message_start", "content_block_start"] and types[-3:] == [
        "content_block_stop", "message_delta", "message_stop"]
    assert set(types[2:-3]) == {"content_block_delta"}


def test_stop_sequences(client):
    base = client.messages.create(model=MODEL, max_tokens=16, extra_body=GREEDY, messages=HELLO)
    text = base.content[0].text
    stop = next((text[i:i + 4] for i in range(2, len(text) - 4) if text[i:i + 4].strip() == text[i:i + 4]), None)
    assert stop, f"no 4-character stop string in {text!r}"
    r = client.messages.create(model=MODEL, max_tokens=16, extra_body=GREEDY, messages=HELLO,
                               stop_sequences=["zzqx", stop])
    assert r.stop_reason == "stop_sequence" and r.stop_sequence == stop
    assert r.content[0].text == text[: text.index(stop)]
    with client.messages.stream(model=MODEL, max_tokens=16, extra_body=GREEDY, messages=HELLO,
                                stop_sequences=[stop]) as s:
        streamed = "".join(s.text_stream)
        final = s.get_final_message()
    assert streamed == r.content[0].text and final.stop_reason == "stop_sequence" and final.stop_sequence == stop


def test_sampling_fields(client):
    r = client.messages.create(model=MODEL, max_tokens=4, extra_body={"temperature": 0.7, "top_p": 0.9, "top_k": 40},
                               messages=HELLO)
    assert r.usage.output_tokens == 4 and r.stop_reason == "max_tokens"


def _error(r: httpx.Response, status: int, kind: str) -> str:
    assert r.status_code == status, r.text
    body = r.json()
    assert body["type"] == "error" and body["error"]["type"] == kind and set(body["error"]) == {"type", "message"}
    return body["error"]["message"]


@pytest.mark.parametrize("body, status, kind, names", [
    ({"model": MODEL, "messages": HELLO}, 400, "invalid_request_error", "max_tokens"),
    ({"model": MODEL, "max_tokens": 0, "messages": HELLO}, 400, "invalid_request_error", "max_tokens"),
    ({"model": MODEL, "max_tokens": 4, "temperature": 1.5, "messages": HELLO}, 400, "invalid_request_error",
     "temperature"),
    ({"model": "claude-nonexistent", "max_tokens": 4, "messages": HELLO}, 404, "not_found_error", "claude-nonexistent"),
    ({"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
     400, "invalid_request_error", "messages.0.content"),
    ({"model": MODEL, "max_tokens": 4, "messages": [{"role": "system", "content": "x"}]}, 400, "invalid_request_error",
     "messages.0.role"),
    ({"model": MODEL, "max_tokens": 4, "messages": []}, 400, "invalid_request_error", "messages"),
    ({"model": MODEL, "max_tokens": 5000, "messages": HELLO}, 400, "invalid_request_error", "max_tokens"),
    ({"model": MODEL, "max_tokens": 5000, "messages": HELLO, "stream": True}, 400, "invalid_request_error",
     "max_tokens"),
])
def test_errors_in_anthropic_shape(serve_app_url, body, status, kind, names):
    message = _error(httpx.post(serve_app_url + "/v1/messages", json=body), status, kind)
    assert names in message


def test_malformed_json_and_sdk_errors(serve_app_url, client):
    r = httpx.post(serve_app_url + "/v1/messages", content=b'{"model": "x", "max_tokens": ',
                   headers={"content-type": "application/json"})
    assert "JSON" in _error(r, 400, "invalid_request_error")
    with pytest.raises(anthropic.NotFoundError) as e:
        client.messages.create(model="nope", max_tokens=4, messages=HELLO)
    assert e.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.BadRequestError):
        client.messages.create(model=MODEL, max_tokens=4, messages=HELLO, stop_sequences=[""])


def test_deployment_handle(serve_app_url):
    from ray import serve

    from serve_app.protocol.anthropic import MessagesResponse

    handle = serve.get_app_handle("pagedserve").options(stream=True)
    body = {"model": MODEL, "max_tokens": 3, "temperature": 0, "messages": HELLO}
    [message] = list(handle.messages.remote(body))
    assert isinstance(message, MessagesResponse) and message.usage.output_tokens == 3
    events = list(handle.messages.remote({**body, "stream": True}))
    assert events[0][0] == "message_start" and events[-1] == ("message_stop", {"type": "message_stop"})
    assert "".join(d["delta"]["text"] for n, d in events if n == "content_block_delta") == message.content[0].text


def test_openapi_describes_messages(serve_app_url):
    spec = httpx.get(serve_app_url + "/openapi.json").json()
    post = spec["paths"]["/v1/messages"]["post"]
    assert post["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith("/MessagesRequest")
    assert "max_tokens" in spec["components"]["schemas"]["MessagesRequest"]["required"]


def test_openapi_requires_the_type_of_a_text_block(serve_app_url):
    # Found by benchmarks/fuzz.py: the schema called a block's `type` optional, the route rejects a block
    # without it (as Anthropic does); the schema now says so.
    spec = httpx.get(serve_app_url + "/openapi.json").json()
    assert spec["components"]["schemas"]["TextBlockParam"]["required"] == ["type", "text"]
    body = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": [{"text": "hi"}]}]}
    assert "messages.0.content" in _error(httpx.post(serve_app_url + "/v1/messages", json=body), 400,
                                          "invalid_request_error")


def test_disconnect_mid_stream_aborts(serve_app_url, engine_handle):
    from tests.serve_app.conftest import wait_for

    def idle() -> bool:
        return all(s.num_running == 0 and s.num_waiting == 0 for s in engine_handle.broadcast("stats").results())

    def generated() -> int:
        return sum(s.generation_tokens for s in engine_handle.broadcast("stats").results())

    wait_for(idle)
    before = generated()
    body = {"model": MODEL, "max_tokens": 900, "messages": HELLO, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", serve_app_url + "/v1/messages", json=body, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line == "event: content_block_delta":
                break
    wait_for(idle, timeout=20)  # the closed connection aborted the request...
    assert generated() - before < 900  # ...well before its 900 tokens


# --- tool use ------------------------------------------------------------------------------------------

WEATHER = {"name": "get_weather", "description": "The weather in a city.", "input_schema": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"]}}
TIME = {"name": "get_time", "description": "The time in a zone.", "input_schema": {
    "type": "object", "properties": {"zone": {"type": "string", "maxLength": 8}}, "required": ["zone"]}}
SCHEMAS = {t["name"]: t["input_schema"] for t in (WEATHER, TIME)}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def _valid_call(block) -> None:
    import jsonschema

    assert block.type == "tool_use" and block.id.startswith("toolu_") and block.name in SCHEMAS
    jsonschema.validate(block.input, SCHEMAS[block.name])


def test_forced_tool_use(client):
    r = client.messages.create(model=MODEL, max_tokens=120, extra_body=GREEDY, messages=ASK, tools=[WEATHER, TIME],
                               tool_choice={"type": "tool", "name": "get_weather"})
    assert r.stop_reason == "tool_use" and [b.type for b in r.content] == ["tool_use"]
    assert r.content[0].name == "get_weather"
    _valid_call(r.content[0])


def test_any_tool_single_call(client):
    r = client.messages.create(model=MODEL, max_tokens=160, extra_body=GREEDY, messages=ASK, tools=[WEATHER, TIME],
                               tool_choice={"type": "any", "disable_parallel_tool_use": True})
    assert r.stop_reason == "tool_use" and [b.type for b in r.content] == ["tool_use"]
    _valid_call(r.content[0])


def test_tool_choice_none_and_auto_answer_in_text(client):
    for choice in ({"type": "none"}, {"type": "auto"}):
        r = client.messages.create(model=MODEL, max_tokens=6, extra_body=GREEDY, messages=ASK, tools=[WEATHER],
                                   tool_choice=choice)
        assert r.stop_reason == "max_tokens" and [b.type for b in r.content] == ["text"]  # random weights make no call


def test_tool_use_streamed(serve_app_url, client):
    kwargs = dict(model=MODEL, max_tokens=120, extra_body=GREEDY, messages=ASK, tools=[WEATHER],
                  tool_choice={"type": "tool", "name": "get_weather"})
    whole = client.messages.create(**kwargs)
    with client.messages.stream(**kwargs) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use" and [b.type for b in final.content] == ["tool_use"]
    assert final.content[0].input == whole.content[0].input and final.content[0].name == "get_weather"
    events = _raw_events(serve_app_url, {**{k: v for k, v in kwargs.items() if k != "extra_body"}, **GREEDY,
                                         "stream": True})
    names = [n for n, _ in events]
    deltas = names.count("content_block_delta")
    assert deltas >= 2 and names == (["message_start", "ping", "content_block_start"] + ["content_block_delta"] * deltas
                                     + ["content_block_stop", "message_delta", "message_stop"])
    start = events[2][1]["content_block"]
    assert start["type"] == "tool_use" and start["name"] == "get_weather" and start["input"] == {}
    assert start["id"].startswith("toolu_")
    partial = "".join(d["delta"]["partial_json"] for n, d in events if n == "content_block_delta")
    assert all(d["delta"]["type"] == "input_json_delta" for n, d in events if n == "content_block_delta")
    assert json.loads(partial) == whole.content[0].input
    assert events[-2][1]["delta"]["stop_reason"] == "tool_use"


def test_two_turns_with_a_tool_result(client):
    tools, choice = [WEATHER], {"type": "tool", "name": "get_weather"}
    first = client.messages.create(model=MODEL, max_tokens=120, extra_body=GREEDY, messages=ASK, tools=tools,
                                   tool_choice=choice)
    call = first.content[0]
    _valid_call(call)

    def conversation(result: str) -> list[dict]:
        return [*ASK, {"role": "assistant", "content": [b.model_dump() for b in first.content]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": result}]}]

    messages = conversation("18 degrees and sunny")
    second = client.messages.create(model=MODEL, max_tokens=8, extra_body=GREEDY, messages=messages, tools=tools)
    assert second.stop_reason == "max_tokens" and second.content[0].type == "text"
    counted = client.messages.count_tokens(model=MODEL, messages=messages, tools=tools).input_tokens
    assert _input_tokens(second.usage) == counted
    # The result and the call are in the prompt: a longer result costs more, and so does the turn.
    longer = client.messages.count_tokens(model=MODEL, messages=conversation("18 degrees, sunny, a light breeze"),
                                          tools=tools).input_tokens
    assert longer > counted > client.messages.count_tokens(model=MODEL, messages=ASK, tools=tools).input_tokens


def test_count_tokens_counts_tools(client):
    bare = client.messages.count_tokens(model=MODEL, messages=ASK).input_tokens
    one = client.messages.count_tokens(model=MODEL, messages=ASK, tools=[WEATHER]).input_tokens
    two = client.messages.count_tokens(model=MODEL, messages=ASK, tools=[WEATHER, TIME]).input_tokens
    assert bare < one < two
    r = client.messages.create(model=MODEL, max_tokens=2, extra_body=GREEDY, messages=ASK, tools=[WEATHER, TIME])
    assert _input_tokens(r.usage) == two


@pytest.mark.parametrize("extra, names", [
    ({"tools": [WEATHER], "tool_choice": {"type": "tool", "name": "nope"}}, "tool_choice"),
    ({"tool_choice": {"type": "any"}}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "tool"}}, "tool_choice"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools.0.type"),
    ({"tools": [{"name": "f", "input_schema": {"type": "string"}}]}, "tools.0.input_schema"),
    ({"tools": [{"name": "f", "input_schema": {"type": "object", "properties": 3}}]}, "tools.0.input_schema"),
    ({"tools": [{"name": "bad name", "input_schema": {"type": "object"}}]}, "tools.0.name"),
    ({"tools": [WEATHER, WEATHER]}, "tools"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "x", "name": "f", "input": {}}]}]},
     "messages.0.content"),
    ({"messages": [*ASK, {"role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "x"}]}]},
     "messages.1.content"),
    ({"messages": [*ASK, {"role": "assistant", "content": [{"type": "tool_use", "id": "x", "name": "f"}]}]},
     "messages.1.content"),
    ({"messages": [*ASK, {"role": "assistant",
                          "content": [{"type": "tool_use", "id": "x", "name": "f", "input": {}}]}]},
     "messages"),
])
def test_tool_errors(serve_app_url, extra, names):
    body = {"model": MODEL, "max_tokens": 4, "messages": ASK, **extra}
    for path in ("/v1/messages", "/v1/messages/count_tokens"):
        message = _error(httpx.post(serve_app_url + path, json=body), 400, "invalid_request_error")
        assert names in message, message
