"""PoolingParams: the one place where an embedding request's parameters are validated (SamplingParams' twin
for requests that pool instead of sampling). Checks that need the model (its width, whether it was trained for
shorter vectors) happen when the engine's InputProcessor accepts the request."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class PoolingParams(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    dimensions: int | None = Field(
        None, ge=1, description="Keep the first this-many values (Matryoshka models only), before normalizing.")
    normalize: bool | None = Field(None, description="Scale to unit length; None: as the checkpoint's pooler says.")
