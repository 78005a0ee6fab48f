"""The soak's requests (benchmarks/soak.py): a seeded mix of request specs, each sent over HTTP and its
answer checked against what it must be (exact token counts, finish reasons, stop reasons, JSON)."""

from __future__ import annotations

import asyncio
import json
import random
from dataclasses import dataclass, field
from typing import Any, ClassVar

import httpx

WORDS = ("river stone lantern copper meadow signal harbor velvet quartz ember falcon thistle orbit cedar "
         "marble whisper canyon saffron glacier pepper tundra beacon willow cobalt").split()
# Structured outputs: a bounded answer (compact JSON, an enum), so the format itself ends the output.
ANSWER_SCHEMA = {"type": "object", "properties": {"answer": {"type": "string", "enum": ["yes", "no", "maybe"]}},
                 "required": ["answer"], "additionalProperties": False}
JSON_MAX_TOKENS = 64
ROUTES = {"completions": "/v1/completions", "chat": "/v1/chat/completions", "messages": "/v1/messages"}


@dataclass(frozen=True)
class Spec:
    """One request of the mix. Endings: "length" (ignore_eos, `tokens` tokens), "stop_token" and
    "stop_string" (STOP_TOKEN forced by logit_bias once min_tokens=`tokens` allow it: `tokens` + 1 tokens
    with the stop token, `tokens` with the stop string), "json" (response_format, ends by itself)."""

    STOP_TOKEN: ClassVar[int] = 520  # "ra" in the built-in model's tokenizer: no space, so it repeats as text

    index: int
    route: str  # completions | chat | messages
    stream: bool
    n: int
    ending: str
    tokens: int
    fate: str  # complete | disconnect | cancel
    prefix: str  # shared by many requests (the prefix cache's food)
    suffix: str
    model: str
    stop_text: str  # STOP_TOKEN's text
    cancel_after_s: float = 0.0

    @property
    def kind_label(self) -> str:
        return self.route + (" stream" if self.stream else "")

    @property
    def label(self) -> str:
        return f"#{self.index} {self.kind_label} n={self.n} {self.ending}/{self.tokens} {self.fate}"

    def tokens_per_choice(self) -> int | None:
        return {"length": self.tokens, "stop_token": self.tokens + 1, "stop_string": self.tokens}.get(self.ending)

    def stop_reason(self) -> int | str | None:
        return {"stop_token": self.STOP_TOKEN, "stop_string": self.stop_text}.get(self.ending)

    def body(self) -> dict[str, Any]:
        if self.route == "messages":
            return {"model": self.model, "system": self.prefix, "messages": [{"role": "user", "content": self.suffix}],
                    "max_tokens": self.tokens, "ignore_eos": True, "stream": self.stream}
        body: dict[str, Any] = {"model": self.model, "n": self.n, "stream": self.stream}
        if self.route == "completions":
            body["prompt"] = f"{self.prefix} {self.suffix}"
        else:
            body["messages"] = [{"role": "system", "content": self.prefix}, {"role": "user", "content": self.suffix}]
        if self.stream:
            body["stream_options"] = {"include_usage": True}
        forced = {"min_tokens": self.tokens, "max_tokens": self.tokens + 8, "logit_bias": {str(self.STOP_TOKEN): 100},
                  "ignore_eos": True}
        body.update({
            "length": {"max_tokens": self.tokens, "ignore_eos": True},
            "stop_token": {**forced, "stop_token_ids": [self.STOP_TOKEN]},
            "stop_string": {**forced, "stop": [self.stop_text]},
            "json": {"max_tokens": JSON_MAX_TOKENS, "temperature": 0.8,
                     "response_format": {"type": "json_schema",
                                         "json_schema": {"name": "answer", "schema": ANSWER_SCHEMA}}},
        }[self.ending])
        return body


def make_specs(count: int, seed: int, stop_text: str, model: str) -> list[Spec]:
    rng = random.Random(seed)
    prefixes = [" ".join(rng.choices(WORDS, k=rng.randint(40, 90))) for _ in range(4)]
    specs = []
    for i in range(count):
        fate = rng.choices(["complete", "disconnect", "cancel"], [85, 10, 5])[0]
        route = rng.choices(list(ROUTES), [4, 4, 2])[0]
        ending = "length" if route == "messages" or fate == "disconnect" else \
            rng.choices(["length", "stop_token", "stop_string", "json"], [55, 15, 15, 15])[0]
        # A client that disconnects asks for a long output, so that it leaves while it is generated.
        tokens = rng.randint(64, 256) if fate == "disconnect" else rng.randint(4, 32) if ending == "length" else \
            rng.randint(2, 16)
        specs.append(Spec(
            index=i, route=route, stream=fate == "disconnect" or rng.random() < 0.5,
            n=1 if route == "messages" else rng.choice([1, 1, 1, 2, 3]), ending=ending, tokens=tokens, fate=fate,
            prefix=rng.choice(prefixes), suffix=" ".join(rng.choices(WORDS, k=rng.randint(3, 20))), model=model,
            stop_text=stop_text, cancel_after_s=rng.uniform(0.0, 0.3),
        ))
    return specs


@dataclass(frozen=True)
class Outcome:
    spec: Spec
    result: str  # completed | errors | disconnected | cancelled | failed
    detail: str = ""  # the error's type, or why it failed


@dataclass
class _Observed:
    """What an answer said, per choice, whatever its shape (JSON or either kind of stream)."""

    finish: dict[int, str | None] = field(default_factory=dict)
    stop_reason: dict[int, int | str | None] = field(default_factory=dict)
    text: dict[int, str] = field(default_factory=dict)
    completion_tokens: int | None = None
    problem: str | None = None

    def choice(self, index: int, text: str | None, finish: str | None, stop_reason: int | str | None) -> None:
        self.text[index] = self.text.get(index, "") + (text or "")
        if finish is not None:
            self.finish[index], self.stop_reason[index] = finish, stop_reason


_ANTHROPIC_FINISH = {"max_tokens": "length", "stop_sequence": "stop", "end_turn": "stop"}


def _observe_json(route: str, body: dict) -> _Observed:
    seen = _Observed()
    if route == "messages":
        seen.choice(0, "".join(b["text"] for b in body["content"]), _ANTHROPIC_FINISH[body["stop_reason"]],
                    body["stop_sequence"])
        seen.completion_tokens = body["usage"]["output_tokens"]
        return seen
    for c in body["choices"]:
        seen.choice(c["index"], c["text"] if route == "completions" else c["message"]["content"], c["finish_reason"],
                    c["stop_reason"])
    seen.completion_tokens = body["usage"]["completion_tokens"]
    return seen


def _observe_stream(route: str, lines: list[str]) -> _Observed:
    seen = _Observed()
    data = [line[6:] for line in lines if line.startswith("data: ")]
    if route == "messages":
        events = [json.loads(d) for d in data]
        for e in events:
            if e["type"] == "content_block_delta":
                seen.choice(0, e["delta"]["text"], None, None)
            elif e["type"] == "message_delta":
                seen.choice(0, None, _ANTHROPIC_FINISH[e["delta"]["stop_reason"]], e["delta"]["stop_sequence"])
                seen.completion_tokens = e["usage"]["output_tokens"]
            elif e["type"] == "error":
                seen.problem = f"error event: {e}"
        if not events or events[-1]["type"] != "message_stop":
            seen.problem = seen.problem or "the stream does not end with message_stop"
        return seen
    if not data or data[-1] != "[DONE]":
        seen.problem = "the stream does not end with [DONE]"
    for chunk in (json.loads(d) for d in data if d != "[DONE]"):
        if "error" in chunk:
            seen.problem = f"error event: {chunk}"
            continue
        for c in chunk["choices"]:
            text = c["text"] if route == "completions" else c["delta"].get("content")
            seen.choice(c["index"], text, c["finish_reason"], c.get("stop_reason"))
        if chunk.get("usage"):
            seen.completion_tokens = chunk["usage"]["completion_tokens"]
    return seen


def _verdict(spec: Spec, seen: _Observed) -> Outcome:
    def failed(why: str) -> Outcome:
        return Outcome(spec, "failed", why)

    if seen.problem:
        return failed(seen.problem)
    if sorted(seen.finish) != list(range(spec.n)):
        return failed(f"finished choices {sorted(seen.finish)}, expected {spec.n}")
    expected_finish = "length" if spec.ending == "length" else "stop"
    if any(f != expected_finish for f in seen.finish.values()):
        return failed(f"finish reasons {seen.finish}, expected {expected_finish}")
    if spec.ending in ("stop_token", "stop_string") and any(r != spec.stop_reason() for r in seen.stop_reason.values()):
        return failed(f"stop reasons {seen.stop_reason}, expected {spec.stop_reason()!r}")
    per_choice = spec.tokens_per_choice()
    if per_choice is not None and seen.completion_tokens != spec.n * per_choice:
        return failed(f"{seen.completion_tokens} completion tokens, expected {spec.n} x {per_choice}")
    if spec.ending == "json":
        if seen.completion_tokens is None or seen.completion_tokens > spec.n * JSON_MAX_TOKENS:
            return failed(f"{seen.completion_tokens} completion tokens for structured output")
        for text in seen.text.values():
            try:
                answer = json.loads(text)
            except json.JSONDecodeError:
                return failed(f"structured output is not JSON: {text!r}")
            if set(answer) != {"answer"} or answer["answer"] not in ANSWER_SCHEMA["properties"]["answer"]["enum"]:
                return failed(f"structured output does not match its schema: {text!r}")
    return Outcome(spec, "completed")


def _error(spec: Spec, status: int, text: str) -> Outcome:
    """A clear error: overload (429) or unavailability (503) with the documented error object."""
    try:
        body = json.loads(text)
        kind = body["error"]["type"]
        assert isinstance(body["error"]["message"], str)
    except (ValueError, KeyError, TypeError, AssertionError):
        return Outcome(spec, "failed", f"{status} without an error object: {text[:200]}")
    if status not in (429, 503):
        return Outcome(spec, "failed", f"{status} {kind}: {body['error']['message'][:200]}")
    return Outcome(spec, "errors", f"{status} {kind}")


async def _complete(client: httpx.AsyncClient, spec: Spec) -> Outcome:
    path = ROUTES[spec.route]
    if not spec.stream:
        r = await client.post(path, json=spec.body())
        return _verdict(spec, _observe_json(spec.route, r.json())) if r.status_code == 200 else \
            _error(spec, r.status_code, r.text)
    async with client.stream("POST", path, json=spec.body()) as r:
        if r.status_code != 200:
            return _error(spec, r.status_code, (await r.aread()).decode())
        lines = [line async for line in r.aiter_lines()]
    return _verdict(spec, _observe_stream(spec.route, lines))


async def _disconnect(client: httpx.AsyncClient, spec: Spec) -> Outcome:
    """Reads the stream's first two events, then closes the connection."""
    async with client.stream("POST", ROUTES[spec.route], json=spec.body()) as r:
        if r.status_code != 200:
            return _error(spec, r.status_code, (await r.aread()).decode())
        lines = []
        async for line in r.aiter_lines():
            lines.append(line)
            if sum(line.startswith("data: ") for line in lines) == 2:
                return Outcome(spec, "disconnected")
    return _verdict(spec, _observe_stream(spec.route, lines))  # it ended first


async def run_spec(client: httpx.AsyncClient, spec: Spec) -> Outcome:
    try:
        if spec.fate == "disconnect":
            return await _disconnect(client, spec)
        if spec.fate == "complete":
            return await _complete(client, spec)
        task = asyncio.ensure_future(_complete(client, spec))
        await asyncio.wait([task], timeout=spec.cancel_after_s)
        if task.done():  # answered before the client gave up
            return task.result()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return Outcome(spec, "cancelled")
    except (httpx.HTTPError, ValueError, KeyError, TypeError) as e:  # no answer, or one of the wrong shape
        return Outcome(spec, "failed", f"{type(e).__name__}: {e}")
