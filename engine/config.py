"""EngineConfig: everything that shapes one engine instance, validated once at construction."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from engine.kv_transfer.config import KVTransferConfig
from engine.pooling.config import PoolerConfig
from engine.spec_decode.config import SpeculativeConfig

if TYPE_CHECKING:
    from engine.models.config import ModelConfig

DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048


class EngineConfig(BaseModel):
    """Configuration of one inference engine. An invalid value raises a pydantic ValidationError
    (a ValueError) whose location names the field."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    model: str = Field(
        description="A built-in model name (see engine.models.builtin), a local Hugging Face folder, "
        "or a Hugging Face hub id (downloaded into the hub cache)."
    )
    task: Literal["generate", "embed"] = Field(
        "generate",
        description="`generate` samples tokens; `embed` runs the model as an embedder (vLLM's pooling runner): each "
        "request's prompt is computed in prefill-only steps and pooled into one vector as `pooler_config` (or the "
        "checkpoint's sentence-transformers files) says; it holds no KV once its prompt is done.",
    )
    pooler_config: PoolerConfig | None = Field(
        None, description="task 'embed': override the checkpoint's pooling (e.g. {'pooling_type': 'mean'}).")
    tokenizer: str | None = Field(None, description="Tokenizer folder or hub id; defaults to `model`.")
    revision: str | None = Field(None, description="Hub revision (branch, tag or commit) of `model`.")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto",
        description="Weight and activation dtype. `auto` takes the checkpoint's dtype, except float16 "
        "on CPU, which runs as float32 (CPU float16 matmuls are slow).",
    )
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="`auto` picks cuda when available.")
    load_format: Literal["auto", "safetensors", "dummy"] = Field(
        "auto",
        description="`safetensors` reads the checkpoint's weights; `dummy` draws random weights at the "
        "checkpoint's shapes (for benchmarks); `auto` is safetensors.",
    )
    block_size: int = Field(16, ge=1, le=1024, description="Tokens per KV-cache block.")
    num_kv_blocks: int | None = Field(
        None, ge=2, description="Exact number of KV-cache blocks; overrides the memory budget."
    )
    kv_cache_memory_gb: float | None = Field(
        None,
        gt=0,
        description="KV-cache memory budget of each rank, in GiB. Default: 2 GiB on CPU; on CUDA, what "
        "`gpu_memory_utilization` leaves after the weights. Ranks agree on the smallest block count.",
    )
    gpu_memory_utilization: float = Field(
        0.9, gt=0, le=1, description="Fraction of GPU memory the engine may use (CUDA only)."
    )
    max_num_seqs: int = Field(256, ge=1, description="Most requests running in one step.")
    limit_mm_per_prompt: dict[str, int] = Field(
        default_factory=dict, description="Most items of each modality in one prompt (vLLM's), e.g. {'image': 4}."
    )
    mm_processor_kwargs: dict[str, Any] | None = Field(
        None, description="Settings passed to the checkpoint's image processor (part of each image's hash)."
    )
    mm_encoder_cache_gb: float = Field(
        0.5, gt=0, description="Memory for image embeddings kept between steps and requests (the encoder cache)."
    )
    mm_processor_cache_gb: float = Field(
        4.0, ge=0, description="Memory for processed images (resized, normalized) by content hash, where requests "
        "are prepared (an ingress, or the offline LLM): an image sent again skips its processing. 0: off."
    )
    max_num_encoder_input_tokens: int | None = Field(
        None, ge=1, description="Image embeddings the vision encoder computes in one step (vLLM's): a prompt's "
        "chunk stops before an image past it, so that a burst of images does not stall every decode. Default "
        "max_num_batched_tokens; an image larger than it is encoded alone in its step."
    )
    max_num_batched_tokens: int | None = Field(
        None,
        ge=1,
        description="Token budget of one step, prefill and decode together. Default 2048, or "
        "max_model_len when chunked prefill is off.",
    )
    max_model_len: int | None = Field(
        None, ge=2, description="Longest prompt + output; defaults to the model's max_position_embeddings."
    )
    enable_prefix_caching: bool = Field(True, description="Reuse KV blocks of identical prompt prefixes.")
    enable_chunked_prefill: bool = Field(
        True, description="Split long prompts across steps so that decodes keep flowing."
    )
    seed: int = Field(0, description="Seed for dummy weights and for requests sampled without a seed.")
    multiprocess: bool = Field(
        False,
        description="AsyncLLM only: run the step loop in a process of its own instead of a thread, so "
        "that it keeps its own GIL. Servers want this; the serving app turns it on.",
    )
    num_threads: int | None = Field(
        None,
        ge=1,
        description="CPU threads for torch in each rank's process (torch.set_num_threads). Give each engine "
        "replica its share of the cores: oversubscribed OpenMP threads spin against each other. Default: "
        "torch's own for one rank; the host's cores shared out among its ranks for several.",
    )
    small_step_threads: Annotated[int, Field(ge=1)] | Literal["auto"] | None = Field(
        None,
        description="CPU threads for steps of at most `small_step_max_tokens` tokens (None: num_threads), as "
        "llama.cpp's --threads beside --threads-batch. Such steps only stream the weights once, and a second "
        "thread speeds them up little (56M model, 2 cores: decode of 8 sequences 5.0 ms on 2 threads, 5.9 ms "
        "on 1) while it takes a core from everything else: in a server on few cores, the HTTP ingress and the "
        "replica that stream tokens out. Steps with prefill tokens keep num_threads. `auto`: one thread fewer "
        "than the rank's, a core left to the serving path (the serving app's default; the offline LLM's is None).",
    )
    small_step_max_tokens: int = Field(
        8, ge=1, description="The most tokens (sequences times tokens each) a step runs with small_step_threads."
    )
    collect_step_timings: bool = Field(
        False,
        description="Record on each request the engine steps it took part in (RequestMetrics.steps: model "
        "execution start/end, its tokens, the batch's shape), for detailed traces. Costs an append per "
        "scheduled request per step; the serving app turns it on with `tracing.detailed`.",
    )
    attention_backend: Literal["auto", "torch", "flashinfer"] = Field(
        "auto", description="`auto` is flashinfer on CUDA when installed, torch otherwise."
    )
    scheduling_policy: Literal["fcfs", "priority"] = Field(
        "fcfs",
        description="`fcfs` serves in arrival order; `priority` serves lower `priority` values first and "
        "preempts the highest value (then the latest arrival) when blocks run out.",
    )
    max_waiting_requests: int | None = Field(
        None,
        ge=0,
        description="AsyncLLM admission control: beyond this many waiting requests, `generate` raises "
        "EngineOverloadedError at once (HTTP 429). None: unbounded.",
    )
    tensor_parallel_size: int = Field(
        1, ge=1, description="Ranks each layer is split across (attention heads, MLP and vocabulary slices); "
        "two all-reduces per layer. Within a host.",
    )
    pipeline_parallel_size: int = Field(
        1, ge=1, description="Stages the layers are split across (the first holds the embedding, the last the "
        "norm and LM head); up to this many batches are in flight so that stages overlap. May span hosts.",
    )
    enable_expert_parallel: bool = Field(
        False,
        description="Mixture-of-experts models under tensor parallelism: partition the experts across the TP ranks "
        "(num_experts / tensor_parallel_size whole experts each) instead of slicing every expert across them. Every "
        "rank still routes every token and the partial outputs are all-reduced, as with slicing; fewer, larger "
        "expert matmuls per rank. Refused for a model without experts.",
    )
    data_parallel_size: int = Field(
        1, ge=1,
        description="Mixture-of-experts models: engines (DP ranks) each with its own scheduler, KV cache and "
        "tensor_parallel_size ranks, which run attention for their own requests only, while every MoE layer's "
        "experts are sharded across all data_parallel_size x tensor_parallel_size ranks (vLLM's DP attention + "
        "EP; enable_expert_parallel partitions whole experts, else each expert is sliced). The ranks step in "
        "lockstep, a rank without work running a one-token dummy step, and sleep together when all are idle. "
        "The offline LLM starts the ranks as processes and spreads requests across them. Refused for a dense "
        "model (serve replicas of it instead) and with pipeline parallelism, speculative decoding, LoRA, KV "
        "transfer, quantization and task='embed'.",
    )
    data_parallel_rank: int = Field(
        0, ge=0, description="Internal, set by whoever starts a data-parallel group's engines: this engine's DP rank."
    )
    data_parallel_master: str | None = Field(
        None,
        description="Internal, set by whoever starts a data-parallel group's engines and hosts its store: "
        "'host:port' of the TCPStore the group's ranks meet at. None: not started yet (the offline LLM starts "
        "the group itself).",
    )
    data_parallel_rank_local: int | None = Field(
        None, ge=0,
        description="Internal: this DP rank's index among the group's engines on its host, when they share the "
        "host's GPUs (the offline LLM): its ranks take GPUs from data_parallel_rank_local x world_size on. None: "
        "the engine's process sees only its own GPUs.",
    )
    distributed_executor_backend: Literal["uni", "mp", "ray"] | None = Field(
        None,
        description="Who runs the ranks: `uni` one rank in the engine's process; `mp` worker processes this "
        "engine spawns (offline `LLM`, `AsyncLLM`); `ray` Ray actors in a Serve replica's placement group (the "
        "serving app sets it). None: uni for one rank, else mp.",
    )
    step_timeout_s: float = Field(
        300.0, gt=0,
        description="Multi-rank engines: a rank silent this long in a step (hung, or its host gone) is dead and "
        "the engine fails rather than wait. Generous: a long CPU prefill step can take seconds.",
    )
    kv_transfer_config: KVTransferConfig | None = Field(
        None,
        description="Disaggregated prefill/decode (a KVTransferConfig or a dict): this engine produces KV for "
        "other engines (requests with kv_transfer_params {do_remote_decode: true}) and/or loads KV they "
        "produced (kv_transfer_params from a producer's output). None: off.",
    )
    quantization: Literal["gptq", "awq", "compressed-tensors", "fp8",
                          "int8", "int4", "w8a8", "w4a8"] | None = Field(
        None,
        description="Quantized weights. None: as the checkpoint's `quantization_config` says (GPTQ, AWQ, "
        "compressed-tensors W4A16/W8A16/W8A8, FP8), or dense. A checkpoint format's name: the same, checked against "
        "the checkpoint. `int8` / `int4`: quantize a dense checkpoint's decoder projections at load, weight-only "
        "(int8 per output row, int4 in groups of 128 input columns). `w8a8`: int8 weights and int8 activations "
        "quantized per token as they arrive (integer dot products: VNNI where the CPU has it); `w4a8` (opt-in): int4 "
        "weights, symmetric in int4's groups, with int8 activations. On CPU int8 and "
        "4-bit weights run through weight-only kernels; FP8 and grouped 8-bit weights are dequantized at load.",
    )
    speculative_config: SpeculativeConfig | None = Field(
        None,
        description="Speculative decoding (a SpeculativeConfig or a dict of its fields): draft tokens by n-gram "
        "lookup or a draft model and verify them in one target forward. Greedy output is unchanged; sampled "
        "output keeps the target's distribution. None: off.",
    )

    enable_lora: bool = Field(
        False,
        description="Serve LoRA adapters (PEFT folders) on top of the base model: requests name one with a "
        "LoRARequest, and one batch mixes adapters and the base model.",
    )
    max_loras: int = Field(
        1, ge=1, description="Adapter slots on the device: the most adapters one batch can mix (enable_lora)."
    )
    max_lora_rank: int = Field(16, ge=1, le=512, description="The highest adapter rank `r` accepted (enable_lora).")
    max_cpu_loras: int | None = Field(
        None, ge=1,
        description="Adapters kept in host memory (an LRU), so that a slot is refilled without reading the disk; "
        "at least max_loras. None: max_loras.",
    )

    @model_validator(mode="after")
    def _check_lora(self) -> EngineConfig:
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(
                f"max_cpu_loras: {self.max_cpu_loras} is below max_loras={self.max_loras}; host memory must hold at "
                "least the adapters on the device"
            )
        return self

    @property
    def cpu_lora_capacity(self) -> int:
        return self.max_cpu_loras if self.max_cpu_loras is not None else self.max_loras

    @model_validator(mode="after")
    def _check_speculative_pairs(self) -> EngineConfig:
        # Feature pairs (README): KV loaded from a producer is the target's alone; a draft model would attend to
        # prompt KV it never wrote (greedy output stays right, its drafts are noise: acceptance is lost unseen).
        spec, transfer = self.speculative_config, self.kv_transfer_config
        consumer = transfer is not None and transfer.kv_role != "kv_producer"
        if consumer and spec is not None and spec.method in ("draft_model", "mtp"):
            raise ValueError(
                f"speculative_config: method='{spec.method}' cannot run with kv_transfer_config.kv_role="
                f"'{transfer.kv_role}': KV prefilled elsewhere holds no draft KV; use method='ngram' here"
            )
        if spec is not None and spec.method == "mtp" and self.pipeline_parallel_size > 1:
            # The MTP layer drafts from the last step's hidden states; pipelined steps are still in flight then.
            raise ValueError("speculative_config: method='mtp' does not run with pipeline_parallel_size > 1 yet; "
                             "use tensor parallelism or method='ngram'")
        return self

    @model_validator(mode="after")
    def _check_task(self) -> EngineConfig:
        if self.task == "generate":
            if self.pooler_config is not None:
                raise ValueError("pooler_config: set only with task='embed'")
            return self
        # An embedding request samples nothing and is done with its prompt: no drafts to verify, no KV for a
        # consumer. Adapters and pipeline stages have not been wired to pooling yet.
        refused = {"speculative_config": self.speculative_config is not None,
                   "kv_transfer_config": self.kv_transfer_config is not None,
                   "enable_lora": self.enable_lora, "pipeline_parallel_size": self.pipeline_parallel_size > 1}
        for name, set_ in refused.items():
            if set_:
                raise ValueError(f"{name}: not supported with task='embed'; an embedding engine pools prompts only "
                                 "(tensor parallelism and quantization do apply)")
        return self

    @model_validator(mode="after")
    def _check_backend(self) -> EngineConfig:
        if self.distributed_executor_backend == "uni" and self.world_size > 1:
            raise ValueError(
                f"distributed_executor_backend: 'uni' runs one rank, but tensor_parallel_size x "
                f"pipeline_parallel_size = {self.world_size}; use 'mp' (or 'ray' in the serving app)"
            )
        return self

    @model_validator(mode="after")
    def _check_data_parallel(self) -> EngineConfig:
        size = self.data_parallel_size
        if self.data_parallel_rank >= size:
            raise ValueError(f"data_parallel_rank: {self.data_parallel_rank} is not below data_parallel_size={size}")
        if size == 1:
            if self.data_parallel_master is not None:
                raise ValueError("data_parallel_master: set only with data_parallel_size > 1")
            return self
        # The pairs not built: each would need its own lockstep (a pipeline's steps in flight, drafts verified
        # in extra forwards, adapters in the gathered experts' tokens, KV moved between engines).
        refused = {
            "pipeline_parallel_size": (self.pipeline_parallel_size > 1, "use tensor_parallel_size within each DP rank"),
            "speculative_config": (self.speculative_config is not None, "serve without speculative decoding"),
            "enable_lora": (self.enable_lora, "serve the base model or a merged checkpoint"),
            "kv_transfer_config": (self.kv_transfer_config is not None, "serve it colocated"),
            "quantization": (self.quantization is not None, "serve the dense checkpoint"),
            "task": (self.task != "generate", "embed with a single engine per replica"),
        }
        for name, (set_, remedy) in refused.items():
            if set_:
                raise ValueError(f"{name}: not supported with data_parallel_size={size} yet; {remedy} (or run "
                                 "data_parallel_size=1)")
        return self

    @property
    def world_size(self) -> int:
        """The ranks of one engine (of one DP rank under data parallelism)."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def first_device_index(self) -> int:
        """The GPU index of this engine's rank 0 among those its process sees (data_parallel_rank_local)."""
        return (self.data_parallel_rank_local or 0) * self.world_size


def resolve_max_model_len(config: EngineConfig, model_config: ModelConfig) -> int:
    """The context length an engine runs this model with: `max_model_len` if the model allows it, else
    the model's own limit."""
    limit = model_config.max_position_embeddings
    if config.max_model_len is None:
        return limit
    if config.max_model_len > limit:
        raise ValueError(
            f"max_model_len: {config.max_model_len} exceeds the model's limit of {limit} tokens "
            "(max_position_embeddings)"
        )
    return config.max_model_len


def resolve_max_num_batched_tokens(config: EngineConfig, max_model_len: int) -> int:
    """The most tokens one step computes: the config's, else a default (without chunked prefill, at least
    max_model_len: a prompt is computed whole)."""
    value = config.max_num_batched_tokens
    if config.enable_chunked_prefill:
        return value or DEFAULT_MAX_NUM_BATCHED_TOKENS
    if value is None:
        return max(DEFAULT_MAX_NUM_BATCHED_TOKENS, max_model_len)
    if value < max_model_len:
        raise ValueError(
            f"max_num_batched_tokens: {value} is below max_model_len={max_model_len}, so long prompts "
            "could never be scheduled without chunked prefill; raise it or enable_chunked_prefill"
        )
    return value
