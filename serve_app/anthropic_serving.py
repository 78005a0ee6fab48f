"""The Anthropic Messages routes (`POST /v1/messages`, `/v1/messages/count_tokens`): their logic on top
of OpenAIServing (the same processor, chat template, sampling-parameter checks, PreparedRequests and
engine streams), and their HTTP routes with Anthropic's server-sent events.

An Anthropic request becomes the equivalent ChatCompletionRequest (the system prompt as a "system"
message first), so validation, the context-length checks and the engine path are exactly the chat
route's. Anthropic-specific behaviour: consecutive turns of one role are merged into one turn (as
Anthropic documents), a final assistant turn is a prefill the answer continues, stop sequences are
never part of the text, and `usage.input_tokens` counts the prompt tokens not read from the prefix
cache (`cache_read_input_tokens` the rest), as Anthropic counts them.

Tool use: `tools` (name, description, input_schema) become the chat route's function tools and
`tool_choice` its tool_choice (auto, any = "required", tool = a named function, none;
disable_parallel_tool_use = parallel_tool_calls false), so a forced tool constrains generation to its
input schema exactly as on the OpenAI route (serve_app/chat_tools.py). The calls come back as `tool_use`
blocks with stop_reason "tool_use"; streamed, each is a content block whose input arrives as
`input_json_delta` events. `tool_use` and `tool_result` blocks in the conversation reach the chat
template as assistant `tool_calls` and `tool` messages."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from fastapi import FastAPI

from engine.outputs import CompletionOutput, RequestOutput
from engine.sampling_params import RequestOutputKind
from serve_app.chat_tools import ChoiceTools, plan_tools
from serve_app.errors import APIError, from_exception
from serve_app.http_api import json_response
from serve_app.openai_serving import OpenAIServing, UsageTally
from serve_app.protocol.anthropic import (
    AnthropicErrorResponse,
    Conversation,
    ImageBlockParam,
    MessageParam,
    MessagesRequest,
    MessagesResponse,
    MessagesUsage,
    MessageTokensCount,
    StopReason,
    TextBlock,
    TextBlockParam,
    ThinkingBlock,
    ToolResultBlockParam,
    ToolUseBlock,
    ToolUseBlockParam,
    new_message_id,
    new_tool_use_id,
)
from serve_app.protocol.openai import ChatCompletionRequest, DeltaToolCall, ToolCall
from serve_app.sse import sse_event, sse_response, sse_stream

_ERRORS = {status: {"model": AnthropicErrorResponse} for status in (400, 401, 404, 429, 500, 503)}

Event = tuple[str, dict]


def stop_reason(c: CompletionOutput, finish_reason: str | None = None) -> tuple[StopReason, str | None]:
    """Anthropic's (stop_reason, stop_sequence) for an engine output; `finish_reason` is the one after
    tool-call parsing ("tool_calls" when the output made calls), the engine's own by default."""
    finish_reason = finish_reason or c.finish_reason
    if finish_reason == "tool_calls":
        return "tool_use", None
    if finish_reason == "length":
        return "max_tokens", None
    if finish_reason == "stop" and isinstance(c.stop_reason, str):
        return "stop_sequence", c.stop_reason
    return "end_turn", None  # EOS (stop_reason None)


def _usage(tally: UsageTally) -> MessagesUsage:
    return MessagesUsage(input_tokens=tally.prompt_tokens - tally.cached_tokens, output_tokens=tally.completion_tokens,
                         cache_read_input_tokens=tally.cached_tokens)


def _merged_turns(messages: list[MessageParam]) -> list[tuple[str, list]]:
    """Consecutive turns of one role merged into one, as Anthropic documents (text of merged turns joined
    by a blank line)."""
    turns: list[tuple[str, list]] = []
    for m in messages:
        blocks = m.blocks()
        if turns and turns[-1][0] == m.role:
            turns[-1][1].extend([TextBlockParam(type="text", text="\n\n"), *blocks])
        else:
            turns.append((m.role, blocks))
    return turns


def _chat_messages(turns: list[tuple[str, list]]) -> list[dict]:
    """Anthropic turns as chat-template messages: an assistant turn's tool_use blocks become its
    `tool_calls` (arguments as JSON text, as OpenAI's), a user turn's tool_result blocks become `tool`
    messages (in order, before the turn's text), as the OpenAI route hands them to the chat template."""
    messages: list[dict] = []
    for role, blocks in turns:
        text = "".join(b.text for b in blocks if isinstance(b, TextBlockParam))
        if role == "assistant":
            calls = [{"id": b.id, "type": "function", "function": {"name": b.name, "arguments": json.dumps(b.input)}}
                     for b in blocks if isinstance(b, ToolUseBlockParam)]
            messages.append({"role": "assistant", "content": text, **({"tool_calls": calls} if calls else {})})
            continue
        results = [b for b in blocks if isinstance(b, ToolResultBlockParam)]
        for r in results:  # is_error has no place in chat templates' tool messages: the text says what happened
            messages.append({"role": "tool", "tool_call_id": r.tool_use_id, "content": r.text()})
        if any(isinstance(b, ImageBlockParam) for b in blocks):  # OpenAI's parts, in the blocks' order
            parts = [{"type": "text", "text": b.text} if isinstance(b, TextBlockParam)
                     else {"type": "image_url", "image_url": {"url": b.source.data_url()}}
                     for b in blocks if isinstance(b, (TextBlockParam, ImageBlockParam))]
            messages.append({"role": "user", "content": parts})
        elif text.strip() or not results:
            messages.append({"role": "user", "content": text})
    return messages


def _tool_fields(req: Conversation) -> dict:
    """The chat request's tools and tool_choice for Anthropic's: `any` is OpenAI's "required", `tool` a
    named function, disable_parallel_tool_use is parallel_tool_calls=false."""
    if not req.tools and req.tool_choice is None:
        return {}
    tools = [{"type": "function",
              "function": {"name": t.name, "description": t.description, "parameters": t.input_schema}}
             for t in req.tools or []]
    choice = req.tool_choice
    if choice is not None and choice.type in ("any", "tool") and not tools:
        raise APIError(400, f"tool_choice: type {choice.type!r} needs `tools`", param="tool_choice",
                       code="invalid_value")
    fields: dict = {"tools": tools or None}
    if choice is not None:
        fields["tool_choice"] = ({"type": "function", "function": {"name": choice.name}} if choice.type == "tool"
                                 else {"any": "required"}.get(choice.type, choice.type))
        fields["parallel_tool_calls"] = not choice.disable_parallel_tool_use
    return fields


@dataclass
class _Blocks:
    """One output's content blocks: text, and tool_use blocks made from the chat route's tool calls
    (serve_app/chat_tools.py, which parses or constrains them), whole or as stream events."""

    single_call: bool  # disable_parallel_tool_use: only the first call counts
    thinking: bool = False  # the request enabled thinking: the reasoning comes as thinking blocks
    index: int = -1  # the open block's index in a stream
    open_kind: str | None = None
    tool_ids: dict[int, str] = field(default_factory=dict)  # call index -> tool_use id

    def whole(self, content: str | None, calls: list[ToolCall] | None,
              reasoning: str | None = None) -> list[ThinkingBlock | TextBlock | ToolUseBlock]:
        thinking = reasoning if self.thinking else None
        blocks: list[ThinkingBlock | TextBlock | ToolUseBlock] = [ThinkingBlock(thinking=thinking)] if thinking \
            else []
        blocks += [TextBlock(text=content)] if content else []
        for call in (calls or [])[: 1 if self.single_call else None]:
            try:
                arguments = json.loads(call.function.arguments)
            except ValueError:  # cut by max_tokens before the arguments closed: not a call one can make
                blocks.append(TextBlock(text=call.function.arguments))
                continue
            blocks.append(ToolUseBlock(id=new_tool_use_id(), name=call.function.name, input=arguments))
        return blocks or [TextBlock(text="")]

    def events(self, content: str | None, deltas: list[DeltaToolCall] | None,
               reasoning: str | None = None) -> list[Event]:
        """The stream events for one chunk's reasoning (as thinking, where enabled), content and tool-call
        deltas."""
        events: list[Event] = []
        thinking = reasoning if self.thinking else None
        if thinking:
            if self.open_kind != "thinking":
                events += self.open({"type": "thinking", "thinking": "", "signature": ""}, "thinking")
            events.append(_delta(self.index, {"type": "thinking_delta", "thinking": thinking}))
        if content:
            if self.open_kind != "text":
                events += self.open({"type": "text", "text": ""}, "text")
            events.append(_delta(self.index, {"type": "text_delta", "text": content}))
        for d in deltas or ():
            if self.single_call and d.index > 0:
                continue
            if d.index not in self.tool_ids:  # a new call: its block opens with id and name, input empty
                self.tool_ids[d.index] = new_tool_use_id()
                events += self.open({"type": "tool_use", "id": self.tool_ids[d.index], "name": d.function.name,
                                      "input": {}}, "tool_use")
            if d.function is not None and d.function.arguments:
                events.append(_delta(self.index, {"type": "input_json_delta", "partial_json": d.function.arguments}))
        return events

    def open(self, block: dict, kind: str) -> list[Event]:
        events = self.close()
        self.index += 1
        self.open_kind = kind
        return events + [("content_block_start", {"type": "content_block_start", "index": self.index,
                                                  "content_block": block})]

    def close(self) -> list[Event]:
        if self.open_kind is None:
            return []
        thinking = self.open_kind == "thinking"  # Anthropic ends a thinking block with its signature
        events = [_delta(self.index, {"type": "signature_delta", "signature": ""})] if thinking else []
        self.open_kind = None
        return events + [("content_block_stop", {"type": "content_block_stop", "index": self.index})]


def _delta(index: int, delta: dict) -> Event:
    return "content_block_delta", {"type": "content_block_delta", "index": index, "delta": delta}


class AnthropicServing:
    def __init__(self, openai: OpenAIServing) -> None:
        self.openai = openai
        self.model_name = openai.model_name

    def chat_request(self, req: Conversation) -> ChatCompletionRequest:
        """The equivalent chat completion request (what validation, templating, tool planning and
        sampling see); for a bare Conversation (token counting) without sampling fields."""
        turns = _merged_turns(req.messages)
        system = req.system_text()
        messages = ([{"role": "system", "content": system}] if system else []) + _chat_messages(turns)
        prefill = turns[-1][0] == "assistant"
        if prefill and any(isinstance(b, ToolUseBlockParam) for b in turns[-1][1]):
            raise APIError(400, "messages: a final assistant turn is continued, and one that made tool calls cannot "
                           "be; send the tool_result in a user turn", param="messages", code="invalid_value")
        sampling = dict(max_tokens=req.max_tokens, temperature=req.temperature, top_p=req.top_p, top_k=req.top_k,
                        stop=req.stop_sequences, stream=req.stream, ignore_eos=req.ignore_eos) \
            if isinstance(req, MessagesRequest) else {}
        if isinstance(req, MessagesRequest) and req.thinking_enabled and self.openai.thinking_tags is not None:
            sampling["thinking_token_budget"] = req.thinking.budget_tokens  # a model without thinking just answers
        try:
            return ChatCompletionRequest(
                model=req.model, messages=messages, add_generation_prompt=not prefill,
                chat_template_kwargs={"continue_final_message": True} if prefill else None, **sampling,
                **_tool_fields(req),
            )
        except ValueError as e:  # pydantic.ValidationError; MessagesRequest's own checks make it unlikely
            raise from_exception(e) from e

    async def count_tokens(self, req: Conversation) -> MessageTokensCount:
        """The prompt tokens `req` would cost as a Messages request, tools included (nothing reaches the
        engine)."""
        self.openai.check_model(req.model)
        chat = self.chat_request(req)
        # The same checks as a message: a bad tool_choice is a 400.
        plan_tools(chat, self.openai.tool_parser, self.openai.harmony, self.openai.think)
        return MessageTokensCount(input_tokens=len((await self.openai.chat_prompt(chat)).token_ids))

    async def messages(self, req: MessagesRequest) -> MessagesResponse | AsyncIterator[Event]:
        """Validates everything and waits for the engine's first output (raising APIError), then returns
        the message, or the stream of (event name, data) pairs."""
        openai = self.openai
        openai.check_model(req.model)
        chat = self.chat_request(req)
        plan = plan_tools(chat, openai.tool_parser, openai.harmony, openai.think)
        prompt = await openai.chat_prompt(chat)
        so = await openai.structured_outputs(chat, plan)  # a forced tool: its input schema constrains the output
        message_id = new_message_id()
        kind = RequestOutputKind.DELTA if req.stream else RequestOutputKind.FINAL_ONLY
        params = openai.sampling_params(chat, len(prompt.token_ids), req.max_tokens, None, kind, so,
                                        openai.thinking(chat, so))
        outputs = openai._stream([await openai.engine_request(message_id, prompt, params, chat)])
        try:
            item = await anext(outputs, None)
        except Exception as e:  # overload, a dead engine, a request the replica rejected
            await outputs.aclose()
            raise from_exception(e) from e
        if item is None:
            raise APIError(500, "the engine returned no output", code="internal_error")
        blocks = _Blocks(single_call=not chat.parallel_tool_calls, thinking=req.thinking_enabled)
        if req.stream:
            return self._events(message_id, item[1], outputs, ChoiceTools(plan), blocks)
        return await self._message(message_id, item[1], outputs, ChoiceTools(plan), blocks)

    async def _message(self, message_id: str, first: RequestOutput, rest, tools: ChoiceTools,
                       blocks: _Blocks) -> MessagesResponse:
        tally, final = UsageTally(), first
        tally.add(0, first)
        try:
            async for _, output in rest:
                tally.add(0, output)
                final = output
        except Exception as e:
            raise from_exception(e) from e
        c = final.outputs[0]
        content, calls, finish_reason, reasoning = tools.final(c.text, c.finish_reason)
        reason, sequence = stop_reason(c, finish_reason)
        return MessagesResponse(id=message_id, content=blocks.whole(content, calls, reasoning), model=self.model_name,
                                stop_reason=reason, stop_sequence=sequence, usage=_usage(tally))

    async def _events(self, message_id: str, first: RequestOutput, rest, tools: ChoiceTools,
                      blocks: _Blocks) -> AsyncIterator[Event]:
        """Anthropic's event sequence: message_start, ping, then each content block (content_block_start,
        its deltas: text_delta, or input_json_delta for a tool_use block, content_block_stop), then
        message_delta and message_stop. Without tools the text block opens at once, before the ping, as
        Anthropic's does. One delta per engine output (a lagging consumer gets tokens merged)."""
        try:
            tally = UsageTally()
            tally.add(0, first)
            start = MessagesResponse(id=message_id, content=[], model=self.model_name,
                                     usage=MessagesUsage(input_tokens=tally.prompt_tokens - tally.cached_tokens,
                                                         output_tokens=0, cache_read_input_tokens=tally.cached_tokens))
            yield "message_start", {"type": "message_start", "message": start.model_dump()}
            if tools.plan.mode == "none" and not blocks.thinking:
                for event in blocks.open({"type": "text", "text": ""}, "text"):
                    yield event
            yield "ping", {"type": "ping"}
            output = first
            while True:
                c = output.outputs[0]
                content, deltas, finish_reason, reasoning = tools.delta(c.text, c.finish_reason)
                for event in blocks.events(content, deltas, reasoning):
                    yield event
                item = await anext(rest, None)
                if item is None:
                    break
                output = item[1]
                tally.add(0, output)
            if blocks.index < 0:  # nothing came: an empty text block, as the whole message has
                for event in blocks.open({"type": "text", "text": ""}, "text"):
                    yield event
            for event in blocks.close():
                yield event
            reason, sequence = stop_reason(c, finish_reason)
            yield "message_delta", {"type": "message_delta",
                                    "delta": {"stop_reason": reason, "stop_sequence": sequence},
                                    "usage": {"output_tokens": tally.completion_tokens}}
            yield "message_stop", {"type": "message_stop"}
        finally:
            await rest.aclose()  # the consumer went away: stop the engine stream


# --- HTTP ------------------------------------------------------------------------------------------


def add_routes(app: FastAPI, serving: AnthropicServing) -> None:
    @app.post("/v1/messages", response_model=MessagesResponse, responses=_ERRORS,
              summary="Anthropic Messages API (streamed as server-sent events when stream=true)")
    async def create_message(body: MessagesRequest):
        result = await serving.messages(body)
        if body.stream:
            return sse_response(sse_stream(result, lambda error: sse_event(error.anthropic_body(), "error")))
        return json_response(result)

    @app.post("/v1/messages/count_tokens", response_model=MessageTokensCount, responses=_ERRORS,
              summary="Anthropic token counting: the prompt tokens a Messages request would cost")
    async def count_tokens(body: Conversation):
        return json_response(await serving.count_tokens(body))
