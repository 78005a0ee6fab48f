"""SpeculativeConfig: how the engine drafts tokens for decoding requests and verifies them in one
target forward. Validated at construction; an invalid value raises a pydantic ValidationError (a
ValueError) whose location names the field, e.g. `speculative_config.num_speculative_tokens`."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class SpeculativeConfig(BaseModel):
    """`ngram` drafts by prompt lookup (the tokens that followed an earlier occurrence of the request's
    last n tokens); `draft_model` drafts with a smaller model sharing the target's vocabulary, whose KV
    lives in the same blocks (same block ids and tables) as the target's; `mtp` drafts with the multi-token
    prediction layer the checkpoint ships (DeepSeek-V3), fed the target's hidden states, its KV kept the
    same way."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    method: Literal["ngram", "draft_model", "mtp"] = Field(
        description="`ngram`: prompt lookup, no extra model. `draft_model`: a small model given by `model`. "
        "`mtp`: the checkpoint's multi-token prediction layer (DeepSeek-V3), chained for k > 1."
    )
    num_speculative_tokens: int = Field(
        4, ge=1, le=16, description="Most draft tokens per request per step (k); the target verifies k + 1 positions."
    )
    prompt_lookup_min: int = Field(
        2, ge=1, description="ngram only: shortest suffix n-gram looked up in the request's earlier tokens."
    )
    prompt_lookup_max: int = Field(
        4, ge=1, description="ngram only: longest suffix n-gram tried first (longer matches predict better)."
    )
    model: str | None = Field(
        None,
        description="draft_model only: a built-in name, checkpoint folder or hub id of the draft. It must share "
        "the target's vocabulary; it is loaded with the target's dtype and load_format.",
    )

    @model_validator(mode="after")
    def _check(self) -> SpeculativeConfig:
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(
                f"prompt_lookup_min: {self.prompt_lookup_min} exceeds prompt_lookup_max={self.prompt_lookup_max}; "
                "lower it or raise prompt_lookup_max"
            )
        if self.method == "draft_model" and not self.model:
            raise ValueError("model: method='draft_model' needs the draft's name or folder in `model`")
        if self.method != "draft_model" and self.model is not None:
            raise ValueError("model: only used with method='draft_model'; drop it or change `method`")
        return self
