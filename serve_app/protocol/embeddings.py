"""OpenAI-compatible embeddings request and response (`POST /v1/embeddings`), with vLLM's extra fields."""

from __future__ import annotations

import time
from typing import Literal

from pydantic import BaseModel, Field, model_validator

from serve_app.protocol.openai import _Request, new_id

MAX_EMBEDDING_INPUTS = 2048  # OpenAI's limit on one request's inputs


class EmbeddingRequest(_Request):
    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]] = Field(
        description="A text, texts, a prompt of token ids, or prompts of token ids.")
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1, description="Fewer values, for Matryoshka models.")
    user: str | None = None
    # vLLM's
    priority: int = 0
    normalize: bool | None = Field(None, description="Unit length; default as the model's pooler says.")
    truncate_prompt_tokens: int | None = Field(None, description="Not supported: refused when set.")

    @model_validator(mode="after")
    def _check(self) -> EmbeddingRequest:
        if self.truncate_prompt_tokens is not None:
            raise ValueError("truncate_prompt_tokens: not supported; send prompts within the model's context")
        items = self.inputs
        if not items or any(len(item) == 0 for item in items):
            raise ValueError("input: must not be empty, nor hold an empty text or prompt")
        if len(items) > MAX_EMBEDDING_INPUTS:
            raise ValueError(f"input: {len(items)} inputs; at most {MAX_EMBEDDING_INPUTS} in one request")
        return self

    @property
    def inputs(self) -> list[str | list[int]]:
        """One prompt per embedding: a text, or token ids."""
        value = self.input
        if isinstance(value, str) or (value and isinstance(value[0], int)):
            return [value]
        return list(value)


class Embedding(BaseModel):
    object: Literal["embedding"] = "embedding"
    embedding: list[float] | str  # floats, or base64 of little-endian float32 (encoding_format)
    index: int


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(BaseModel):
    id: str = Field(default_factory=lambda: new_id("embd"))
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[Embedding]
    usage: EmbeddingUsage
