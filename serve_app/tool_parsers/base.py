"""What every tool-call parser shares: the parsed call, JSON helpers, and the hold-back logic that
lets streamed content flow until a tool call may be starting."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, ClassVar


@dataclass(frozen=True)
class ParsedToolCall:
    name: str
    arguments: str  # a JSON object, as text


class ToolParser:
    """A format is recognised by its markers: text before the first one is content, from it on the
    tool calls. `at_start_only` formats (bare JSON) are tool calls only when the output begins with one."""

    name: ClassVar[str]
    markers: ClassVar[tuple[str, ...]]
    at_start_only: ClassVar[bool] = False

    def extract(self, text: str) -> tuple[str | None, list[ParsedToolCall]]:
        """(content, tool calls) of a whole output; no calls, and all the text as content, when the
        output holds none or holds them malformed."""
        start = self.tool_start(text)
        if start is None:
            return text, []
        calls = self.parse_calls(text[start:])
        if not calls:
            return text, []
        content = text[:start].strip()
        return content or None, calls

    def parse_calls(self, text: str) -> list[ParsedToolCall]:
        """The calls in `text`, which begins at a marker; [] when they do not parse."""
        raise NotImplementedError

    def tool_start(self, text: str) -> int | None:
        """Where the tool calls begin in `text`, or None."""
        if self.at_start_only:
            stripped = len(text) - len(text.lstrip())
            return stripped if text[stripped:].startswith(self.markers) else None
        found = [i for i in (text.find(m) for m in self.markers) if i >= 0]
        return min(found) if found else None

    def safe_prefix(self, text: str) -> int:
        """How much of `text` (no marker in it yet) can be streamed as content now: all but a tail that
        could still grow into a marker."""
        if self.at_start_only and not text.strip():
            return 0  # only whitespace so far: the output may yet open with a marker
        if self.at_start_only:
            return len(text) if not any(m.startswith(text.lstrip()) for m in self.markers) else 0
        for i in range(max(0, len(text) - max(map(len, self.markers)) + 1), len(text)):
            if any(m.startswith(text[i:]) for m in self.markers):
                return i
        return len(text)


def call_from_json(obj: Any, arguments_keys: tuple[str, ...] = ("arguments", "parameters")) -> ParsedToolCall | None:
    """A call from a decoded {"name": ..., "arguments": {...}} object, or None if it is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = next((obj[k] for k in arguments_keys if k in obj), {})
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ParsedToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


def decode_json_values(text: str, separators: str = " \t\r\n") -> list[Any] | None:
    """Consecutive JSON values in `text`, separated by any of `separators`; None unless all of it parses."""
    decoder, values, i = json.JSONDecoder(), [], 0
    while True:
        while i < len(text) and text[i] in separators:
            i += 1
        if i == len(text):
            return values
        try:
            value, i = decoder.raw_decode(text, i)
        except ValueError:
            return None
        values.append(value)
