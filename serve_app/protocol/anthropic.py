"""Anthropic Messages API request and response models (`POST /v1/messages`, `/v1/messages/count_tokens`).

Follows Anthropic's documented shapes. Requests ignore fields we do not know (`metadata`, `cache_control`
on blocks, `anthropic-beta` features...); every field we do know is validated here and fails with its
name. Content blocks are text, `tool_use` and `thinking` (assistant turns: an earlier turn's thinking is
accepted and left out of the prompt), `tool_result` and `image` (user turns); others (documents) are
rejected, naming the block's place. Tools are client tools with an
`input_schema`; Anthropic's server tools (web search, code execution...) are rejected naming `tools`."""

from __future__ import annotations

import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator
from pydantic_core import PydanticCustomError

from engine.sampling_params import check_json_schema
from engine.text_validation import ValidTextModel
from serve_app.protocol.openai import MAX_STOP_STRING_LENGTH, MAX_STOP_STRINGS


class _Request(ValidTextModel):
    model_config = ConfigDict(extra="ignore")


class TextBlockParam(_Request):
    type: Literal["text"]  # required, as Anthropic's: the schema must not promise that a block without it works
    text: str


class ToolUseBlockParam(_Request):
    """A tool call the assistant made, sent back in the conversation."""

    type: Literal["tool_use"]
    id: str = Field(min_length=1, max_length=256)
    name: str = Field(min_length=1, max_length=128)
    input: dict[str, Any]


class ToolResultBlockParam(_Request):
    """The caller's result of a tool call (in a user turn), as text or text blocks."""

    type: Literal["tool_result"]
    tool_use_id: str = Field(min_length=1, max_length=256)
    content: str | list[TextBlockParam] = ""
    is_error: bool = False

    @field_validator("content", mode="before")
    @classmethod
    def _check_content(cls, value: Any) -> Any:
        return _blocks(value, ("text",))

    def text(self) -> str:
        return _join(self.content)


class ImageSource(_Request):
    type: Literal["base64", "url"]
    media_type: str | None = None  # base64
    data: str | None = None  # base64
    url: str | None = None  # url

    def data_url(self) -> str | None:
        """The image as the OpenAI route's image_url takes it (None when the source lacks its field)."""
        if self.type == "base64":
            return f"data:{self.media_type or 'image/png'};base64,{self.data}" if self.data else None
        return self.url


class ImageBlockParam(_Request):
    """An image in a user turn (for a vision-language model)."""

    type: Literal["image"]
    source: ImageSource


class ThinkingBlockParam(_Request):
    """An earlier turn's thinking, sent back with its signature: accepted, and left out of the prompt (chat
    templates take no reasoning back)."""

    type: Literal["thinking", "redacted_thinking"]
    thinking: str | None = None
    signature: str | None = None
    data: str | None = None


ContentBlockParam = Annotated[TextBlockParam | ToolUseBlockParam | ToolResultBlockParam | ImageBlockParam
                              | ThinkingBlockParam, Field(discriminator="type")]


def _blocks(value: Any, allowed: tuple[str, ...]) -> Any:
    """Before validation: name an unsupported or malformed block, rather than letting pydantic report a
    mismatch against every member of the union."""
    if isinstance(value, list):
        for i, block in enumerate(value):
            if not isinstance(block, dict):
                raise PydanticCustomError("invalid_content_block", "block {index}: must be an object with a type",
                                          {"index": i})
            kind = block.get("type")
            if kind not in allowed:
                raise PydanticCustomError(
                    "unsupported_content_block",
                    "block {index} is of type {kind}; only {allowed} blocks are supported here",
                    {"index": i, "kind": repr(kind), "allowed": ", ".join(repr(a) for a in allowed)},
                )
            for key, kinds in _REQUIRED[kind].items():
                if not isinstance(block.get(key), kinds):
                    raise PydanticCustomError("invalid_content_block", "block {index}: a {kind} block needs {key}",
                                              {"index": i, "kind": kind, "key": _REQUIRED_NAMES[key]})
    return value


# What each block type must carry, checked before the union is tried (its errors would name the wrong branch).
_REQUIRED = {"text": {"text": str}, "tool_use": {"id": str, "name": str, "input": dict},
             "tool_result": {"tool_use_id": str}, "image": {"source": dict}, "thinking": {"thinking": str},
             "redacted_thinking": {}}
_REQUIRED_NAMES = {"text": "a string `text`", "id": "a string `id`", "name": "a string `name`",
                   "input": "an object `input`", "tool_use_id": "a string `tool_use_id`",
                   "source": "an object `source`", "thinking": "a string `thinking`"}


def _join(content: str | list[TextBlockParam]) -> str:
    return content if isinstance(content, str) else "".join(block.text for block in content)


class MessageParam(_Request):
    role: Literal["user", "assistant"]
    content: str | list[ContentBlockParam]

    @field_validator("content", mode="before")
    @classmethod
    def _check_content(cls, value: Any, info: ValidationInfo) -> Any:
        # tool_use blocks belong to assistant turns, tool_result blocks to user turns (Anthropic's rule).
        assistant = info.data.get("role") == "assistant"
        return _blocks(value, ("text", "tool_use", "thinking", "redacted_thinking") if assistant
                       else ("text", "tool_result", "image"))

    def text(self) -> str:
        """The text blocks' text, concatenated (tool blocks left out)."""
        if isinstance(self.content, str):
            return self.content
        return "".join(b.text for b in self.content if isinstance(b, TextBlockParam))

    def blocks(self) -> list[TextBlockParam | ToolUseBlockParam | ToolResultBlockParam | ImageBlockParam]:
        return [TextBlockParam(type="text", text=self.content)] if isinstance(self.content, str) else list(self.content)


class ToolParam(_Request):
    """A client tool: its name, what it does, and the JSON schema of its input (an object)."""

    type: Literal["custom"] | None = None  # first: a server tool is named as such, not as one missing a schema
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    input_schema: dict[str, Any]

    @field_validator("type", mode="before")
    @classmethod
    def _no_server_tools(cls, value: Any) -> Any:
        if value not in (None, "custom"):
            raise PydanticCustomError(
                "unsupported_tool", "Anthropic's server tools ({kind}) are not supported; give client tools with a "
                "name and an input_schema", {"kind": repr(value)})
        return value

    @field_validator("input_schema")
    @classmethod
    def _check_schema(cls, value: dict[str, Any]) -> dict[str, Any]:
        if value.get("type") != "object":
            raise ValueError('must be a JSON schema of type "object"')
        check_json_schema(value)
        return value


class ToolChoice(_Request):
    """auto: the model decides; any: it must call some tool; tool: it must call `name`; none: no calls.
    disable_parallel_tool_use: at most one call (exactly one with any and tool)."""

    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False

    @model_validator(mode="after")
    def _check_name(self) -> ToolChoice:
        if (self.type == "tool") != (self.name is not None):
            raise ValueError("tool_choice: `name` is required with type 'tool' and allowed with no other type")
        return self


class Conversation(_Request):
    """What `POST /v1/messages/count_tokens` takes, and `POST /v1/messages` too: a model, the turns, a
    system prompt and the tools."""

    model: str
    messages: list[MessageParam] = Field(min_length=1)
    system: str | list[TextBlockParam] | None = Field(None, description="System prompt: a string or text blocks.")
    tools: list[ToolParam] | None = Field(None, description="Client tools the model may call.")
    tool_choice: ToolChoice | None = Field(None, description="How the model uses the tools (default auto).")

    @field_validator("system", mode="before")
    @classmethod
    def _check_system(cls, value: Any) -> Any:
        return _blocks(value, ("text",))

    def system_text(self) -> str | None:
        return None if self.system is None else _join(self.system)


class ThinkingConfig(_Request):
    """Extended thinking: with the app's reasoning_parser, the model's reasoning comes back as thinking
    blocks. budget_tokens is checked as Anthropic checks it, and the engine ends the thinking at it."""

    type: Literal["enabled", "disabled"]
    budget_tokens: int | None = Field(None, ge=1024)


class MessagesRequest(Conversation):
    """The request body of `POST /v1/messages`."""

    max_tokens: int = Field(ge=1, description="Most tokens to generate (required).")
    stop_sequences: list[str] | None = Field(None, description="Strings that end the output (not included in it).")
    temperature: float | None = Field(None, ge=0.0, le=1.0, description="0 to 1; defaults to 1.")
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0, description="Keep the k most likely tokens; 0 keeps all.")
    stream: bool = False
    metadata: dict[str, Any] | None = Field(None, description="Accepted and ignored.")
    ignore_eos: bool = Field(False, description="vLLM extension: keep generating past the end-of-sequence token.")
    thinking: ThinkingConfig | None = None

    @model_validator(mode="after")
    def _check_thinking(self) -> MessagesRequest:
        t = self.thinking
        if t is not None and t.type == "enabled" and (t.budget_tokens is None or t.budget_tokens >= self.max_tokens):
            raise PydanticCustomError("invalid_thinking", "thinking.budget_tokens: enabled thinking needs a budget "
                                      "of at least 1024 tokens, below max_tokens", {})
        return self

    @property
    def thinking_enabled(self) -> bool:
        return self.thinking is not None and self.thinking.type == "enabled"

    @field_validator("stop_sequences")
    @classmethod
    def _check_stop(cls, value: list[str] | None) -> list[str] | None:
        stops = value or []
        if len(stops) > MAX_STOP_STRINGS:
            raise PydanticCustomError("too_many_stop_sequences", "at most {limit} stop sequences",
                                      {"limit": MAX_STOP_STRINGS})
        if any(not s or len(s) > MAX_STOP_STRING_LENGTH for s in stops):
            raise PydanticCustomError("invalid_stop_sequence", "stop sequences must be 1 to {limit} characters",
                                      {"limit": MAX_STOP_STRING_LENGTH})
        return value


# --- responses -------------------------------------------------------------------------------------

StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]


class MessageTokensCount(BaseModel):
    """The response of `POST /v1/messages/count_tokens`."""

    input_tokens: int = Field(description="Tokens of the prompt the conversation renders to, system prompt included.")


def new_message_id() -> str:
    return f"msg_{uuid.uuid4().hex}"


def new_tool_use_id() -> str:
    return f"toolu_{uuid.uuid4().hex[:24]}"


class TextBlock(BaseModel):
    type: Literal["text"] = "text"
    text: str


class ThinkingBlock(BaseModel):
    type: Literal["thinking"] = "thinking"
    thinking: str
    signature: str = ""  # Anthropic signs its thinking; a client sends it back, which this server accepts


class ToolUseBlock(BaseModel):
    type: Literal["tool_use"] = "tool_use"
    id: str
    name: str
    input: dict[str, Any]


class MessagesUsage(BaseModel):
    """Anthropic's accounting: `input_tokens` are the prompt tokens NOT read from the prefix cache;
    input_tokens + cache_read_input_tokens is the whole prompt."""

    input_tokens: int
    output_tokens: int
    cache_creation_input_tokens: int = 0  # the prefix cache fills itself, at no extra cost
    cache_read_input_tokens: int = 0


class MessagesResponse(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    content: list[ThinkingBlock | TextBlock | ToolUseBlock]
    model: str
    stop_reason: StopReason | None = None  # null only in a stream's message_start
    stop_sequence: str | None = None
    usage: MessagesUsage


class AnthropicErrorInfo(BaseModel):
    type: str
    message: str


class AnthropicErrorResponse(BaseModel):
    type: Literal["error"] = "error"
    error: AnthropicErrorInfo
