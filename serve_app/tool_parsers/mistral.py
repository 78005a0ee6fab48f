"""Mistral formats, after a [TOOL_CALLS] marker (content may precede it):
    v3 (and the built-in model's template):  [TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]
                                             (a lone object is accepted too)
    v11+ (tokenizers from v11 on):           [TOOL_CALLS]name[ARGS]{...}, a marker before each call"""

from __future__ import annotations

import json

from serve_app.tool_parsers.base import ParsedToolCall, ToolParser, call_from_json, decode_json_values

_MARKER = "[TOOL_CALLS]"
_ARGS = "[ARGS]"


class MistralToolParser(ToolParser):
    name = "mistral"
    markers = (_MARKER,)

    def parse_calls(self, text: str) -> list[ParsedToolCall]:
        if _ARGS in text:
            return _parse_v11(text)
        values = decode_json_values(text.removeprefix(_MARKER))
        if not values:
            return []
        items = [x for v in values for x in (v if isinstance(v, list) else [v])]
        calls = [call_from_json(item) for item in items]
        return calls if calls and all(calls) else []


def _parse_v11(text: str) -> list[ParsedToolCall]:
    calls = []
    for part in text.split(_MARKER)[1:]:
        name, found, arguments = part.partition(_ARGS)
        values = decode_json_values(arguments)
        if not found or not name.strip() or not values or len(values) != 1 or not isinstance(values[0], dict):
            return []
        calls.append(ParsedToolCall(name.strip(), json.dumps(values[0], ensure_ascii=False)))
    return calls
