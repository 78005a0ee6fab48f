"""SamplingParams: the one place where a request's sampling parameters are validated."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator

_GREEDY_EPS = 1e-5  # temperatures below this sample greedily, as in vLLM
MAX_LOGPROBS = 20


class SamplingParams(BaseModel):
    """How to sample one request, with vLLM/OpenAI semantics. Invalid values raise a pydantic
    ValidationError (a ValueError) naming the parameter."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    temperature: float = Field(1.0, ge=0.0, description="0 (or below 1e-5) means greedy.")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling mass, in (0, 1].")
    top_k: int = Field(0, ge=-1, description="Keep the k most likely tokens; 0 or -1 keeps all.")
    seed: int | None = Field(None, description="Per-request seed: same seed, same samples, whatever the batch.")
    max_tokens: int | None = Field(
        16, ge=1, description="Most tokens to generate; None runs to max_model_len."
    )
    ignore_eos: bool = Field(False, description="Keep generating past the EOS token.")
    stop_token_ids: list[int] = Field(default_factory=list, description="Token ids that end the request.")
    logprobs: int | None = Field(
        None, ge=0, le=MAX_LOGPROBS, description="Return the sampled token's logprob and this many top ones."
    )

    @model_validator(mode="after")
    def _check(self) -> SamplingParams:
        if any(t < 0 for t in self.stop_token_ids):
            raise ValueError("stop_token_ids must be non-negative token ids")
        return self

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS
