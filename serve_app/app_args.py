"""AppArgs: everything a user sets for the application, in YAML (`args:`) or Python. One pydantic model,
validated when the app is built, so a typo fails `serve run` with the field's name."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from engine.config import EngineConfig
from serve_app.lora_registry import LoRAModule
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
    api_keys_env: str | None = Field(
        None, pattern=r"^[A-Za-z_][A-Za-z0-9_]*$",
        description="Instead of `api_keys`: the name of an environment variable holding the keys, comma-separated "
        "(a Kubernetes Secret mounted as env). Read by each ingress replica when it starts, so the keys never "
        "travel in the Serve config; an unset or empty variable fails the replica rather than serving /v1 open.",
    )
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
    stream_messages_per_s: float = Field(
        100.0, ge=0,
        description="Message budget of each engine replica's streams: each stream rests (streams in flight / "
        "budget) seconds between messages, and tokens made meanwhile travel together; the first token always "
        "leaves at once. 0 sends every step's tokens as its own message.",
    )
    tracing: TracingConfig = Field(default_factory=TracingConfig, description="OpenTelemetry tracing (off by default).")
    graceful_shutdown_timeout_s: float = Field(
        30.0, ge=0, description="How long a stopping engine replica may take to finish its streams."
    )

    lora_modules: list[LoRAModule] = Field(
        default_factory=list,
        description="LoRA adapters served from the start, `[{name, path}]` (PEFT folders): clients name one as the "
        "`model` (or `<model>:<name>`). Turns on engine.enable_lora; size it with engine.max_loras, max_lora_rank, "
        "max_cpu_loras.",
    )
    lora_root: str | None = Field(
        None, description="The folder runtime loads may read adapters from (nothing outside it), and where the "
        "registry of runtime-loaded adapters is kept (serve_app/lora_registry.py). Must be readable by every replica.",
    )
    allow_runtime_lora_updating: bool = Field(
        False, description="Serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (behind api_keys when set; "
        "paths under lora_root only). Off by default: loading adapters is an operator's action.",
    )

    @model_validator(mode="after")
    def _check_lora(self) -> AppArgs:
        if self.allow_runtime_lora_updating and not self.lora_root:
            raise ValueError("lora_root: allow_runtime_lora_updating needs the folder runtime loads may read adapters from")
        return self

    @property
    def serves_lora(self) -> bool:
        return bool(self.lora_modules) or self.allow_runtime_lora_updating

    @model_validator(mode="after")
    def _check_engine(self) -> AppArgs:
        if "model" in self.engine:
            raise ValueError("engine.model: set the model with the top-level `model` field")
        self.engine_config()  # fails naming the engine field
        return self

    @model_validator(mode="after")
    def _check_api_keys(self) -> AppArgs:
        if self.api_keys and self.api_keys_env:
            raise ValueError("api_keys, api_keys_env: set one of them, not both")
        return self

    def resolve_api_keys(self, environ: Mapping[str, str] = os.environ) -> list[str]:
        """The keys /v1/* accepts: `api_keys`, or those in the variable `api_keys_env` names."""
        if self.api_keys_env is None:
            return list(self.api_keys)
        keys = [k.strip() for k in environ.get(self.api_keys_env, "").split(",") if k.strip()]
        if not keys:
            raise ValueError(f"api_keys_env: the environment variable {self.api_keys_env} is unset or holds no key; "
                             "refusing to serve /v1 without API keys")
        return keys

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
        defaults = {"multiprocess": True, "collect_step_timings": self.tracing.detailed, "enable_lora": self.serves_lora}
        return EngineConfig(model=self.model, **{**defaults, **self.engine})
