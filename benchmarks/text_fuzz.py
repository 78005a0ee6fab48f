"""Hostile text in every text field of every generating route: each string of a valid, feature-rich
request body (prompts, messages and content blocks, system prompts, stop strings, tool names,
descriptions and schemas, structured-output regexes and choices, Anthropic blocks) is replaced in turn
by unpaired UTF-16 surrogates, NUL and other control characters, an overlong line, one character
repeated a million times, combining sequences, ZWJ emoji and right-to-left text.

Each answer must be a success or a 4xx whose documented error object names the field (its top-level
name at least) in plain words; never a 5xx, never an in-band server error. Text that is not valid
Unicode is always refused; short valid text in a prompt or message is always served. Schemathesis
does not generate these (it draws from valid Unicode and ignores what the text means to a tokenizer).
benchmarks/fuzz.py runs the whole sweep; tests/serve_app/test_text_fuzz.py a fixed sample."""

from __future__ import annotations

import json
import random
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import requests

from benchmarks.api_answers import error_body_problem, status_table, stream_problem
from engine.text_validation import invalid_text

# name -> (text, whether it is valid Unicode, whether it is short enough that a prompt holding it fits)
HOSTILE_TEXTS: dict[str, tuple[str, bool, bool]] = {
    "lone low surrogate": ("hi \udcff there", False, True),
    "lone high surrogate": ("\ud83d end", False, True),
    "reversed surrogate pair": ("\ude00\ud83d", False, True),
    "NUL and controls": ("a\x00b\x01\x07\x1b[31m\x7f\x9f\r\n\t", True, True),
    "combining sequence": ("e" + "\u0301\u0323\u0302" * 40, True, True),
    "ZWJ emoji": ("\U0001F468\u200d\U0001F469\u200d\U0001F467\u200d\U0001F466 \U0001F3F3\ufe0f\u200d\U0001F308",
                  True, True),
    "right-to-left": ("\u202eabc\u202c \u05e9\u05dc\u05d5\u05dd \u0645\u0631\u062d\u0628\u0627 \u200f", True, True),
    "noncharacters and BOM": ("\ufeff\ufffe\uffff\U0010ffff x", True, True),
    "overlong line": ("word " * 40_000, True, False),
    "one character a million times": ("a" * 1_000_000, True, False),
}

# What drawn texts are made of: every kind of character above, and plain words.
_POOLS = ["\ud800\udbff\udc00\udfff\ud83d\ude00", "\x00\x01\x07\x08\x0b\x0c\x1b\x7f\x85\x9f\r\n\t",
          "\u0301\u0323\u0302\u0308\u20dd\u0489", "\U0001F468\U0001F469\U0001F467\u200d\ufe0f\U0001F3F3\U0001F308",
          "\u202e\u202d\u202c\u200f\u200e\u05e9\u05dc\u0645\u0631", "\ufeff\ufffe\uffff\U0010ffff\ufffd",
          "abc xyz {}[]\"\\:,<|>"]


def drawn_texts(count: int, seed: int) -> dict[str, tuple[str, bool, bool]]:
    """`count` seeded random texts of up to 200 characters mixed from _POOLS, in HOSTILE_TEXTS's form."""
    rng = random.Random(seed)
    texts = {}
    for i in range(count):
        pools = _POOLS[1:] if i % 2 else _POOLS  # half of them valid Unicode (most with surrogates would not be)
        text = "".join(rng.choice(rng.choice(pools)) for _ in range(rng.randint(1, 200)))
        valid = invalid_text("", text) is None
        # Short: at most a token per UTF-8 byte (byte fallback) leaves room beside the longest test chat.
        texts[f"drawn {i}"] = (text, valid, valid and len(text.encode()) <= 100)
    return texts



def _is_prompt_text(path: tuple) -> bool:
    """The text is a prompt or a message's words: short valid text there must be served."""
    return (path[0] in ("prompt", "messages", "system")
            and (path[0] == "prompt" or path[-1] in ("content", "text", "system")))


def _bodies(model: str) -> dict[str, dict]:
    """One valid request per route, holding every text field the route reads."""
    tool = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                             "parameters": {"type": "object", "properties": {"city": {
                                                 "type": "string", "description": "The city"}}}}}
    return {
        "/v1/completions": {"model": model, "prompt": "Hello there", "max_tokens": 2, "stop": ["zz", "yy"],
                            "user": "user-1", "cache_salt": "salt"},
        "/v1/completions (prompt list)": {"model": model, "prompt": ["Hello", "there"], "max_tokens": 2},
        "/v1/completions (regex)": {"model": model, "prompt": "Say", "max_tokens": 2,
                                    "structured_outputs": {"regex": "[a-z]+"}},
        "/v1/completions (choice)": {"model": model, "prompt": "Say", "max_tokens": 2,
                                     "structured_outputs": {"choice": ["yes", "no"]}},
        "/v1/chat/completions": {
            "model": model, "max_tokens": 2, "stop": "zz", "user": "user-1",
            "messages": [{"role": "system", "content": "Be brief."},
                         {"role": "user", "content": "Hi", "name": "ann"},
                         {"role": "assistant", "content": None, "tool_calls": [
                             {"id": "call_1", "type": "function",
                              "function": {"name": "get_weather", "arguments": "{\"city\": \"Oslo\"}"}}]},
                         {"role": "tool", "tool_call_id": "call_1", "content": "Sunny"},
                         {"role": "user", "content": [{"type": "text", "text": "And tomorrow?"}]}],
            "tools": [tool], "tool_choice": "auto"},
        "/v1/chat/completions (forced tool)": {
            "model": model, "max_tokens": 2, "messages": [{"role": "user", "content": "Weather?"}],
            "tools": [tool], "tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
        "/v1/chat/completions (json schema)": {
            "model": model, "max_tokens": 2, "messages": [{"role": "user", "content": "JSON"}],
            "response_format": {"type": "json_schema", "json_schema": {"name": "answer", "description": "An answer",
                                "schema": {"type": "object", "properties": {"word": {"type": "string",
                                                                                     "pattern": "^[a-z]+$"}}}}}},
        "/v1/messages": {
            "model": model, "max_tokens": 2, "system": "Be brief.", "stop_sequences": ["zz"],
            "metadata": {"user_id": "user-1"},
            "messages": [{"role": "user", "content": "Weather?"},
                         {"role": "assistant", "content": [
                             {"type": "text", "text": "Checking."},
                             {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Oslo"}}]},
                         {"role": "user", "content": [
                             {"type": "tool_result", "tool_use_id": "toolu_1", "content": "Sunny"},
                             {"type": "text", "text": "Thanks"}]}],
            "tools": [{"name": "get_weather", "description": "Weather of a city",
                       "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}],
            "tool_choice": {"type": "auto"}},
        "/v1/messages (system blocks, forced tool)": {
            "model": model, "max_tokens": 2, "system": [{"type": "text", "text": "Be brief."}],
            "messages": [{"role": "user", "content": [{"type": "text", "text": "Weather?"}]}],
            "tools": [{"name": "get_weather", "input_schema": {"type": "object", "properties": {
                "city": {"type": "string", "description": "The city"}}}}],
            "tool_choice": {"type": "tool", "name": "get_weather"}},
        "/v1/messages/count_tokens": {"model": model, "system": "Be brief.",
                                      "messages": [{"role": "user", "content": "Hi"}]},
        "/tokenize": {"model": model, "prompt": "Hello there"},
        "/tokenize (messages)": {"model": model, "messages": [{"role": "user", "content": "Hi"}]},
    }


def text_paths(value, path: tuple = ()) -> Iterator[tuple]:
    """The path of every string in a JSON value (dict keys that are free text included: schema
    property names), except the discriminating `type` and `role` tags."""
    if isinstance(value, str):
        yield path
    elif isinstance(value, dict):
        for key, item in value.items():
            if key in ("type", "role") and isinstance(item, str):
                continue
            if path[-1:] == ("properties",):
                yield path + ((key,),)  # the key itself: a one-tuple marks "rename this key"
            yield from text_paths(item, path + (key,))
    elif isinstance(value, list):
        for i, item in enumerate(value):
            yield from text_paths(item, path + (i,))


def substitute(body: dict, path: tuple, text: str) -> dict:
    body = json.loads(json.dumps(body))  # a deep copy
    *parents, last = path
    node = body
    for key in parents:
        node = node[key]
    if isinstance(last, tuple):  # rename a key
        node[text] = node.pop(last[0])
    else:
        node[last] = text
    return body


@dataclass(frozen=True)
class TextCase:
    route: str  # a key of _bodies: the path, then what makes the body special
    path: tuple
    text_name: str
    valid: bool  # the text is valid Unicode
    short: bool  # a prompt holding it fits the context
    body: dict

    @property
    def url_path(self) -> str:
        return self.route.split(" ")[0]

    @property
    def reproduce(self) -> str:
        body = json.dumps(self.body)
        body = body if len(body) < 2000 else body[:2000] + "...(cut)"
        return f"curl -X POST $URL{self.url_path} -H 'Content-Type: application/json' -d '{body}'"

    @property
    def field(self) -> str:
        return ".".join(str(k[0]) if isinstance(k, tuple) else str(k) for k in self.path)


def cases(model: str, texts: dict[str, tuple[str, bool, bool]] = HOSTILE_TEXTS,
          long_texts_on: set[str] | None = None) -> list[TextCase]:
    """Every (route, text field, text) for `texts` in HOSTILE_TEXTS's form. `long_texts_on`: when
    given, the megabyte-sized texts go only into fields whose top-level name is in it (a sample keeps
    them where they cost most)."""
    bodies = _bodies(model)
    out = []
    for route, body in bodies.items():
        for path in text_paths(body):
            for i, (name, (text, valid, short)) in enumerate(texts.items()):
                if path == ("model",) and i > 1:
                    continue  # any text is just an unknown model (404): two checks of the field are enough
                if not short and long_texts_on is not None and str(path[0]) not in long_texts_on:
                    continue
                out.append(TextCase(route, path, name, valid, short, substitute(body, path, text)))
    return out


@dataclass(frozen=True)
class TextOutcome:
    case: TextCase
    status: int
    problem: str | None


def _names_field(case: TextCase, body: dict) -> bool:
    """The error object names the field: OpenAI's `param` or, in either shape, the message starts
    with or mentions the field's top-level name (or says which model does not exist)."""
    top = str(case.path[0])
    error = body.get("error", {}) if isinstance(body, dict) else {}
    param, message = error.get("param") or "", error.get("message") or ""
    return param.split(".")[0] == top or top in message


def check(case: TextCase, response: requests.Response) -> str | None:
    status = response.status_code
    if status >= 500:
        return f"{status}: {response.text[:300]}"
    if status < 400:
        if not case.valid:
            return f"{status}: text that is not valid Unicode was accepted"
        if response.headers.get("content-type", "").startswith("text/event-stream"):
            return stream_problem(case.url_path, response.text, cut_short=False)
        return None
    try:
        body = response.json()
    except ValueError:
        return f"{status} body is not JSON: {response.text[:200]}"
    problem = error_body_problem(case.url_path, status, body)
    if problem:
        return problem
    if not _names_field(case, body):
        return f"{status} does not name the field {case.field}: {str(body)[:300]}"
    if case.valid and case.short and _is_prompt_text(case.path):
        return f"{status}: short valid text in the prompt was refused: {str(body)[:300]}"
    return None


def send(base_url: str, case: TextCase, session: requests.Session) -> TextOutcome:
    try:
        response = session.post(base_url + case.url_path, data=json.dumps(case.body).encode(), timeout=300,
                                headers={"Content-Type": "application/json"})
    except requests.RequestException as e:
        return TextOutcome(case, 0, f"no answer: {e}")
    return TextOutcome(case, response.status_code, check(case, response))


def run(base_url: str, text_cases: list[TextCase], concurrency: int = 8) -> list[TextOutcome]:
    sessions = [requests.Session() for _ in range(concurrency)]
    with ThreadPoolExecutor(concurrency) as pool:
        return list(pool.map(lambda ic: send(base_url, ic[1], sessions[ic[0] % concurrency]), enumerate(text_cases)))


def table(outcomes: Iterable[TextOutcome]) -> str:
    """Cases per hostile text (drawn ones in one row): how many were served, refused (4xx), failed
    (5xx), and wrong."""
    def row(case: TextCase) -> str:
        if case.text_name.startswith("drawn"):
            return "drawn (valid)" if case.valid else "drawn (not Unicode)"
        return case.text_name

    return status_table(((row(o.case), o.status, o.problem is not None) for o in outcomes), "hostile text", "wrong",
                        32, 8)
