"""The Anthropic Messages routes (`POST /v1/messages`, `/v1/messages/count_tokens`): their logic on top
of OpenAIServing (the same processor, chat template, sampling-parameter checks, EngineRequests and
engine streams), and their HTTP routes with Anthropic's server-sent events.

An Anthropic request becomes the equivalent ChatCompletionRequest (the system prompt as a "system"
message first), so validation, the context-length checks and the engine path are exactly the chat
route's. Anthropic-specific behaviour: consecutive turns of one role are merged into one turn (as
Anthropic documents), a final assistant turn is a prefill the answer continues, stop sequences are
never part of the text, and `usage.input_tokens` counts the prompt tokens not read from the prefix
cache (`cache_read_input_tokens` the rest), as Anthropic counts them."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator

from fastapi import FastAPI
from fastapi.responses import StreamingResponse

from engine.outputs import CompletionOutput, RequestOutput
from engine.sampling_params import RequestOutputKind
from serve_app.errors import APIError, from_exception
from serve_app.http_api import json_response
from serve_app.openai_serving import OpenAIServing, _Tally
from serve_app.protocol.anthropic import (
    AnthropicErrorResponse,
    Conversation,
    MessagesRequest,
    MessagesResponse,
    MessagesUsage,
    MessageTokensCount,
    StopReason,
    TextBlock,
    new_message_id,
)
from serve_app.protocol.openai import ChatCompletionRequest

logger = logging.getLogger(__name__)

_ERRORS = {status: {"model": AnthropicErrorResponse} for status in (400, 401, 404, 429, 500, 503)}

Event = tuple[str, dict]


def stop_reason(c: CompletionOutput) -> tuple[StopReason, str | None]:
    """Anthropic's (stop_reason, stop_sequence) for an engine output's finish reason."""
    if c.finish_reason == "length":
        return "max_tokens", None
    if c.finish_reason == "stop" and isinstance(c.stop_reason, str):
        return "stop_sequence", c.stop_reason
    return "end_turn", None  # EOS (stop_reason None)


def _usage(tally: _Tally) -> MessagesUsage:
    return MessagesUsage(input_tokens=tally.prompt_tokens - tally.cached_tokens, output_tokens=tally.completion_tokens,
                         cache_read_input_tokens=tally.cached_tokens)


class AnthropicServing:
    def __init__(self, openai: OpenAIServing) -> None:
        self.openai = openai
        self.model_name = openai.model_name

    def chat_request(self, req: Conversation) -> ChatCompletionRequest:
        """The equivalent chat completion request (what validation, templating and sampling see); for a
        bare Conversation (token counting) without sampling fields."""
        turns: list[dict] = []
        for m in req.messages:
            if turns and turns[-1]["role"] == m.role:
                turns[-1]["content"] += "\n\n" + m.text()
            else:
                turns.append({"role": m.role, "content": m.text()})
        system = req.system_text()
        messages = ([{"role": "system", "content": system}] if system else []) + turns
        prefill = turns[-1]["role"] == "assistant"
        sampling = dict(max_tokens=req.max_tokens, temperature=req.temperature, top_p=req.top_p, top_k=req.top_k,
                        stop=req.stop_sequences, stream=req.stream, ignore_eos=req.ignore_eos) \
            if isinstance(req, MessagesRequest) else {}
        try:
            return ChatCompletionRequest(
                model=req.model, messages=messages, add_generation_prompt=not prefill,
                chat_template_kwargs={"continue_final_message": True} if prefill else None, **sampling,
            )
        except ValueError as e:  # pydantic.ValidationError; MessagesRequest's own checks make it unlikely
            raise from_exception(e) from e

    def count_tokens(self, req: Conversation) -> MessageTokensCount:
        """The prompt tokens `req` would cost as a Messages request (nothing reaches the engine)."""
        self.openai.check_model(req.model)
        return MessageTokensCount(input_tokens=len(self.openai.chat_prompt(self.chat_request(req)).token_ids))

    async def messages(self, req: MessagesRequest) -> MessagesResponse | AsyncIterator[Event]:
        """Validates everything and waits for the engine's first output (raising APIError), then returns
        the message, or the stream of (event name, data) pairs."""
        openai = self.openai
        openai.check_model(req.model)
        chat = self.chat_request(req)
        prompt = openai.chat_prompt(chat)
        message_id = new_message_id()
        kind = RequestOutputKind.DELTA if req.stream else RequestOutputKind.FINAL_ONLY
        params = openai.sampling_params(chat, len(prompt.token_ids), req.max_tokens, None, kind)
        outputs = openai._stream([openai.engine_request(message_id, prompt, params, chat)])
        try:
            item = await anext(outputs, None)
        except Exception as e:  # overload, a dead engine, a request the replica rejected
            await outputs.aclose()
            raise from_exception(e) from e
        if item is None:
            raise APIError(500, "the engine returned no output", code="internal_error")
        if req.stream:
            return self._events(message_id, item[1], outputs)
        return await self._message(message_id, item[1], outputs)

    async def _message(self, message_id: str, first: RequestOutput, rest) -> MessagesResponse:
        tally, final = _Tally(), first
        tally.add(0, first)
        try:
            async for _, output in rest:
                tally.add(0, output)
                final = output
        except Exception as e:
            raise from_exception(e) from e
        c = final.outputs[0]
        reason, sequence = stop_reason(c)
        return MessagesResponse(id=message_id, content=[TextBlock(text=c.text)], model=self.model_name,
                                stop_reason=reason, stop_sequence=sequence, usage=_usage(tally))

    async def _events(self, message_id: str, first: RequestOutput, rest) -> AsyncIterator[Event]:
        """Anthropic's event sequence: message_start, content_block_start, ping, content_block_delta...,
        content_block_stop, message_delta, message_stop. One delta per engine output (the replica already
        coalesces tokens a slow consumer has not taken)."""
        try:
            tally = _Tally()
            tally.add(0, first)
            start = MessagesResponse(id=message_id, content=[], model=self.model_name,
                                     usage=MessagesUsage(input_tokens=tally.prompt_tokens - tally.cached_tokens,
                                                         output_tokens=0, cache_read_input_tokens=tally.cached_tokens))
            yield "message_start", {"type": "message_start", "message": start.model_dump()}
            yield "content_block_start", {"type": "content_block_start", "index": 0,
                                          "content_block": {"type": "text", "text": ""}}
            yield "ping", {"type": "ping"}
            output, last = first, first.outputs[0]
            while True:
                c = output.outputs[0]
                last = c
                if c.text:
                    yield "content_block_delta", {"type": "content_block_delta", "index": 0,
                                                  "delta": {"type": "text_delta", "text": c.text}}
                item = await anext(rest, None)
                if item is None:
                    break
                output = item[1]
                tally.add(0, output)
            reason, sequence = stop_reason(last)
            yield "content_block_stop", {"type": "content_block_stop", "index": 0}
            yield "message_delta", {"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": sequence},
                                    "usage": {"output_tokens": tally.completion_tokens}}
            yield "message_stop", {"type": "message_stop"}
        finally:
            await rest.aclose()  # the consumer went away: stop the engine stream


# --- HTTP ------------------------------------------------------------------------------------------


def _event(name: str, data: dict) -> str:
    return f"event: {name}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n"


async def sse(events: AsyncIterator[Event]) -> AsyncIterator[str]:
    """Anthropic's server-sent events; a failure after the first byte becomes an `error` event."""
    try:
        async for name, data in events:
            yield _event(name, data)
    except Exception as e:  # noqa: BLE001 - the status line is gone: report in-band
        logger.warning("stream failed: %s", e)
        yield _event("error", from_exception(e).anthropic_body())


def add_routes(app: FastAPI, serving: AnthropicServing) -> None:
    @app.post("/v1/messages", response_model=MessagesResponse, responses=_ERRORS,
              summary="Anthropic Messages API (streamed as server-sent events when stream=true)")
    async def create_message(body: MessagesRequest):
        result = await serving.messages(body)
        if body.stream:
            return StreamingResponse(sse(result), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        return json_response(result)

    @app.post("/v1/messages/count_tokens", response_model=MessageTokensCount, responses=_ERRORS,
              summary="Anthropic token counting: the prompt tokens a Messages request would cost")
    async def count_tokens(body: Conversation):
        return json_response(serving.count_tokens(body))
