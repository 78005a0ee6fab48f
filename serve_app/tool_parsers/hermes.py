"""Hermes / Qwen 2.5+ format: each call is a JSON object between <tool_call> and </tool_call>; content
may precede the first. The closing tag of the last call may be missing (cut by EOS)."""

from __future__ import annotations

import json
import re

from serve_app.tool_parsers.base import ParsedToolCall, ToolParser, call_from_json

_CALL = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)


class HermesToolParser(ToolParser):
    name = "hermes"
    markers = ("<tool_call>",)

    def parse_calls(self, text: str) -> list[ParsedToolCall]:
        calls = []
        for body in _CALL.findall(text):
            try:
                call = call_from_json(json.loads(body))
            except ValueError:
                return []
            if call is None:
                return []
            calls.append(call)
        return calls
