"""Reasoning parsers (AppArgs.reasoning_parser): a reasoning model's thinking, split from its answer, whole or
as stream deltas, so that the chat route returns it as `reasoning`, the Anthropic route as thinking blocks
and the Responses route as reasoning items, and tool calls are read from the answer only.

- `deepseek_r1`: the chat template opens the thinking block in the prompt (`<think>\\n`), so the output
  starts inside it: everything up to `</think>` is reasoning (all of it when the output ends first, cut at
  max_tokens while still thinking); a leading `<think>` the model writes itself is dropped too.
- `qwen3`: the output opens the block itself (`<think>` ... `</think>`); an output that does not start with
  `<think>` is all answer (thinking switched off, `enable_thinking=False`).
- `gpt_oss`: Harmony's analysis channel (serve_app/harmony.py), read by the chat route's Harmony path.

Each parser's tags, as token ids, are what the engine's thinking budget forces and what a grammar waits for
(engine/sample/thinking.py)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

REASONING_PARSERS = ("deepseek_r1", "qwen3", "gpt_oss")
START, END = "<think>", "</think>"
# Harmony's thinking is the analysis channel; it ends where the final channel's message begins.
HARMONY_START, HARMONY_END = "<|channel|>analysis<|message|>", "<|end|><|start|>assistant<|channel|>final<|message|>"


@dataclass(frozen=True)
class ThinkFormat:
    """A `<think>` ... `</think>` format: whether the output starts inside the block (the prompt opened it)."""

    starts_inside: bool

    def split(self, text: str) -> tuple[str | None, str]:
        """(reasoning or None, answer) of a whole output."""
        stream = ThinkStream(self)
        reasoning, content = stream.feed(text, done=True)
        return (reasoning if stream.saw_reasoning else None), content


def think_format(name: str) -> ThinkFormat | None:
    """The format of a `<think>` parser; None for gpt_oss (Harmony's own path)."""
    if name not in REASONING_PARSERS:
        raise ValueError(f"reasoning_parser: {name!r} is not one of {', '.join(REASONING_PARSERS)}")
    return None if name == "gpt_oss" else ThinkFormat(starts_inside=name == "deepseek_r1")


def thinking_tags(name: str, encode: Callable[[str], list[int]]) -> tuple[list[int], list[int]]:
    """(start, end) tag ids of parser `name`'s thinking, as SamplingParams' thinking_start_token_ids (empty: the
    output starts inside it) and thinking_end_token_ids; `encode` tokenizes without special tokens added."""
    if name == "gpt_oss":
        return encode(HARMONY_START), encode(HARMONY_END)
    return ([] if think_format(name).starts_inside else encode(START)), encode(END)


class ThinkStream:
    """Feeds an output's text as it streams; each call returns the new (reasoning, answer) text. Text that may
    be the start of a tag is held back until the next chunk says what it is."""

    def __init__(self, fmt: ThinkFormat) -> None:
        self.state = "start"  # start: not yet known whether the output opens a block; thinking; answer
        self.fmt = fmt
        self.pending = ""
        self.saw_reasoning = False
        self.answer_started = False  # the newlines after </think> are not part of the answer

    def feed(self, new_text: str, done: bool = False) -> tuple[str, str]:
        self.pending += new_text
        reasoning = answer = ""
        if self.state == "start":
            head = self.pending.lstrip()
            if head.startswith(START):
                self.pending, self.state = head[len(START):], "thinking"
            elif START.startswith(head) and head and not done:
                return "", ""  # perhaps "<thi": wait
            else:
                self.state = "thinking" if self.fmt.starts_inside else "answer"
            self.saw_reasoning = self.state == "thinking"
        if self.state == "thinking":
            end = self.pending.find(END)
            if end < 0:
                keep = 0 if done else _partial_suffix(self.pending, END)
                cut = len(self.pending) - keep
                reasoning, self.pending = self.pending[:cut], self.pending[cut:]
                return reasoning, ""
            reasoning, self.pending, self.state = self.pending[:end], self.pending[end + len(END):], "answer"
        answer, self.pending = self.pending, ""
        if self.saw_reasoning and not self.answer_started:
            answer = answer.lstrip("\n")
            self.answer_started = bool(answer)
        return reasoning, answer


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a proper start of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0
