"""Server-sent events: the one writer for every streamed route, OpenAI's (`data:` events, then
`data: [DONE]`) and Anthropic's (`event:` and `data:`). An event's data stays one line whatever text the
model generated, and a failure after the first byte (the status line is gone) becomes a last, in-band
error event in the protocol's own shape."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Callable

from fastapi.responses import StreamingResponse
from pydantic import BaseModel

from serve_app.errors import APIError, from_exception

logger = logging.getLogger(__name__)

# JSON leaves these unescaped, but line readers built on str.splitlines() (httpx's among them) end a
# line at each: generated text containing one would cut an event in two.
_LINE_BREAKS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})

OPENAI_DONE = "data: [DONE]\n\n"


def sse_event(data: BaseModel | dict, event: str | None = None) -> str:
    body = data.model_dump_json() if isinstance(data, BaseModel) else json.dumps(data, separators=(",", ":"))
    body = body.translate(_LINE_BREAKS)
    return f"event: {event}\ndata: {body}\n\n" if event is not None else f"data: {body}\n\n"


async def sse_stream(events: AsyncIterator[tuple[str | None, BaseModel | dict]],
                     error_event: Callable[[APIError], str], last: str | None = None) -> AsyncIterator[str]:
    """The events as SSE text; `error_event` writes a failure in the protocol's shape; `last` ends the
    stream (OpenAI's [DONE]), after an error too."""
    try:
        async for name, data in events:
            yield sse_event(data, name)
    except Exception as e:  # noqa: BLE001 - the status line is gone: report in-band
        logger.warning("stream failed: %s", e)
        yield error_event(from_exception(e))
    if last is not None:
        yield last


def sse_response(body: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(body, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
