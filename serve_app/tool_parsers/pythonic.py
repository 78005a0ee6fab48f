"""Pythonic format (Llama 3.2 and Llama 4; vLLM's `pythonic`): the whole output is a Python list of calls
with keyword arguments of literal values, [get_weather(city="Paris", days=3), ping()], optionally between
Llama 4's <|python_start|> and <|python_end|>. Read with Python's parser, never evaluated."""

from __future__ import annotations

import ast
import json

from serve_app.tool_parsers.base import ParsedToolCall, ToolParser

_START, _END = "<|python_start|>", "<|python_end|>"


class PythonicToolParser(ToolParser):
    name = "pythonic"
    markers = ("[", _START)
    at_start_only = True

    def parse_calls(self, text: str) -> list[ParsedToolCall]:
        source = text.strip().removeprefix(_START).removesuffix(_END).strip()
        try:
            tree = ast.parse(source, mode="eval").body
        except (SyntaxError, ValueError, RecursionError, MemoryError):
            return []
        if not isinstance(tree, ast.List) or not tree.elts:
            return []
        calls = []
        for node in tree.elts:
            if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
                return []
            try:
                arguments = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords}
                if None in arguments:  # **kwargs
                    return []
                calls.append(ParsedToolCall(node.func.id, json.dumps(arguments, ensure_ascii=False)))
            except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError):  # not a literal, or not JSON
                return []
        return calls
