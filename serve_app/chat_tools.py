"""Tool calling on /v1/chat/completions: what `tool_choice` asks of generation, and how each choice's
text becomes content and `tool_calls`, whole or as stream deltas.

- "none" (the default without tools): plain content.
- "auto" (the default with tools): the model decides; the app's tool parser (serve_app/tool_parsers)
  reads its calls out of the text. Content streams until a call may be starting; the calls follow
  when the output ends.
- "required": generation is constrained to a JSON array of calls, [{"name": ..., "parameters": {...}}],
  one anyOf branch per tool, so each call's parameters validate against its own tool's schema
  (parallel_tool_calls=false: exactly one call). The calls are sent when the array completes.
- {"type": "function", "function": {"name": ...}}: generation is constrained to that tool's parameters
  schema; the output is the call's arguments, streamed as argument deltas.

Calls found make finish_reason "tool_calls" (when the output ended on its own, not at max_tokens).

A Harmony model (gpt-oss; serve_app/harmony.py) writes channels instead: with "none" and "auto" its
analysis channel becomes `reasoning`, never content, and "auto" takes its calls from the messages it
addresses to functions. "required" and named choices constrain the whole output to JSON, headers included,
so they read it as any model's."""

from __future__ import annotations

import dataclasses
import json
import uuid
from dataclasses import dataclass, field
from typing import Literal, NamedTuple

from engine.sampling_params import StructuredOutputsParams
from serve_app.errors import APIError
from serve_app.harmony import HarmonyStream, split_output
from serve_app.protocol.openai import (
    ChatCompletionRequest,
    DeltaFunctionCall,
    DeltaToolCall,
    FunctionCall,
    ToolCall,
)
from serve_app.reasoning_parsers import ThinkFormat, ThinkStream
from serve_app.tool_parsers import ParsedToolCall, ToolParser

NO_PARAMETERS = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class ToolPlan:
    mode: Literal["none", "auto", "required", "named"]
    parser: ToolParser | None = None  # auto
    function: str | None = None  # named
    structured_outputs: StructuredOutputsParams | None = None  # required, named
    harmony: bool = False  # none, auto: the output is in Harmony's channels
    think: ThinkFormat | None = None  # none, auto: the output thinks in <think> ... </think> first
    include_reasoning: bool = True  # false: the reasoning is dropped from what the client gets

    @property
    def reads_harmony(self) -> bool:
        return self.harmony and self.mode in ("none", "auto")

    @property
    def reads_thinking(self) -> bool:
        """The output thinks first; a forced call's or a format's grammar constrains what follows the thinking
        (the engine starts it after the end tag)."""
        return self.think is not None


def plan_tools(req: ChatCompletionRequest, parser: ToolParser, harmony: bool = False,
               think: ThinkFormat | None = None) -> ToolPlan:
    """The plan for `req`'s tools; raises a 400 naming tools or tool_choice when they do not fit. `harmony`:
    the model writes Harmony's format (serve_app/harmony.py); `think`: the app's reasoning parser's format
    (serve_app/reasoning_parsers.py)."""
    plan = _plan_tools(req, parser, harmony)
    return dataclasses.replace(plan, think=think, include_reasoning=req.include_reasoning)


def _plan_tools(req: ChatCompletionRequest, parser: ToolParser, harmony: bool) -> ToolPlan:
    tools = req.tools or []
    names = [t.function.name for t in tools]
    if len(set(names)) != len(names):
        dup = next(n for n in names if names.count(n) > 1)
        raise APIError(400, f"tools: function names must be unique; {dup!r} appears more than once", param="tools",
                       code="invalid_value")
    choice = req.tool_choice or ("auto" if tools else "none")
    if choice == "none":
        return ToolPlan("none", harmony=harmony)
    if not tools:
        shown = choice if isinstance(choice, str) else choice.function.name
        raise APIError(400, f"tool_choice: {shown!r} needs `tools`", param="tool_choice", code="invalid_value")
    if choice == "auto":
        return ToolPlan("auto", parser=parser, harmony=harmony)
    has_format = (req.response_format is not None and req.response_format.type != "text") or req.structured_outputs
    if has_format:
        raise APIError(400, "tool_choice: a required or named tool call cannot be combined with response_format "
                       "or structured_outputs", param="tool_choice", code="invalid_value")
    by_name = {t.function.name: t.function.parameters or NO_PARAMETERS for t in tools}
    if choice == "required":
        call = {"anyOf": [
            {"type": "object", "properties": {"name": {"type": "string", "enum": [n]}, "parameters": schema},
             "required": ["name", "parameters"]}
            for n, schema in by_name.items()
        ]}
        schema = {"type": "array", "items": call, "minItems": 1}
        if not req.parallel_tool_calls:
            schema["maxItems"] = 1
        mode, function = "required", None
    else:
        function = choice.function.name
        if function not in by_name:
            raise APIError(400, f"tool_choice: function {function!r} is not among the tools ({', '.join(names)})",
                           param="tool_choice", code="invalid_value")
        schema, mode = by_name[function], "named"
    try:
        return ToolPlan(mode, function=function, structured_outputs=StructuredOutputsParams(json=schema))
    except ValueError as e:
        message = str(e.errors()[0]["msg"] if hasattr(e, "errors") else e).removeprefix("Value error, ")
        raise APIError(400, "tools: " + message.removeprefix("structured_outputs: "), param="tools",
                       code="invalid_value") from None


def _tool_call(call: ParsedToolCall) -> ToolCall:
    return ToolCall(id=f"call_{uuid.uuid4().hex[:24]}", function=FunctionCall(name=call.name, arguments=call.arguments))


def _call_deltas(calls: list[ToolCall], first_index: int = 0) -> list[DeltaToolCall]:
    return [DeltaToolCall(index=first_index + i, id=c.id, type="function",
                          function=DeltaFunctionCall(name=c.function.name, arguments=c.function.arguments))
            for i, c in enumerate(calls)]


class ChoiceText(NamedTuple):
    """A choice's output (whole) or a stream chunk's part of it (deltas)."""

    content: str | None
    tool_calls: list[ToolCall] | list[DeltaToolCall] | None
    finish_reason: str | None
    reasoning: str | None = None


@dataclass
class ChoiceTools:
    """One choice's output as content, tool calls and (Harmony) reasoning."""

    plan: ToolPlan
    text: str = ""
    sent: int = 0  # characters of `text` already streamed as content (auto)
    in_calls: bool = False  # auto: a tool-call marker has appeared
    call_id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")  # named
    harmony: HarmonyStream = field(default_factory=HarmonyStream)
    thinking: ThinkStream | None = None

    def final(self, text: str, finish_reason: str | None) -> ChoiceText:
        """The content, tool calls, finish_reason and reasoning of a whole output."""
        reasoning = None
        if self.plan.reads_thinking:
            reasoning, text = self.plan.think.split(text)
        out = self._final(text, finish_reason)
        return self._reasoning(out, reasoning or out.reasoning)

    def delta(self, new_text: str, finish_reason: str | None) -> ChoiceText:
        """The content delta, tool-call deltas, finish_reason and reasoning delta for the text a stream chunk
        adds."""
        reasoning = None
        if self.plan.reads_thinking:
            if self.thinking is None:
                self.thinking = ThinkStream(self.plan.think)
            reasoning, new_text = self.thinking.feed(new_text, finish_reason is not None)
        out = self._delta(new_text, finish_reason)
        return self._reasoning(out, reasoning or out.reasoning)

    def _reasoning(self, out: ChoiceText, reasoning: str | None) -> ChoiceText:
        return out._replace(reasoning=(reasoning or None) if self.plan.include_reasoning else None)

    def _final(self, text: str, finish_reason: str | None) -> ChoiceText:
        mode = self.plan.mode
        calls: list[ParsedToolCall] = []
        content: str | None = text
        if self.plan.reads_harmony:
            out = split_output(text)
            calls = [ParsedToolCall(*c) for c in out.calls] if mode == "auto" else []
            return ChoiceText(out.content, [_tool_call(c) for c in calls] or None, _finish(finish_reason, calls),
                              out.reasoning)
        if mode == "auto":
            content, calls = self.plan.parser.extract(text)
        elif mode == "required" and finish_reason == "stop":
            content, calls = None, [ParsedToolCall(c["name"], json.dumps(c["parameters"], ensure_ascii=False))
                                    for c in json.loads(text)]
        elif mode == "named":  # the arguments, complete or (at max_tokens) not, as vLLM does
            content = None
            tool_calls = [ToolCall(id=self.call_id, function=FunctionCall(name=self.plan.function, arguments=text))]
            return ChoiceText(content, tool_calls, _finish(finish_reason, tool_calls))
        return ChoiceText(content, [_tool_call(c) for c in calls] or None, _finish(finish_reason, calls))

    def _delta(self, new_text: str, finish_reason: str | None) -> ChoiceText:
        mode = self.plan.mode
        if self.plan.reads_harmony:
            reasoning, content, found = self.harmony.delta(new_text, finish_reason is not None)
            calls = [_tool_call(ParsedToolCall(*c)) for c in found] if mode == "auto" else []
            return ChoiceText(content, _call_deltas(calls) or None, _finish(finish_reason, calls), reasoning)
        if mode == "none":
            return ChoiceText(new_text or None, None, finish_reason)
        first = not self.text
        self.text += new_text
        done = finish_reason is not None
        if mode == "named":
            fn = (DeltaFunctionCall(name=self.plan.function, arguments=new_text) if first
                  else DeltaFunctionCall(arguments=new_text))
            deltas = [DeltaToolCall(index=0, id=self.call_id, type="function", function=fn)] if first else (
                [DeltaToolCall(index=0, function=fn)] if new_text else None)
            return ChoiceText(None, deltas, _finish(finish_reason, [fn]))
        if mode == "required":
            if not done:
                return ChoiceText(None, None, None)
            content, calls, finish_reason, _ = self._final(self.text, finish_reason)
            return ChoiceText(content, _call_deltas(calls) if calls else None, finish_reason)
        # auto: stream content up to a (possible) marker; the calls come with the end
        parser, content = self.plan.parser, ""
        if not self.in_calls:
            start = parser.tool_start(self.text)
            if start is not None:
                self.in_calls = True
                end = start
            else:
                end = parser.safe_prefix(self.text) if not done else len(self.text)
            content, self.sent = self.text[self.sent : end], max(self.sent, end)
        if not done or not self.in_calls:
            return ChoiceText(content or None, None, finish_reason)
        _, calls, finish_reason, _ = self._final(self.text, finish_reason)
        if not calls:  # the marker led to nothing parseable: it was content after all
            content, self.sent = content + self.text[self.sent :], len(self.text)
            return ChoiceText(content or None, None, finish_reason)
        return ChoiceText(content or None, _call_deltas(calls), finish_reason)


def _finish(finish_reason: str | None, calls: list) -> str | None:
    """Calls made by an output that ended on its own end it as "tool_calls"."""
    return "tool_calls" if calls and finish_reason == "stop" else finish_reason
