"""ModelSpec: the model an engine runs and how, resolved once from its EngineConfig: the checkpoint
folder, the architecture's facts, device, dtype and context length. Every rank of a multi-device engine
resolves the same spec from the same config.

The checks that a model can run the way the config asks live here, where the model meets the config, in
one function of the two (`check_config`): the split over ranks, the quantization and how its groups fall
on the ranks, the context length. It needs neither the weights nor a device, so whoever can refuse a
config before an engine starts runs it too: InputProcessor.from_config (before a multi-rank AsyncLLM
launches its workers) and the serving app's build_app (before Serve starts a replica), which reads the
model's config where it can (`local_model_config`)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import torch

from engine.config import EngineConfig, resolve_max_model_len
from engine.core.kv_cache_groups import KVCacheGroups
from engine.distributed import GroupCoordinator, ParallelGroups, ParallelLayout, parallel_groups
from engine.models.builtin import BUILTIN_MODELS
from engine.models.config import ModelConfig
from engine.models.layers.quantization import QuantizationConfig, resolve_quant_config
from engine.models.model_path import resolve_model_path
from engine.models.registry import MTP_ARCHITECTURE, model_class
from engine.pooling.config import PoolerConfig, resolve_pooler

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class ModelSpec:
    model_config: ModelConfig
    path: Path
    dtype: torch.dtype
    device_type: str  # cpu or cuda
    max_model_len: int
    quant_config: QuantizationConfig | None = None
    pooler_config: PoolerConfig | None = None  # task 'embed': how prompts are pooled (engine/pooling)

    @classmethod
    def resolve(cls, config: EngineConfig) -> ModelSpec:
        path = resolve_model_path(config.model, config.revision)
        model_config = ModelConfig.from_pretrained(path)
        device_type = resolve_device_type(config.device)
        quant_config = check_config(config, model_config)
        check_devices(config, device_type)
        model_config = engine_model_config(config, model_config)
        dtype = resolve_dtype(config.dtype, model_config, device_type)
        pooler = resolve_pooler(path, config.pooler_config) if config.task == "embed" else None
        return cls(model_config, path, dtype, device_type, resolve_max_model_len(config, model_config), quant_config,
                   pooler)


def check_config(config: EngineConfig, model_config: ModelConfig) -> QuantizationConfig | None:
    """Refuse, naming the field, a config this model cannot run (on any device): a split over ranks it
    cannot take, a quantization that does not match the checkpoint or whose groups straddle ranks, a
    context longer than the model's. Returns the engine's quantization."""
    check_parallel_layout(config, model_config)
    quant_config = resolve_quant_config(config.quantization, model_config.quantization_config)
    if config.load_format == "dummy" and model_config.quantization_config is not None:
        raise ValueError(f"load_format: 'dummy' draws dense random weights, which cannot stand in for this "
                         f"{quant_config.name} checkpoint; use load_format='safetensors'")
    resolve_max_model_len(config, model_config)
    check_window_layers(config, model_config)
    check_latent_attention(config, model_config)
    check_mtp(config, model_config)
    check_vision(config, model_config, quant_config)
    check_task(config, model_config)
    check_data_parallel(config, model_config, quant_config)
    check_rank_layers(config, engine_model_config(config, model_config), quant_config)
    return quant_config


def check_window_layers(config: EngineConfig, cfg: ModelConfig) -> None:
    """Refuse what does not yet work with sliding-window layers, whose KV blocks out of the window are handed
    back (engine/core/kv_cache_groups.py): KV transfer moves one block list per request, and a draft model
    shares the primary group's block table."""
    if not KVCacheGroups.of(cfg).has_window_groups:
        return
    if config.kv_transfer_config is not None:
        raise ValueError(f"kv_transfer_config: KV transfer (disaggregated prefill) does not support "
                         f"{cfg.architecture}'s sliding-window layers yet; serve it colocated")
    draft = config.speculative_config
    if draft is not None and draft.method == "draft_model":
        raise ValueError(f"speculative_config: a draft model does not support {cfg.architecture}'s sliding-window "
                         "layers yet; use method 'ngram'")


def check_latent_attention(config: EngineConfig, cfg: ModelConfig) -> None:
    """Refuse what does not yet work with multi-head latent attention (DeepSeek), whose layers cache latents,
    not K and V: KV transfer moves K/V blocks, and LoRA adapters target the q/k/v projections it lacks."""
    if cfg.mla is None:
        return
    if config.kv_transfer_config is not None:
        raise ValueError(f"kv_transfer_config: KV transfer (disaggregated prefill) does not support "
                         f"{cfg.architecture}'s latent KV cache yet; serve it colocated")
    if config.enable_lora:
        raise ValueError(f"enable_lora: LoRA adapters are not supported for {cfg.architecture}'s latent "
                         "attention yet; serve the base model or a merged checkpoint")


def check_mtp(config: EngineConfig, cfg: ModelConfig) -> None:
    """`speculative_config.method='mtp'` drafts with the checkpoint's own multi-token prediction layer."""
    draft = config.speculative_config
    if draft is not None and draft.method == "mtp" and cfg.num_mtp_layers < 1:
        raise ValueError(f"speculative_config: method='mtp' needs a checkpoint with multi-token prediction layers "
                         f"(DeepSeek-V3's num_nextn_predict_layers); this {cfg.architecture} checkpoint has none: use "
                         "method='ngram' or 'draft_model'")


def check_vision(config: EngineConfig, cfg: ModelConfig, quant_config: QuantizationConfig | None) -> None:
    """Refuse what does not yet work with a vision-language model (LLaVA, Qwen-VL): the pairs not built or tested."""
    if cfg.vision is None:
        return
    if config.kv_transfer_config is not None:
        raise ValueError(f"kv_transfer_config: KV transfer (disaggregated prefill) does not support "
                         f"{cfg.architecture}'s images yet; serve it colocated")
    if config.enable_lora:
        raise ValueError(f"enable_lora: LoRA adapters are not supported for {cfg.architecture} yet; serve the base "
                         "model or a merged checkpoint")
    if quant_config is not None:
        raise ValueError(f"quantization: {quant_config.name} is not supported for {cfg.architecture} yet; serve it "
                         "unquantized")


def check_task(config: EngineConfig, cfg: ModelConfig) -> None:
    """A checkpoint without its LM head (a base model saved as an embedder) can only embed; embedding runs the
    decoder's text path, which a vision-language model's images and a draft-only layer are not."""
    if config.task == "generate" and cfg.headless:
        raise ValueError(f"task: {cfg.architecture} is a base model without an LM head; it cannot generate. Serve it "
                         "with task='embed'")
    if config.task == "embed" and (cfg.vision is not None or cfg.architecture == MTP_ARCHITECTURE):
        raise ValueError(f"task: 'embed' is not supported for {cfg.architecture}; embed with a text model")


def check_data_parallel(config: EngineConfig, cfg: ModelConfig, quant_config: QuantizationConfig | None) -> None:
    """Data parallelism exists for the experts of MoE layers (engine/distributed/data_parallel.py); the pairs it
    does not take without a model are EngineConfig's to refuse."""
    size = config.data_parallel_size
    if size == 1:
        return
    if cfg.moe is None:
        raise ValueError(f"data_parallel_size: {cfg.architecture} is dense (no experts to shard across DP ranks); "
                         "serve copies of it as independent replicas (the serving app's num_replicas) instead")
    if cfg.architecture == "GptOssForCausalLM":
        raise ValueError(f"data_parallel_size: {cfg.architecture}'s experts do not run under data parallelism yet; "
                         "use tensor_parallel_size (or replicas)")
    if quant_config is not None:
        raise ValueError(f"quantization: this {quant_config.name} checkpoint is not supported with "
                         f"data_parallel_size={size} yet; serve a dense checkpoint or data_parallel_size=1")
    if cfg.vision is not None:
        raise ValueError(f"data_parallel_size: {cfg.architecture}'s images are not supported with data parallelism "
                         "yet; use data_parallel_size=1")


def local_model_config(model: str) -> ModelConfig | None:
    """The model's config where this process can read it without weights, network or writes: a built-in
    model's (from its spec: nothing is materialized) or a local checkpoint folder's config.json (with its
    quantization_config). None for a hub id, or a folder this host does not have (a replica's may)."""
    if model in BUILTIN_MODELS:
        return ModelConfig.from_dict(BUILTIN_MODELS[model])
    if Path(model).expanduser().is_dir():
        return ModelConfig.from_pretrained(resolve_model_path(model))
    return None


def engine_model_config(config: EngineConfig, model_config: ModelConfig) -> ModelConfig:
    """The checkpoint's config as the engine runs it: how the experts are split is the engine's choice,
    read by the model."""
    if model_config.moe is None:
        return model_config
    return replace(model_config, moe=replace(model_config.moe, expert_parallel=config.enable_expert_parallel))


def resolve_device_type(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device: cuda requested but torch sees no GPU; use device='cpu'")
    return device


def resolve_dtype(dtype: str, cfg: ModelConfig, device_type: str) -> torch.dtype:
    if dtype != "auto":
        return _DTYPES[dtype]
    checkpoint = _DTYPES.get(str(cfg.torch_dtype).removeprefix("torch."), torch.float32)
    if checkpoint is torch.float16 and device_type == "cpu":
        return torch.float32  # CPU float16 matmuls are slow
    return checkpoint


def check_parallel_layout(config: EngineConfig, cfg: ModelConfig) -> None:
    """Refuse a split the model cannot take, naming the field and what would work."""
    tp, pp = config.tensor_parallel_size, config.pipeline_parallel_size
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    if heads % tp:
        raise ValueError(f"tensor_parallel_size: {tp} does not divide num_attention_heads={heads}; "
                         f"use one of {_divisors(heads)}")
    if (tp % kv_heads if tp >= kv_heads else kv_heads % tp):
        raise ValueError(f"tensor_parallel_size: {tp} must divide num_key_value_heads={kv_heads} or be a multiple "
                         f"of it (KV heads are split, or replicated when ranks outnumber them)")
    if cfg.intermediate_size % tp:
        raise ValueError(f"tensor_parallel_size: {tp} does not divide intermediate_size={cfg.intermediate_size}")
    check_expert_layout(config, cfg)
    if pp > cfg.num_hidden_layers:
        raise ValueError(f"pipeline_parallel_size: {pp} stages for a model of {cfg.num_hidden_layers} layers; "
                         f"use at most {cfg.num_hidden_layers}")


def check_rank_layers(config: EngineConfig, cfg: ModelConfig, quant_config: QuantizationConfig | None) -> None:
    """Build every pipeline stage's layers on the meta device (no memory, no weights) under stand-in groups
    shaped like the engine's: each layer refuses, as it is built, a split it cannot take (an int4 group or
    an FP8 block straddling two ranks, packed columns split between ranks, a size the ranks do not divide),
    naming the field. TP ranks of a stage hold equal shapes, so its first rank stands for all."""
    layout = ParallelLayout(config.tensor_parallel_size, config.pipeline_parallel_size)
    dp = config.data_parallel_size
    for stage in range(layout.pipeline_parallel_size):
        rank = layout.tp_ranks(stage)[0]
        groups = ParallelGroups(GroupCoordinator(list(range(layout.world_size)), rank, None),
                                GroupCoordinator(layout.tp_ranks(stage), rank, None),
                                GroupCoordinator(layout.pp_ranks(0), rank, None),
                                GroupCoordinator(list(range(dp * layout.tensor_parallel_size)), 0, None),
                                GroupCoordinator(list(range(dp)), 0, None))
        with parallel_groups(groups), torch.device("meta"):
            model_class(cfg.architecture)(cfg, quant_config)


def check_devices(config: EngineConfig, device_type: str) -> None:
    """Refuse more ranks on this host than it has GPUs (the ray backend places ranks across hosts)."""
    tp, pp = config.tensor_parallel_size, config.pipeline_parallel_size
    if (device_type == "cuda" and config.distributed_executor_backend in (None, "mp", "uni")
            and tp * pp > torch.cuda.device_count()):
        raise ValueError(f"tensor_parallel_size x pipeline_parallel_size: {tp} x {pp} ranks, but torch sees "
                         f"{torch.cuda.device_count()} GPU(s) on this host; lower them or use the ray backend "
                         "across hosts")
    dp = config.data_parallel_size
    if device_type == "cuda" and config.data_parallel_master is None and dp * tp * pp > torch.cuda.device_count():
        # The offline LLM starts every DP rank on this host, each on GPUs of its own.
        raise ValueError(f"data_parallel_size: {dp} engines of {tp * pp} rank(s) each need {dp * tp * pp} GPUs, but "
                         f"torch sees {torch.cuda.device_count()} on this host; lower it")


def check_expert_layout(config: EngineConfig, cfg: ModelConfig) -> None:
    moe, tp = cfg.moe, config.tensor_parallel_size
    if moe is None:
        if config.enable_expert_parallel:
            raise ValueError(f"enable_expert_parallel: {cfg.architecture} has no experts; leave it off")
        return
    # The experts are sharded over the TP ranks, or over every rank of every DP rank under data parallelism.
    dp = config.data_parallel_size
    shards = dp * tp
    field = "tensor_parallel_size" if dp == 1 else "data_parallel_size x tensor_parallel_size"
    value = tp if dp == 1 else f"{dp} x {tp}"
    if config.enable_expert_parallel:
        if moe.num_experts % shards:
            raise ValueError(f"{field}: {value} does not divide num_experts={moe.num_experts} (expert "
                             f"parallel); use one of {_divisors(moe.num_experts)} or turn enable_expert_parallel off")
    elif moe.intermediate_size % shards:
        raise ValueError(f"{field}: {value} does not divide the experts' intermediate size "
                         f"{moe.intermediate_size}; use one of {_divisors(moe.intermediate_size)} or "
                         "enable_expert_parallel")
    if moe.shared_expert_intermediate_size % tp:
        raise ValueError(f"tensor_parallel_size: {tp} does not divide shared_expert_intermediate_size="
                         f"{moe.shared_expert_intermediate_size}")


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]
