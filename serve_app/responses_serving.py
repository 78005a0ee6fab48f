"""The OpenAI Responses API (`POST /v1/responses`, `GET` and `DELETE /v1/responses/{id}`) on top of the chat
route, as the Anthropic route is (serve_app/anthropic_serving.py): a Responses request becomes the equivalent
ChatCompletionRequest, so validation, tool calling (a forced function constrains generation to its schema),
structured outputs, reasoning (Harmony's analysis channel) and the engine path are exactly the chat route's.

- `input` (a string, or items: messages with input_text / input_image / output_text parts, function_call and
  function_call_output items; reasoning items are dropped, as chat templates take no reasoning back) and
  `instructions` become chat messages; `previous_response_id` puts the stored conversation first (the earlier
  response's own instructions are not carried over, as OpenAI documents).
- Output items: a reasoning item, a message with output_text, a function_call per tool call; streamed as the
  event sequence the openai SDK's `responses.stream` assembles, with sequence numbers.
- `store` (default true) keeps the response and its conversation in the app's bounded store
  (serve_app/response_store.py), shared by every replica serving HTTP."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from fastapi import FastAPI

from serve_app.errors import APIError, from_exception
from serve_app.http_api import json_response
from serve_app.openai_serving import OpenAIServing, tokenize_off_loop_if_large
from serve_app.protocol.openai import ChatCompletionRequest, ChatCompletionResponse, Usage, new_id
from serve_app.protocol.responses import (
    DeletedResponse,
    FunctionCall,
    IncompleteDetails,
    InputTokensDetails,
    OutputMessage,
    OutputText,
    OutputTokensDetails,
    ReasoningItem,
    ReasoningText,
    Response,
    ResponsesRequest,
    ResponseUsage,
    new_item_id,
)
from serve_app.sse import sse_event, sse_response, sse_stream

Event = tuple[str, dict]
_INCLUDABLE = frozenset({"message.output_text.logprobs", "reasoning.encrypted_content"})
# reasoning.effort as a thinking budget in tokens (the engine then forces the end of thinking): "none" thinks not
# at all; the others scale as OpenAI's efforts do, from a short thought to a long one.
EFFORT_BUDGETS = {"none": 0, "minimal": 256, "low": 1024, "medium": 4096, "high": 16384, "xhigh": 32768}


def _refuse(param: str, message: str) -> APIError:
    return APIError(400, f"{param}: {message}", param=param, code="unsupported_parameter")


def _check(req: ResponsesRequest) -> None:
    """What this server does not do, refused by name rather than ignored."""
    if req.background:
        raise _refuse("background", "background responses are not supported; stream the response instead")
    if req.conversation is not None:
        raise _refuse("conversation", "conversations are not supported; chain responses with previous_response_id")
    for i, tool in enumerate(req.tools or []):
        if tool.type != "function":
            raise _refuse(f"tools.{i}.type", f"{tool.type!r} is one of OpenAI's hosted tools; only function tools "
                          "are served")
        if not tool.name:
            raise APIError(400, f"tools.{i}.name: a function tool needs a name", param=f"tools.{i}.name")
    for i, name in enumerate(req.include or []):
        if name not in _INCLUDABLE:
            raise _refuse(f"include.{i}", f"{name!r} cannot be included; supported: {', '.join(sorted(_INCLUDABLE))}")


def _message_content(content, where: str) -> str | list[dict]:
    """A Responses message's content as a chat message's: text, or OpenAI chat parts where images are in it."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(400, f"{where}: content must be a string or a list of parts", param=where)
    parts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text", "text"):
            parts.append({"type": "text", "text": part.get("text", "")})
        elif kind == "input_image":
            url = part.get("image_url")
            if not isinstance(url, str):
                raise _refuse(f"{where}.{j}.image_url", "give the image as image_url (a data: or http(s) URL); "
                              "file_id images are not served")
            parts.append({"type": "image_url", "image_url": {"url": url}})
        else:
            raise _refuse(f"{where}.{j}.type", f"content parts of type {kind!r} are not supported")
    if all(p["type"] == "text" for p in parts):
        return "".join(p["text"] for p in parts)
    return parts


def input_messages(req: ResponsesRequest) -> list[dict]:
    """The request's `input` as chat messages (without instructions or an earlier response's conversation)."""
    if isinstance(req.input, str):
        return [{"role": "user", "content": req.input}]
    messages: list[dict] = []
    for i, item in enumerate(req.input):
        where = f"input.{i}"
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise APIError(400, f"{where}.role: must be user, system, developer or assistant",
                               param=f"{where}.role")
            messages.append({"role": role, "content": _message_content(item.get("content"), f"{where}.content")})
        elif kind == "function_call":
            call = {"id": item.get("call_id"), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments", "{}")}}
            if messages and messages[-1]["role"] == "assistant" and messages[-1].get("tool_calls"):
                messages[-1]["tool_calls"].append(call)  # a turn's parallel calls: one assistant message
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            messages.append({"role": "tool", "tool_call_id": item.get("call_id"),
                             "content": output if isinstance(output, str) else json.dumps(output)})
        elif kind == "reasoning":
            continue  # chat templates take no reasoning back
        else:
            raise _refuse(f"{where}.type", f"input items of type {kind!r} are not supported")
    return messages


def thinking_budget(req: ResponsesRequest, reasons: bool) -> int | None:
    """The thinking budget `reasoning.effort` asks of a model that `reasons` (served with a reasoning_parser)."""
    effort = req.reasoning.effort if req.reasoning is not None else None
    if effort is None or (effort == "none" and not reasons):
        return None
    if not reasons:
        raise _refuse("reasoning.effort", "this model is served without a reasoning_parser (app args), so it does not "
                      "reason; leave reasoning.effort unset")
    return EFFORT_BUDGETS[effort]


def chat_request(req: ResponsesRequest, history: list[dict], budget: int | None = None) -> ChatCompletionRequest:
    messages = ([{"role": "system", "content": req.instructions}] if req.instructions else []) + history
    fields: dict = {"messages": messages + input_messages(req), "model": req.model, "temperature": req.temperature,
                    "top_p": req.top_p, "max_completion_tokens": req.max_output_tokens, "user": req.user,
                    "thinking_token_budget": budget,
                    "parallel_tool_calls": req.parallel_tool_calls, "stream": req.stream,
                    "stream_options": {"include_usage": True} if req.stream else None}
    if req.tools:
        fields["tools"] = [{"type": "function", "function": {"name": t.name, "description": t.description,
                                                             "parameters": t.parameters, "strict": t.strict}}
                           for t in req.tools]
    choice = req.tool_choice
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise _refuse("tool_choice", "a named choice is {\"type\": \"function\", \"name\": ...}")
        fields["tool_choice"] = {"type": "function", "function": {"name": choice["name"]}}
    elif choice is not None:
        fields["tool_choice"] = choice
    fmt = req.text.format if req.text is not None else None
    forced = choice == "required" or isinstance(choice, dict)
    # text.format shapes the output's text; a forced call makes no text (OpenAI takes both, as the Agents SDK
    # sends them with an output type), where the chat route refuses response_format beside a forced call.
    if fmt is not None and fmt.type != "text" and not forced:
        fields["response_format"] = ({"type": "json_object"} if fmt.type == "json_object" else
                                     {"type": "json_schema", "json_schema": {"name": fmt.name or "response",
                                                                             "schema": fmt.schema_,
                                                                             "strict": fmt.strict}})
    try:
        return ChatCompletionRequest.model_validate(fields)
    except ValueError as e:
        raise from_exception(e) from e


def _usage(usage: Usage | None) -> ResponseUsage | None:
    if usage is None:
        return None
    cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0
    return ResponseUsage(input_tokens=usage.prompt_tokens,
                         input_tokens_details=InputTokensDetails(cached_tokens=cached),
                         output_tokens=usage.completion_tokens, output_tokens_details=OutputTokensDetails(),
                         total_tokens=usage.total_tokens)


async def _chained(first, rest: AsyncIterator) -> AsyncIterator:
    if first is not None:
        yield first
        async for item in rest:
            yield item


def _assistant_turn(output: list) -> list[dict]:
    """The response's output as the chat messages a later `previous_response_id` continues after."""
    text = "".join(p.text for item in output if isinstance(item, OutputMessage) for p in item.content)
    calls = [{"id": item.call_id, "type": "function", "function": {"name": item.name, "arguments": item.arguments}}
             for item in output if isinstance(item, FunctionCall)]
    return [{"role": "assistant", "content": text, **({"tool_calls": calls} if calls else {})}]


@dataclass
class _Stream:
    """The Responses events for a chat stream: items opened and closed as the deltas change kind."""

    response: Response
    sequence: int = 0
    reasoning: ReasoningItem | None = None
    message: OutputMessage | None = None
    calls: dict[int, FunctionCall] = field(default_factory=dict)  # by the chat delta's tool call index
    open_call: int | None = None

    def event(self, kind: str, **data) -> Event:
        self.sequence += 1
        return kind, {"type": kind, "sequence_number": self.sequence - 1, **data}

    def _index(self, item) -> int:
        return self.response.output.index(item)

    def close(self) -> list[Event]:
        events: list[Event] = []
        if self.reasoning is not None:
            item, self.reasoning = self.reasoning, None
            item.status = "completed"
            events += [self.event("response.reasoning_text.done", item_id=item.id, output_index=self._index(item),
                                  content_index=0, text=item.content[0].text),
                       self.event("response.output_item.done", output_index=self._index(item),
                                  item=item.model_dump())]
        if self.message is not None:
            item, self.message = self.message, None
            item.status = "completed"
            part = item.content[0]
            where = dict(item_id=item.id, output_index=self._index(item), content_index=0)
            events += [self.event("response.output_text.done", **where, text=part.text, logprobs=[]),
                       self.event("response.content_part.done", **where, part=part.model_dump()),
                       self.event("response.output_item.done", output_index=self._index(item),
                                  item=item.model_dump())]
        if self.open_call is not None:
            item, self.open_call = self.calls[self.open_call], None
            item.status = "completed"
            events += [self.event("response.function_call_arguments.done", item_id=item.id,
                                  output_index=self._index(item), arguments=item.arguments),
                       self.event("response.output_item.done", output_index=self._index(item),
                                  item=item.model_dump())]
        return events

    def reasoning_delta(self, text: str) -> list[Event]:
        events = [] if self.reasoning is not None else self.close()
        if self.reasoning is None:
            self.reasoning = ReasoningItem(id=new_item_id("rs"), status="in_progress", content=[ReasoningText(text="")])
            self.response.output.append(self.reasoning)
            events.append(self.event("response.output_item.added", output_index=self._index(self.reasoning),
                                     item=self.reasoning.model_dump()))
        self.reasoning.content[0].text += text
        return events + [self.event("response.reasoning_text.delta", item_id=self.reasoning.id,
                                    output_index=self._index(self.reasoning), content_index=0, delta=text)]

    def text_delta(self, text: str) -> list[Event]:
        events = [] if self.message is not None else self.close()
        if self.message is None:
            self.message = OutputMessage(id=new_item_id("msg"), status="in_progress")
            self.response.output.append(self.message)
            index = self._index(self.message)
            events.append(self.event("response.output_item.added", output_index=index, item=self.message.model_dump()))
            self.message.content.append(OutputText(text=""))
            events.append(self.event("response.content_part.added", item_id=self.message.id, output_index=index,
                                     content_index=0, part=self.message.content[0].model_dump()))
        self.message.content[0].text += text
        return events + [self.event("response.output_text.delta", item_id=self.message.id,
                                    output_index=self._index(self.message), content_index=0, delta=text, logprobs=[])]

    def call_delta(self, index: int, call_id: str | None, name: str | None, arguments: str | None) -> list[Event]:
        events: list[Event] = []
        if index not in self.calls:
            events += self.close()
            item = FunctionCall(id=new_item_id("fc"), call_id=call_id or new_id("call"), name=name or "",
                                arguments="", status="in_progress")
            self.calls[index], self.open_call = item, index
            self.response.output.append(item)
            events.append(self.event("response.output_item.added", output_index=self._index(item),
                                     item=item.model_dump()))
        item = self.calls[index]
        if arguments:
            item.arguments += arguments
            events.append(self.event("response.function_call_arguments.delta", item_id=item.id,
                                     output_index=self._index(item), delta=arguments))
        return events


class ResponsesServing:
    def __init__(self, openai: OpenAIServing, store_factory) -> None:
        """`store_factory()`: the app's ResponseStore actor handle, made on first use."""
        self.openai = openai
        self._store_factory = store_factory
        self._store = None

    @property
    def store(self):
        if self._store is None:
            self._store = self._store_factory()
        return self._store

    async def _history(self, req: ResponsesRequest) -> list[dict]:
        if req.previous_response_id is None:
            return []
        stored = await self.store.get.remote(req.previous_response_id)
        if stored is None:
            raise APIError(404, f"previous_response_id: no stored response {req.previous_response_id!r} (never "
                           "stored, deleted, or evicted from the store)", param="previous_response_id",
                           code="response_not_found")
        return json.loads(stored[1])

    def _response(self, req: ResponsesRequest, response_id: str) -> Response:
        return Response(id=response_id, model=req.model or self.openai.model_name, status="in_progress",
                        instructions=req.instructions, parallel_tool_calls=req.parallel_tool_calls,
                        tool_choice=req.tool_choice or "auto",
                        tools=[t.model_dump(exclude_none=True, by_alias=True) for t in req.tools or []],
                        temperature=req.temperature, top_p=req.top_p, max_output_tokens=req.max_output_tokens,
                        previous_response_id=req.previous_response_id,
                        reasoning=req.reasoning.model_dump() if req.reasoning else None,
                        text=req.text.model_dump(by_alias=True) if req.text else {"format": {"type": "text"}},
                        metadata=req.metadata, store=req.store, user=req.user)

    async def _finish(self, response: Response, finish_reason: str | None, conversation: list[dict]) -> None:
        response.completed_at = time.time()
        reasoning = "".join(part.text for item in response.output if isinstance(item, ReasoningItem)
                            for part in item.content)
        if reasoning and response.usage is not None:  # the text's own tokens: the engine counts no phases
            response.usage.output_tokens_details.reasoning_tokens = len(await tokenize_off_loop_if_large(
                len(reasoning), self.openai.tokenizer.encode, reasoning, add_special_tokens=False))
        response.status = "incomplete" if finish_reason == "length" else "completed"
        if finish_reason == "length":
            response.incomplete_details = IncompleteDetails(reason="max_output_tokens")
        if response.store:
            await self.store.put.remote(response.id, response.model_dump_json(),
                                        json.dumps(conversation + _assistant_turn(response.output)))

    async def create(self, req: ResponsesRequest) -> Response | AsyncIterator[Event]:
        _check(req)
        budget = thinking_budget(req, self.openai.thinking_tags is not None)
        history = await self._history(req)
        chat = chat_request(req, history, budget)
        conversation = chat.model_dump(exclude_none=True)["messages"]
        if req.instructions:
            conversation = conversation[1:]  # instructions are not carried to the next response
        response = self._response(req, new_item_id("resp"))
        result = await self.openai.chat(chat)
        if req.stream:
            # The engine's first output before any event: errors up to it (overload) keep their HTTP status.
            first = await anext(result, None)
            return self._stream(response, _chained(first, result), conversation)
        assert isinstance(result, ChatCompletionResponse)
        choice = result.choices[0]
        message = choice.message
        if message.reasoning:
            response.output.append(ReasoningItem(id=new_item_id("rs"), content=[ReasoningText(text=message.reasoning)]))
        if message.content:
            response.output.append(OutputMessage(id=new_item_id("msg"), content=[OutputText(text=message.content)]))
        for call in message.tool_calls or []:
            response.output.append(FunctionCall(id=new_item_id("fc"), call_id=call.id, name=call.function.name,
                                                arguments=call.function.arguments))
        response.usage = _usage(result.usage)
        await self._finish(response, choice.finish_reason, conversation)
        return response

    async def _stream(self, response: Response, chunks, conversation: list[dict]) -> AsyncIterator[Event]:
        state = _Stream(response)
        yield state.event("response.created", response=response.model_dump())
        yield state.event("response.in_progress", response=response.model_dump())
        finish_reason = None
        async for chunk in chunks:
            if chunk.usage is not None:
                response.usage = _usage(chunk.usage)
            for choice in chunk.choices:
                delta = choice.delta
                if delta.reasoning:
                    for e in state.reasoning_delta(delta.reasoning):
                        yield e
                if delta.content:
                    for e in state.text_delta(delta.content):
                        yield e
                for call in delta.tool_calls or []:
                    function = call.function
                    for e in state.call_delta(call.index, call.id, function.name if function else None,
                                              function.arguments if function else None):
                        yield e
                finish_reason = choice.finish_reason or finish_reason
        for e in state.close():
            yield e
        await self._finish(response, finish_reason, conversation)
        kind = "response.incomplete" if response.status == "incomplete" else "response.completed"
        yield state.event(kind, response=response.model_dump())

    async def retrieve(self, response_id: str) -> Response:
        stored = await self.store.get.remote(response_id)
        if stored is None:
            raise APIError(404, f"response_id: no stored response {response_id!r}", param="response_id",
                           code="response_not_found")
        return Response.model_validate_json(stored[0])

    async def delete(self, response_id: str) -> DeletedResponse:
        if not await self.store.delete.remote(response_id):
            raise APIError(404, f"response_id: no stored response {response_id!r}", param="response_id",
                           code="response_not_found")
        return DeletedResponse(id=response_id)


def add_routes(app: FastAPI, serving: ResponsesServing) -> None:
    @app.post("/v1/responses", response_model=Response, summary="OpenAI Responses API (server-sent events when "
              "stream=true)")
    async def create_response(body: ResponsesRequest):
        result = await serving.create(body)
        if body.stream:
            return sse_response(sse_stream(result, lambda error: sse_event(
                {"type": "error", "code": error.code, "message": error.message, "param": error.param}, "error")))
        return json_response(result)

    @app.get("/v1/responses/{response_id}", response_model=Response, summary="A stored response")
    async def get_response(response_id: str):
        return json_response(await serving.retrieve(response_id))

    @app.delete("/v1/responses/{response_id}", response_model=DeletedResponse, summary="Delete a stored response")
    async def delete_response(response_id: str):
        return json_response(await serving.delete(response_id))
