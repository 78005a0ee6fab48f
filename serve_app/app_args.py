"""AppArgs: everything a user sets for the application, in YAML (`args:`) or Python. One pydantic model,
validated when the app is built, so a typo fails `serve run` with the field's name."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from engine.config import EngineConfig

ROUTERS = {
    "pow2": None,  # Ray Serve's default power-of-two-choices router
    "round_robin": "ray.serve.experimental.round_robin_router.RoundRobinRouter",
}


class AppArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str = Field("pagedserve-tiny", description="Built-in model, checkpoint folder or hub id.")
    served_model_name: str | None = Field(None, description="The name clients use; defaults to `model`.")
    engine: dict[str, Any] = Field(default_factory=dict, description="EngineConfig fields (all but model).")
    num_replicas: int = Field(1, ge=1, description="Engine replicas (LLMServer), when not autoscaling.")
    ingress_replicas: int = Field(1, ge=1, description="Ingress replicas (OpenAIIngress).")
    max_ongoing_requests: int = Field(256, ge=1, description="Requests in flight per engine replica.")
    router: Literal["pow2", "round_robin"] = Field("pow2", description="How the ingress picks an engine replica.")
    api_keys: list[str] = Field(default_factory=list, description="If set, /v1/* requires one of them.")
    ray_actor_options: dict[str, Any] = Field(
        default_factory=lambda: {"num_cpus": 0}, description="Ray actor options of each engine replica."
    )
    stream_messages_per_s: float = Field(
        100.0, ge=0,
        description="Message budget of each engine replica's streams: each stream rests (streams in flight / "
        "budget) seconds between messages, and tokens made meanwhile travel together; the first token always "
        "leaves at once. 0 sends every step's tokens as its own message.",
    )
    graceful_shutdown_timeout_s: float = Field(
        30.0, ge=0, description="How long a stopping engine replica may take to finish its streams."
    )

    @model_validator(mode="after")
    def _check_engine(self) -> AppArgs:
        if "model" in self.engine:
            raise ValueError("engine.model: set the model with the top-level `model` field")
        self.engine_config()  # fails naming the engine field
        return self

    @property
    def name(self) -> str:
        return self.served_model_name or self.model

    def engine_config(self) -> EngineConfig:
        # Replicas run the engine loop in its own process unless told otherwise (engine_core.py: why).
        return EngineConfig(model=self.model, **{"multiprocess": True, **self.engine})
