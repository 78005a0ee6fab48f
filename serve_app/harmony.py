"""OpenAI's Harmony chat format (gpt-oss): what a chat completion's text means once split into messages.

A Harmony model writes messages, each a header and a body:

    <|channel|>analysis<|message|>thinking...<|end|>
    <|start|>assistant<|channel|>final<|message|>the answer                     (<|return|> ends the turn)
    <|start|>assistant to=functions.get_weather<|channel|>commentary <|constrain|>json<|message|>{...}
                                                                                 (<|call|> ends the turn)

The first message's `<|start|>assistant` is the generation prompt's; the recipient (`to=...`) may stand
before or after the channel. The `analysis` channel is the model's reasoning, never content; `final` is
the answer; a message addressed to `functions.NAME` is a call of that tool (on the `commentary` channel);
`commentary` without a recipient is a preamble the user may see, so it is content. The turn's last token
(<|return|> or <|call|>, the model's EOS tokens) is not in the text. A turn that does not open with a
header (a model that ignored the format) is content, whole. Parsing never raises."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

START, END, MESSAGE, CHANNEL, CONSTRAIN = "<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>"
RETURN, CALL = "<|return|>", "<|call|>"
SPECIAL_TOKENS = ("<|startoftext|>", "<|endoftext|>", START, END, MESSAGE, CHANNEL, CONSTRAIN, RETURN, CALL)
FUNCTIONS = "functions."
_BODY_END = re.compile("|".join(re.escape(t) for t in (END, CALL, RETURN)))
_RECIPIENT = re.compile(r"\bto=(\S+)")
_SPECIAL = re.compile("|".join(re.escape(t) for t in SPECIAL_TOKENS))
_HEADER_OPENINGS = (CHANNEL, START, CONSTRAIN, "to=")


def is_harmony_template(chat_template: str | None) -> bool:
    return bool(chat_template) and CHANNEL in chat_template and MESSAGE in chat_template


@dataclass(frozen=True)
class HarmonyMessage:
    channel: str | None
    recipient: str | None
    body: str
    complete: bool  # its body ended (<|end|>, <|call|>, <|return|>); else the text stops inside it


def opens_with_header(text: str) -> bool | None:
    """Whether a turn is in Harmony's format: it opens with a header. None while too short to tell."""
    head = text.lstrip()
    if any(opening.startswith(head) for opening in _HEADER_OPENINGS):
        return None
    return head.startswith(_HEADER_OPENINGS)


def parse_messages(text: str) -> list[HarmonyMessage]:
    """The messages of an assistant turn's text (one that opens with a header), the last maybe unfinished.
    A message runs from its header to its body's end; the next one's `<|start|>role` may be missing."""
    messages, pos = [], 0
    while (at := text.find(MESSAGE, pos)) >= 0:
        header = text[pos:at].rsplit(START, 1)[-1].replace(CONSTRAIN, " ")
        end = _BODY_END.search(text, at + len(MESSAGE))
        body = text[at + len(MESSAGE) : end.start() if end else len(text)]
        channel = header.split(CHANNEL, 1)[1].split(maxsplit=1)[:1] if CHANNEL in header else []
        recipient = _RECIPIENT.search(header.replace(CHANNEL, " "))
        messages.append(HarmonyMessage(channel[0] if channel else None, recipient.group(1) if recipient else None,
                                       _without_special_tokens(body), end is not None))
        if end is None:
            break
        pos = end.end()
    return messages


def _without_special_tokens(text: str) -> str:
    """Text as skip_special_tokens would show it: the chat routes decode with Harmony's tokens kept."""
    return _SPECIAL.sub("", text) if "<|" in text else text


@dataclass(frozen=True)
class HarmonyOutput:
    reasoning: str | None
    content: str | None
    calls: list[tuple[str, str]]  # (tool name, arguments as JSON text) of each complete call


def split_output(text: str) -> HarmonyOutput:
    """Reasoning, content and tool calls of a whole (or, streaming, partial) assistant turn."""
    if not opens_with_header(text):
        return HarmonyOutput(None, _without_special_tokens(text) or None, [])
    reasoning, content, calls = [], [], []
    for m in parse_messages(text):
        if m.recipient and m.recipient.startswith(FUNCTIONS):
            if m.complete or m.body.strip():
                calls.append((m.recipient[len(FUNCTIONS):], _arguments(m.body)))
        elif m.channel == "analysis":
            reasoning.append(m.body)
        elif m.recipient is None:  # final, or a commentary preamble; messages to other recipients are not shown
            content.append(m.body)
    return HarmonyOutput("".join(reasoning) or None, "".join(content) or None, calls)


def _arguments(body: str) -> str:
    """A call's arguments as compact JSON when they parse, else as the model wrote them."""
    try:
        return json.dumps(json.loads(body), ensure_ascii=False)
    except ValueError:
        return body.strip()


@dataclass
class HarmonyStream:
    """One choice's streamed turn: each chunk's new reasoning and content, the calls once the turn ends."""

    text: str = ""
    reasoning_sent: int = 0
    content_sent: int = 0

    def delta(self, new_text: str, done: bool) -> tuple[str | None, str | None, list[tuple[str, str]]]:
        """(reasoning delta, content delta, calls: only when `done`)."""
        self.text += new_text
        if opens_with_header(self.text) is None and not done:
            return None, None, []  # too short to tell plain text from a header
        out = split_output(self.text)
        reasoning, content = out.reasoning or "", out.content or ""
        r, self.reasoning_sent = reasoning[self.reasoning_sent:], max(self.reasoning_sent, len(reasoning))
        c, self.content_sent = content[self.content_sent:], max(self.content_sent, len(content))
        return r or None, c or None, out.calls if done else []
