"""AppArgs: everything a user sets for the application, in YAML (`args:`) or Python. One pydantic model,
validated when the app is built, so a typo fails `serve run` with the field's name."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from engine.config import EngineConfig
from serve_app.tracing import TracingConfig

ROUTERS = {
    "prefix": "serve_app.routing.ray_router.PrefixRouter",  # prefix-cache affinity traded against load
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
    max_queued_requests: int = Field(
        1024, ge=-1, description="Requests an ingress holds for busy engine replicas (all at "
        "max_ongoing_requests) before answering 503 with Retry-After; -1: unbounded (Ray's default).")
    router: Literal["prefix", "pow2", "round_robin"] = Field(
        "prefix", description="How the ingress picks an engine replica: prefix affinity, or Ray's pow2 / round robin."
    )
    router_kwargs: dict[str, Any] = Field(
        default_factory=dict, description="PrefixRouterConfig fields for router=prefix (block_size is set for you)."
    )
    autoscaling_config: dict[str, Any] | None = Field(
        None,
        description="Ray Serve autoscaling_config of the engine replicas (replaces num_replicas). Without a "
        "`policy`, the KV/queue policy (autoscale.ray_policy:KVQueueAutoscalingPolicy) is used.",
    )
    api_keys: list[str] = Field(default_factory=list, description="If set, /v1/* requires one of them.")
    tool_call_parser: Literal["auto", "hermes", "llama3_json", "mistral", "pythonic"] = Field(
        "auto", description="How tool_choice=auto reads tool calls out of the model's text (serve_app/tool_parsers); "
        "`auto` picks by the chat template's markers ([TOOL_CALLS]: mistral, <|python_start|>: pythonic, "
        "<|python_tag|>: llama3_json, else hermes).",
    )
    max_request_body_bytes: int = Field(
        8 * 2**20, ge=1024, description="Larger request bodies get 413 before they are parsed (default 8 MiB).")
    ray_actor_options: dict[str, Any] = Field(
        default_factory=lambda: {"num_cpus": 0}, description="Ray actor options of each engine replica."
    )
    stream_coalesce_cpu_pressure: float | None = Field(
        0.5, ge=0, le=1,
        description="Streams send each token as soon as the engine makes it, one message per engine step, "
        "unless the CPU is saturated: while the CPU pressure (Linux PSI: the share of time some runnable task "
        "waited for a CPU, sampled every 0.5 s) is at or above this, each stream rests stream_coalesce_interval_s "
        "between messages and the tokens made meanwhile travel together. None: never. Either way a stream whose "
        "consumer lags gets the tokens it has not taken merged.",
    )
    stream_coalesce_interval_s: float = Field(
        0.1, gt=0, le=1, description="The rest between a stream's messages while the CPU is saturated.")
    tracing: TracingConfig = Field(default_factory=TracingConfig, description="OpenTelemetry tracing (off by default).")
    graceful_shutdown_timeout_s: float = Field(
        30.0, ge=0, description="How long a stopping engine replica may take to finish its streams."
    )

    @model_validator(mode="after")
    def _check_engine(self) -> AppArgs:
        if "model" in self.engine:
            raise ValueError("engine.model: set the model with the top-level `model` field")
        self.engine_config()  # fails naming the engine field
        return self

    def engine_autoscaling_config(self) -> dict[str, Any] | None:
        if self.autoscaling_config is None:
            return None
        config = {"metrics_interval_s": 1, "look_back_period_s": 5, "upscale_delay_s": 0, "downscale_delay_s": 0,
                  **self.autoscaling_config}
        config.setdefault("policy", {"policy_function": "autoscale.ray_policy:KVQueueAutoscalingPolicy"})
        return config

    @property
    def name(self) -> str:
        return self.served_model_name or self.model

    def engine_config(self) -> EngineConfig:
        # Replicas run the engine loop in its own process unless told otherwise (engine_core.py: why).
        defaults = {"multiprocess": True, "collect_step_timings": self.tracing.detailed}
        return EngineConfig(model=self.model, **{**defaults, **self.engine})
