"""The OpenAI Responses API (`/v1/responses`) through the official `openai` SDK against the running app: each
input form gives the chat route's tokens; a stream's deltas join to its final text; a forced function tool
gives schema-valid arguments and a function_call_output turn continues it; text.format json_schema; stored
responses are continued, retrieved and deleted; what is not served is refused by name."""

from __future__ import annotations

import json
from typing import Literal

import openai
import pytest

from serve_app.response_store import ResponseStore, StoreLimits

MODEL = "pagedserve-tiny"
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city.", "strict": True,
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                            "days": {"type": "integer", "minimum": 1,
                                                                     "maximum": 7}},
                          "required": ["city", "days"], "additionalProperties": False}}


@pytest.fixture(scope="module")
def client(serve_app_url) -> openai.OpenAI:
    return openai.OpenAI(base_url=serve_app_url + "/v1", api_key="unused", max_retries=0, timeout=60)


def test_each_input_form_gives_the_chat_routes_tokens(client):
    chat = client.chat.completions.create(model=MODEL, temperature=0, max_tokens=8, messages=[
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}])
    expected = chat.choices[0].message.content
    by_string = client.responses.create(model=MODEL, instructions="Be brief.", input="Hello there", temperature=0,
                                        max_output_tokens=8)
    by_items = client.responses.create(model=MODEL, temperature=0, max_output_tokens=8, input=[
        {"role": "system", "content": "Be brief."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hello "},
                                                         {"type": "input_text", "text": "there"}]}])
    assert by_string.output_text == by_items.output_text == expected
    assert by_string.id.startswith("resp_") and by_string.object == "response"
    assert by_string.usage.input_tokens == chat.usage.prompt_tokens
    assert by_string.usage.output_tokens == chat.usage.completion_tokens
    assert by_string.usage.total_tokens == by_string.usage.input_tokens + by_string.usage.output_tokens
    if chat.choices[0].finish_reason == "length":
        assert by_string.status == "incomplete" and by_string.incomplete_details.reason == "max_output_tokens"
    else:
        assert by_string.status == "completed"


def test_a_stream_joins_to_its_final_response(client):
    with client.responses.stream(model=MODEL, input="Tell me a story", temperature=0, max_output_tokens=12) as stream:
        events = list(stream)
    final = events[-1].response  # response.completed, or response.incomplete (get_final_response takes only the first)
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas and deltas == final.output_text
    done = next(e for e in events if e.type == "response.output_text.done")
    assert done.text == deltas
    unstreamed = client.responses.create(model=MODEL, input="Tell me a story", temperature=0, max_output_tokens=12)
    assert unstreamed.output_text == final.output_text


def test_a_forced_function_tool_then_its_output(client):
    first = client.responses.create(model=MODEL, input="What is the weather in Paris?", tools=[WEATHER],
                                    tool_choice={"type": "function", "name": "get_weather"}, temperature=0,
                                    max_output_tokens=64)
    calls = [item for item in first.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather"
    arguments = json.loads(calls[0].arguments)
    assert set(arguments) == {"city", "days"} and isinstance(arguments["city"], str)
    assert len(arguments["city"]) <= 12 and 1 <= arguments["days"] <= 7
    second = client.responses.create(model=MODEL, previous_response_id=first.id, tools=[WEATHER], temperature=0,
                                     max_output_tokens=8, tool_choice="none", input=[
                                         {"type": "function_call_output", "call_id": calls[0].call_id,
                                          "output": "Sunny, 24 C"}])
    assert second.previous_response_id == first.id and second.output_text
    # The second prompt holds the first exchange: its question, the call, and the call's output.
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens


def test_a_streamed_function_call(client):
    with client.responses.stream(model=MODEL, input="Weather in Rome?", tools=[WEATHER], tool_choice="required",
                                 parallel_tool_calls=False, temperature=0, max_output_tokens=64) as stream:
        events = list(stream)
    final = events[-1].response
    call = next(item for item in final.output if item.type == "function_call")
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert deltas == call.arguments and set(json.loads(call.arguments)) == {"city", "days"}


def test_text_format_json_schema(client):
    schema = {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 10}},
              "required": ["answer"], "additionalProperties": False}
    r = client.responses.create(model=MODEL, input="Answer in JSON", temperature=0, max_output_tokens=48,
                                text={"format": {"type": "json_schema", "name": "reply", "schema": schema,
                                                 "strict": True}})
    assert set(json.loads(r.output_text)) == {"answer"}


def test_stored_responses_are_retrieved_continued_and_deleted(client):
    first = client.responses.create(model=MODEL, input="Remember the number 7.", temperature=0, max_output_tokens=4,
                                    metadata={"ticket": "42"})
    again = client.responses.retrieve(first.id)
    assert again.output_text == first.output_text and again.metadata == {"ticket": "42"}
    unstored = client.responses.create(model=MODEL, input="Not kept", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError) as error:
        client.responses.create(model=MODEL, input="And then?", previous_response_id=first.id)
    assert error.value.body["param"] == "previous_response_id"


@pytest.mark.parametrize("body, param", [
    ({"tools": [{"type": "web_search"}]}, "tools.0.type"),
    ({"background": True}, "background"),
    ({"reasoning": {"effort": "high"}}, "reasoning.effort"),
    ({"include": ["file_search_call.results"]}, "include.0"),
    ({"input": [{"type": "computer_call_output"}]}, "input.0.type"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]}, "input.0.content.0.type"),
])
def test_what_is_not_served_is_refused_by_name(client, body, param):
    with pytest.raises(openai.BadRequestError) as error:
        client.responses.create(**{"model": MODEL, "input": "hi", **body})
    assert error.value.body["param"] == param


def test_the_store_is_bounded_by_entries_bytes_and_age():
    now = [0.0]
    store = ResponseStore(StoreLimits(max_entries=3, max_bytes=100, ttl_s=10), clock=lambda: now[0])
    for i in range(4):
        store.put(f"r{i}", "x" * 10, "[]")
    assert store.get("r0") is None and len(store) == 3  # the least recently used went first
    store.get("r1")  # used: r2 is now the oldest
    store.put("r4", "y" * 10, "[]")
    assert store.get("r2") is None and store.get("r1") is not None
    store.put("big", "z" * 80, "[]")  # over 100 bytes with the others: they go, least recently used first
    assert store.num_bytes <= 100 and store.get("big") is not None
    store.put("huge", "z" * 200, "[]")  # larger than the whole store: never kept
    assert store.get("huge") is None
    now[0] = 11.0
    assert store.get("big") is None and len(store) == 0  # expired
    assert store.delete("big") is False


def test_an_openai_agents_sdk_agent_runs_its_function_tool(serve_app_url):
    """The OpenAI Agents SDK's Agent on its default model class (OpenAIResponsesModel, the Responses API):
    the tool is forced on the first turn (the random-weight model would not choose it), runs with valid
    arguments, and the run ends with the model's answer after the tool's output. The tool's argument and the
    output type are enums, so that random weights finish each turn: the SDK treats a response cut at
    max_output_tokens as a failure."""
    from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled
    from pydantic import BaseModel

    class Answer(BaseModel):
        weather: Literal["sunny", "rainy"]

    set_tracing_disabled(True)  # traces would go to OpenAI's servers
    cities: list[str] = []

    @function_tool
    def get_weather(city: Literal["Paris", "Rome", "Tokyo"]) -> str:
        """The weather in a city."""
        cities.append(city)
        return f"Sunny in {city}"

    client = openai.AsyncOpenAI(base_url=serve_app_url + "/v1", api_key="unused", max_retries=0, timeout=60)
    agent = Agent(name="weather", instructions="Answer with the weather tool.", tools=[get_weather], output_type=Answer,
                  model=OpenAIResponsesModel(model=MODEL, openai_client=client),
                  model_settings=ModelSettings(tool_choice="required", parallel_tool_calls=False, temperature=0,
                                               max_tokens=64))
    result = Runner.run_sync(agent, "What is the weather in Paris?", max_turns=3)
    assert len(cities) == 1 and cities[0] in ("Paris", "Rome", "Tokyo")
    assert isinstance(result.final_output, Answer)


def test_a_deployment_handle_caller_gets_responses(serve_app_url):
    from ray import serve

    from serve_app.protocol.responses import Response, ResponsesRequest
    from tests.serve_app.conftest import APP

    handle = serve.get_app_handle(APP).options(stream=True)
    request = ResponsesRequest(input="Hi", max_output_tokens=4, temperature=0)
    [response] = list(handle.responses.remote(request))
    assert isinstance(response, Response) and response.usage.output_tokens <= 4
    events = list(handle.responses.remote(request.model_copy(update={"stream": True})))
    assert events[0][0] == "response.created"
    streamed = Response.model_validate(events[-1][1]["response"])
    assert streamed.output_text == response.output_text and streamed.usage == response.usage
