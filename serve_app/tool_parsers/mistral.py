"""Mistral v3 format (and the built-in model's template): [TOOL_CALLS] then a JSON array of
{"name": ..., "arguments": {...}} objects (a lone object is accepted too); content may precede it."""

from __future__ import annotations

from serve_app.tool_parsers.base import ParsedToolCall, ToolParser, call_from_json, decode_json_values

_MARKER = "[TOOL_CALLS]"


class MistralToolParser(ToolParser):
    name = "mistral"
    markers = (_MARKER,)

    def parse_calls(self, text: str) -> list[ParsedToolCall]:
        values = decode_json_values(text.removeprefix(_MARKER))
        if not values:
            return []
        items = [x for v in values for x in (v if isinstance(v, list) else [v])]
        calls = [call_from_json(item) for item in items]
        return calls if calls and all(calls) else []
