"""SSE framing: an event stays one line whatever text the model generates."""

from __future__ import annotations

import json

from serve_app.protocol.openai import DeltaMessage
from serve_app.sse import sse_event


def test_unicode_line_breaks_never_split_an_event():
    text = "a\u2028b\x85c\u2029d\r\ne\x0bf\x1cg"
    event = sse_event(DeltaMessage(content=text))
    assert event.startswith("data: ") and event.endswith("\n\n")
    body = event[len("data: "):-2]
    assert body.splitlines() == [body]  # str.splitlines() knows every Unicode line break
    assert json.loads(body)["content"] == text
