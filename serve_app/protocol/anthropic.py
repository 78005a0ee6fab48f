"""Anthropic Messages API request and response models (`POST /v1/messages`, `/v1/messages/count_tokens`).

Follows Anthropic's documented shapes. Requests ignore fields we do not know (`metadata`, `tools`,
`cache_control` on blocks, `anthropic-beta` features...); every field we do know is validated here and
fails with its name. Content blocks other than text are rejected, naming the block's place."""

from __future__ import annotations

import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator
from pydantic_core import PydanticCustomError

from serve_app.protocol.openai import MAX_STOP_STRING_LENGTH, MAX_STOP_STRINGS


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")


class TextBlockParam(_Request):
    type: Literal["text"]  # required, as Anthropic's: the schema must not promise that a block without it works
    text: str


def _text_blocks_only(value: Any) -> Any:
    """Before validation: name the unsupported block type, rather than letting pydantic report a
    mismatch against every member of the `str | list[TextBlockParam]` union."""
    if isinstance(value, list):
        for i, block in enumerate(value):
            if not isinstance(block, dict):
                raise PydanticCustomError("invalid_content_block", "block {index}: must be an object with a type",
                                          {"index": i})
            kind = block.get("type")
            if kind != "text":
                raise PydanticCustomError(
                    "unsupported_content_block",
                    "block {index} is of type {kind}; only 'text' content blocks are supported",
                    {"index": i, "kind": repr(kind)},
                )
            if not isinstance(block.get("text"), str):
                raise PydanticCustomError("invalid_content_block", "block {index}: a text block needs a string `text`",
                                          {"index": i})
    return value


def _join(content: str | list[TextBlockParam]) -> str:
    return content if isinstance(content, str) else "".join(block.text for block in content)


class MessageParam(_Request):
    role: Literal["user", "assistant"]
    content: str | list[TextBlockParam]

    @field_validator("content", mode="before")
    @classmethod
    def _check_content(cls, value: Any) -> Any:
        return _text_blocks_only(value)

    def text(self) -> str:
        """The content as one string (text blocks concatenated)."""
        return _join(self.content)


class Conversation(_Request):
    """What `POST /v1/messages/count_tokens` takes, and `POST /v1/messages` too: a model, the turns and a
    system prompt."""

    model: str
    messages: list[MessageParam] = Field(min_length=1)
    system: str | list[TextBlockParam] | None = Field(None, description="System prompt: a string or text blocks.")

    @field_validator("system", mode="before")
    @classmethod
    def _check_system(cls, value: Any) -> Any:
        return _text_blocks_only(value)

    def system_text(self) -> str | None:
        return None if self.system is None else _join(self.system)


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

StopReason = Literal["end_turn", "max_tokens", "stop_sequence"]


class MessageTokensCount(BaseModel):
    """The response of `POST /v1/messages/count_tokens`."""

    input_tokens: int = Field(description="Tokens of the prompt the conversation renders to, system prompt included.")


def new_message_id() -> str:
    return f"msg_{uuid.uuid4().hex}"


class TextBlock(BaseModel):
    type: Literal["text"] = "text"
    text: str


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
    content: list[TextBlock]
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
