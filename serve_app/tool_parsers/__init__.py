"""Tool-call parsers for tool_choice "auto": each reads one model family's tool-call format out of the
generated text (one file per format). The app arg `tool_call_parser` picks one; `auto` picks by the
chat template's markers.

    hermes        Hermes / Qwen 2.5+:  <tool_call>{"name": ..., "arguments": {...}}</tool_call> (repeatable)
    llama3_json   Llama 3.x JSON:      {"name": ..., "parameters": {...}} (optionally after <|python_tag|>,
                                       several separated by ';')
    mistral       Mistral v3:          [TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]
                  Mistral v11+:        [TOOL_CALLS]name[ARGS]{...} (repeatable)
    pythonic      Llama 3.2 / 4:       [get_weather(city="Paris"), ping()] (optionally within
                                       <|python_start|> ... <|python_end|>)

A parser never raises on model output: text it cannot read as tool calls stays content."""

from __future__ import annotations

from serve_app.tool_parsers.base import ParsedToolCall, ToolParser
from serve_app.tool_parsers.hermes import HermesToolParser
from serve_app.tool_parsers.llama3_json import Llama3JsonToolParser
from serve_app.tool_parsers.mistral import MistralToolParser
from serve_app.tool_parsers.pythonic import PythonicToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesToolParser,
    "llama3_json": Llama3JsonToolParser,
    "mistral": MistralToolParser,
    "pythonic": PythonicToolParser,
}


def get_tool_parser(name: str, chat_template: str | None = None) -> ToolParser:
    """The parser called `name`; for "auto", the one whose markers the chat template writes (hermes when
    none does: the most common format among open models)."""
    if name == "auto":
        template = chat_template or ""
        if "[TOOL_CALLS]" in template:
            name = "mistral"
        elif "<|python_start|>" in template:
            name = "pythonic"
        elif "<|python_tag|>" in template or "ipython" in template:
            name = "llama3_json"
        else:
            name = "hermes"
    if name not in TOOL_PARSERS:
        raise ValueError(f"tool_call_parser: {name!r} is not one of auto, {', '.join(TOOL_PARSERS)}")
    return TOOL_PARSERS[name]()


__all__ = ["TOOL_PARSERS", "ParsedToolCall", "ToolParser", "get_tool_parser"]
