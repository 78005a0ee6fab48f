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


class PlacementGroupConfig(BaseModel):
    """Placement of a multi-rank engine replica (tensor_parallel_size x pipeline_parallel_size ranks): one
    bundle per rank, in the shape Ray Serve LLM's `placement_group_config` takes."""

    model_config = ConfigDict(extra="forbid")

    bundle_per_worker: dict[str, float] | None = Field(
        None, description="Resources of each rank's bundle. Default: {GPU: 1, CPU: 1} with engine.device cuda, "
        "else {CPU: 0.01}: a token amount, so that a multi-rank replica is placed on a small Ray cluster whose "
        "replicas take num_cpus 0. Bundle 0 also holds the replica's own ray_actor_options.")
    strategy: Literal["PACK", "STRICT_PACK", "SPREAD", "STRICT_SPREAD"] | None = Field(
        None, description="Default: STRICT_PACK (one host) without pipeline parallelism, PACK with it (stages "
        "may span hosts).")
    check_fits: bool = Field(
        True, description="Refuse to build the app when the cluster's nodes cannot hold a replica's bundles "
        "(rather than leave it pending forever). Turn off on an autoscaling cluster whose nodes come later.")


# A prefill pool scales on its prefill backlog and TTFT (its requests leave as soon as their prompt is done,
# so KV usage and waiting requests say little there); a decode pool on KV usage and waiting requests.
PREFILL_POLICY_KWARGS = {"target_kv_cache_usage": None, "target_waiting_per_replica": None,
                         "target_queued_prefill_tokens": 4096, "target_ttft_s": 2.0}


# EngineConfig fields that decide the weights or the KV they make: one value for both pools of P/D.
_SAME_WEIGHTS_FIELDS = {"model", "tokenizer", "revision", "dtype", "load_format", "seed", "quantization", "block_size"}


class PoolConfig(BaseModel):
    """One pool of disaggregated prefill/decode: its size, and what its engines do differently."""

    model_config = ConfigDict(extra="forbid")

    num_replicas: int = Field(1, ge=1, description="Replicas, when not autoscaling.")
    autoscaling_config: dict[str, Any] | None = Field(
        None, description="Ray Serve autoscaling_config of the pool (replaces num_replicas); without a `policy`, our "
        "policy on the pool's own signals (a prefill pool: queued prefill tokens and TTFT; a decode pool: KV usage "
        "and waiting requests). min_replicas must stay >= 1.")
    engine: dict[str, Any] = Field(default_factory=dict,
                                   description="EngineConfig fields overriding the top-level `engine`.")
    ray_actor_options: dict[str, Any] | None = Field(
        None, description="Ray actor options of this pool's replicas in place of the top-level ray_actor_options: "
        "e.g. `resources: {prefill_node: 1}` to keep the pool on the nodes that offer that custom resource.")

    @model_validator(mode="after")
    def _never_empty(self) -> PoolConfig:
        if self.autoscaling_config is not None and self.autoscaling_config.get("min_replicas", 1) < 1:
            raise ValueError("autoscaling_config.min_replicas: a pool may not scale to 0 replicas while prefill/decode "
                             "disaggregation is on (requests would find no prefill or no decode replica); "
                             "use 1 or more")
        return self


class DisaggregationConfig(BaseModel):
    """Disaggregated prefill/decode (serve_app/disaggregation): a prefill pool computes prompts, a decode pool
    streams tokens; the decode replica a request lands on decides per request where its prompt is prefilled."""

    model_config = ConfigDict(extra="forbid")

    prefill: PoolConfig = Field(default_factory=PoolConfig)
    decode: PoolConfig = Field(default_factory=PoolConfig)
    min_uncached_prompt_tokens: int = Field(
        512, ge=0, description="A request whose prompt, minus the prefix the chosen prefill replica caches (as the "
        "router sees it), is shorter than this is prefilled where it is decoded: short prompts fit in a decode "
        "step without stretching the streams there, and save a hop and a transfer. 0: always disaggregate.")
    on_transfer_failure: Literal["recompute", "fail"] = Field(
        "recompute", description="When the remote prefill or the KV transfer fails (the prefill replica died, the "
        "lease ran out, the transfer failed or timed out): prefill locally, or fail the request with a 503.")
    transfer_timeout_s: float = Field(
        30.0, gt=0, description="Longest wait for each hop: the remote prefill, the fetch.")
    kv_lease_s: float = Field(
        30.0, gt=0, description="How long a prefill replica holds a prompt's KV for the decode replica to fetch.")


class AppArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str = Field("pagedserve-tiny", description="Built-in model, checkpoint folder or hub id.")
    served_model_name: str | None = Field(None, description="The name clients use; defaults to `model`.")
    engine: dict[str, Any] = Field(default_factory=dict, description="EngineConfig fields (all but model).")
    num_replicas: int = Field(1, ge=1, description="Engine replicas (LLMServer), when not autoscaling.")
    ingress_replicas: int = Field(1, ge=1, description="Ingress replicas (OpenAIIngress).")
    ingress_ray_actor_options: dict[str, Any] = Field(
        default_factory=lambda: {"num_cpus": 0}, description="Ray actor options of each ingress replica: e.g. "
        "`resources: {head_node: 1}` to keep the ingress off the nodes that come and go with the engine replicas.")
    direct_streaming: bool | Literal["auto"] = Field(
        "auto", description="Each engine replica serves clients itself (HTTP and the DeploymentHandle API), with "
        "no ingress deployment: a request and each stream message cross two processes fewer (Ray Serve LLM's direct "
        "streaming; serve_app/engine_ingress.py). With router pow2, HAProxy spreads HTTP requests over the replicas "
        "by least connections; with prefix, HAProxy asks an IngressRouter deployment where each goes "
        "(serve_app/routing/ingress_router.py; needs HAProxy, as `make run` serves). Not with round_robin, "
        "disaggregation, ingress_replicas, ingress_ray_actor_options, data parallelism or runtime LoRA loading (each "
        "replica would keep its own registry). `auto` (the default): on wherever it can be (`streams_directly`).",
    )
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
    reasoning_parser: Literal["deepseek_r1", "qwen3", "gpt_oss"] | None = Field(
        None, description="How a reasoning model's thinking is split from its answer (serve_app/reasoning_parsers.py): "
        "returned as `reasoning` (chat), thinking blocks (Anthropic) or reasoning items (Responses); tool calls "
        "are read from the answer only. gpt_oss needs a Harmony chat template (read without it too).")
    allowed_media_domains: list[str] = Field(
        default_factory=list, description="Hosts (and their subdomains) whose http(s) image URLs the app may fetch; "
        "empty: none (data: URLs only).")
    allowed_local_media_path: str | None = Field(
        None, description="A folder whose files file: image URLs may name; None: file: URLs are refused.")
    media_fetch_timeout_s: float = Field(5.0, gt=0, description="Longest an image URL's fetch may take.")
    max_media_bytes: int = Field(20 * 2**20, ge=1, description="Largest image a request may send or name (bytes).")
    mm_preprocess_workers: int = Field(
        4, ge=1, description="Threads of each ingress that fetch, decode, resize and hash images, off its event loop.")
    responses_store_max_entries: int = Field(
        10_000, ge=1, description="Responses API: most stored responses (store=true), least recently used out first.")
    responses_store_max_bytes: int = Field(
        256 * 2**20, ge=1024, description="Responses API: most bytes of stored responses and their conversations.")
    responses_store_ttl_s: float = Field(
        24 * 3600.0, gt=0, description="Responses API: how long a stored response may be retrieved or continued.")
    max_request_body_bytes: int = Field(
        8 * 2**20, ge=1024, description="Larger request bodies get 413 before they are parsed (default 8 MiB).")
    ray_actor_options: dict[str, Any] = Field(
        default_factory=lambda: {"num_cpus": 0}, description="Ray actor options of each engine replica."
    )
    stream_coalesce_cpu_utilization: float | None = Field(
        0.95, ge=0, le=1,
        description="Streams send each token as soon as the engine makes it, one message per engine step, "
        "unless the CPU is saturated: while the busy share of the CPUs the replica may use (its cgroup's, else "
        "the machine's; over the last second) is at or above this, each stream rests stream_coalesce_interval_s "
        "between messages and the tokens made meanwhile travel together. None: never. Either way a stream whose "
        "consumer lags gets the tokens it has not taken merged.",
    )
    stream_coalesce_interval_s: float = Field(
        0.25, gt=0, le=1, description="The rest between a stream's messages while the CPU is saturated.")
    disaggregation: DisaggregationConfig | None = Field(
        None, description="Disaggregated prefill/decode: a prefill and a decode pool, each sized in its section (the "
        "top-level num_replicas / autoscaling_config are refused then); `router` applies to the prefill pool.")
    placement_group_config: PlacementGroupConfig = Field(
        default_factory=PlacementGroupConfig, description="Bundles of a multi-rank engine replica (engine."
        "tensor_parallel_size / pipeline_parallel_size above 1); unused for one rank.")
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
            raise ValueError("lora_root: allow_runtime_lora_updating needs the folder runtime loads may read adapters "
                             "from")
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
    def _check_data_parallel(self) -> AppArgs:
        """A DP group (serve_app/data_parallel.py) is one deployment whose replicas are its ranks, fixed in number."""
        size = self.engine.get("data_parallel_size", 1)
        if size == 1:
            return self
        if self.autoscaling_config is not None:
            raise ValueError("autoscaling_config: a data-parallel group (engine.data_parallel_size > 1) does not "
                             "scale: each rank holds its share of the experts; remove autoscaling_config")
        if "num_replicas" in self.model_fields_set and self.num_replicas != size:
            raise ValueError(f"num_replicas: {self.num_replicas}, but the replicas of a data-parallel deployment are "
                             f"its engine.data_parallel_size={size} ranks; leave num_replicas out")
        for field, refused in (("disaggregation", self.disaggregation is not None),
                               ("direct_streaming", self.direct_streaming is True)):  # `auto` turns it off here
            if refused:
                raise ValueError(f"{field}: not with engine.data_parallel_size > 1 yet")
        self.num_replicas = size
        return self

    @model_validator(mode="after")
    def _check_disaggregation(self) -> AppArgs:
        if self.disaggregation is None:
            return self
        for field in ("num_replicas", "autoscaling_config"):
            if field in self.model_fields_set:
                raise ValueError(f"{field}: with `disaggregation` set, size each pool in disaggregation.prefill / "
                                 "disaggregation.decode instead")
        if self.router != "prefix":
            raise ValueError("router: disaggregation needs `prefix` for the prefill pool (the decode replica learns "
                             "from it what the chosen prefill replica caches, and fetches the KV from that replica)")
        for role in ("prefill", "decode"):
            overrides = sorted(_SAME_WEIGHTS_FIELDS & getattr(self.disaggregation, role).engine.keys())
            if overrides:  # the decode pool would decode with other weights than those that made the prompt's KV
                raise ValueError(f"disaggregation.{role}.engine.{overrides[0]}: both pools must run the same weights; "
                                 "set it (and `model`) in the top-level `engine` / `model` instead")
            self.engine_config(role)  # fails naming the engine field
        return self

    @model_validator(mode="after")
    def _check_direct_streaming(self) -> AppArgs:
        if self.direct_streaming is not True:
            return self
        if self.router == "round_robin":  # Serve refuses a custom router on a deployment HAProxy balances over
            raise ValueError("router: round_robin is not offered with direct_streaming; set router: pow2 or prefix, "
                             "or direct_streaming: false")
        if fields := self._fields_needing_ingress():
            raise ValueError(f"{fields[0]}: not with direct_streaming (the engine replicas are the ingress); "
                             "set direct_streaming: false")
        return self

    def _fields_needing_ingress(self) -> list[str]:
        """The fields set here that need the ingress deployment: the engine replicas cannot serve clients."""
        return [field for field in ("disaggregation", "ingress_replicas", "allow_runtime_lora_updating")
                if field in self.model_fields_set and getattr(self, field)]

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

    def engine_autoscaling_config(self, role: str | None = None) -> dict[str, Any] | None:
        """The engine deployment's autoscaling_config (with `role`, that pool's), None for a fixed size."""
        source = self.autoscaling_config if role is None else getattr(self.disaggregation, role).autoscaling_config
        if source is None:
            return None
        config = {"metrics_interval_s": 1, "look_back_period_s": 5, "upscale_delay_s": 0, "downscale_delay_s": 0,
                  **source}
        kwargs = PREFILL_POLICY_KWARGS if role == "prefill" else {}
        config.setdefault("policy", {"policy_function": "autoscale.ray_policy:KVQueueAutoscalingPolicy",
                                     "policy_kwargs": kwargs})
        return config

    @property
    def name(self) -> str:
        return self.served_model_name or self.model

    def engine_config(self, role: str | None = None) -> EngineConfig:
        """The engine replicas' EngineConfig; with `role` ("prefill" | "decode"), that pool's: the pool's
        overrides, and its part in the KV transfer."""
        # Replicas run the engine loop in its own process unless told otherwise (engine/core/engine_loop.py: why), and
        # a multi-rank engine's other ranks as Ray actors in the replica's placement group. Small decode steps leave
        # a core to the serving path (EngineConfig.small_step_threads).
        defaults: dict[str, Any] = {"multiprocess": True, "collect_step_timings": self.tracing.detailed,
                                  "enable_lora": self.serves_lora, "small_step_threads": "auto"}
        fields = dict(self.engine)
        if role is not None:
            fields.update(getattr(self.disaggregation, role).engine)
            defaults["kv_transfer_config"] = {"kv_role": "kv_producer" if role == "prefill" else "kv_consumer",
                                              "lease_s": self.disaggregation.kv_lease_s}
        ranks = fields.get("tensor_parallel_size", 1) * fields.get("pipeline_parallel_size", 1)
        if isinstance(ranks, int) and ranks > 1:
            defaults["distributed_executor_backend"] = "ray"
        return EngineConfig(model=self.model, **{**defaults, **fields})

    @property
    def routes_replicas(self) -> bool:
        """Whether requests are routed among several engine replicas (not one fixed replica)."""
        return self.disaggregation is not None or self.autoscaling_config is not None or self.num_replicas > 1

    def streams_directly(self, haproxy: bool) -> bool:
        """Whether the engine replicas serve clients themselves: direct_streaming, where `auto` turns it on unless
        something here needs the ingress deployment (or, for the prefix router, HAProxy is not in front)."""
        if self.direct_streaming != "auto":
            return self.direct_streaming
        return not (self.router == "round_robin" or (self.router == "prefix" and not haproxy and self.routes_replicas)
                    or self._fields_needing_ingress() or self.engine.get("data_parallel_size", 1) > 1
                    or "ingress_ray_actor_options" in self.model_fields_set)

    def pd_settings(self) -> dict[str, Any]:
        d = self.disaggregation
        return {"min_uncached_prompt_tokens": d.min_uncached_prompt_tokens,
                "on_transfer_failure": d.on_transfer_failure, "transfer_timeout_s": d.transfer_timeout_s}

    def placement(self, engine: EngineConfig, role: str | None = None) -> dict[str, Any]:
        """Deployment options of an engine replica (`role`: of that disaggregation pool): its actor options and,
        for a multi-rank replica, one bundle per rank (bundle 0 also holding the replica's resources), the
        strategy, and the replica's GPU (its engine process is the driver rank)."""
        pool = getattr(self.disaggregation, role) if role is not None else None
        actor = dict(pool.ray_actor_options if pool is not None and pool.ray_actor_options is not None
                     else self.ray_actor_options)
        if engine.world_size == 1:
            return {"ray_actor_options": actor}
        cuda = engine.device == "cuda"
        bundle = dict(self.placement_group_config.bundle_per_worker
                      or ({"GPU": 1.0, "CPU": 1.0} if cuda else {"CPU": 0.01}))
        if bundle.get("GPU"):
            actor["num_gpus"] = bundle["GPU"]
        first = {**bundle, "CPU": bundle.get("CPU", 0) + actor.get("num_cpus", 0)}
        for key, amount in actor.get("resources", {}).items():  # Serve places the replica in bundle 0
            first[key] = first.get(key, 0) + amount
        strategy = (self.placement_group_config.strategy
                    or ("STRICT_PACK" if engine.pipeline_parallel_size == 1 else "PACK"))
        return {"placement_group_bundles": [first] + [dict(bundle) for _ in range(engine.world_size - 1)],
                "placement_group_strategy": strategy, "ray_actor_options": actor}
