"""Llama 3.x JSON format: the whole output is one call, {"name": ..., "parameters": {...}} (Meta's key;
"arguments" is accepted too), optionally after <|python_tag|>; several calls are separated by ';'."""

from __future__ import annotations

from serve_app.tool_parsers.base import ParsedToolCall, ToolParser, call_from_json, decode_json_values

_PYTHON_TAG = "<|python_tag|>"


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"
    markers = ("{", _PYTHON_TAG)
    at_start_only = True

    def parse_calls(self, text: str) -> list[ParsedToolCall]:
        values = decode_json_values(text.strip().removeprefix(_PYTHON_TAG), separators=" \t\r\n;")
        calls = [call_from_json(v, ("parameters", "arguments")) for v in values or []]
        return calls if calls and all(calls) else []
