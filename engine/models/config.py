"""ModelConfig: the architecture facts the engine needs, read from a Hugging Face config.json.

Reads the raw JSON rather than transformers' config classes so that both rope formats (legacy
`rope_theta` + `rope_scaling`, and transformers 5's `rope_parameters`) resolve the same way, and so that
every spelling of a mixture-of-experts config (hub files and transformers 5's own) resolves alike."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# Architecture name -> what differs from plain Llama. One decoder implementation serves them all.
SUPPORTED_ARCHITECTURES: dict[str, dict[str, Any]] = {
    "LlamaForCausalLM": {},
    "MistralForCausalLM": {},
    "Qwen2ForCausalLM": {"qkv_bias": True, "o_proj_bias": False},
    "Qwen3ForCausalLM": {"qk_norm": True},
    # Mixtures of experts (engine/models/moe.py): the Llama-family attention, experts in place of MLPs.
    "MixtralForCausalLM": {},
    "Qwen2MoeForCausalLM": {"qkv_bias": True, "o_proj_bias": False},
    "Qwen3MoeForCausalLM": {"qk_norm": True},
}
# Where each MoE architecture's config.json counts its experts: transformers 5 writes `num_local_experts`
# for Qwen3-MoE (an attribute_map) where hub files say `num_experts`; DeepSeek says `n_routed_experts`.
MOE_ARCHITECTURES = frozenset({"MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM"})
# Qwen configs carry a sliding_window that only applies with use_sliding_window.
_QWEN_SLIDING_FLAG = frozenset({"Qwen2ForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM"})
_EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")


@dataclass(frozen=True)
class MoEConfig:
    """The experts of a mixture-of-experts model and how its router picks them (per Hugging Face's code)."""

    num_experts: int
    top_k: int  # num_experts_per_tok
    intermediate_size: int  # of one expert
    renormalize: bool  # top-k weights divided by their sum (Mixtral always; Qwen: norm_topk_prob)
    # Mixtral keeps the routing weights in float32 into the weighted sum; Qwen casts them to the model dtype.
    float32_routing_weights: bool
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE: a dense MLP on every token, gated by a sigmoid
    decoder_sparse_step: int = 1  # Qwen: every step-th layer is MoE ...
    mlp_only_layers: tuple[int, ...] = ()  # ... except these, which keep a dense MLP of intermediate_size
    # How the engine runs the experts, not a checkpoint fact: set by ModelSpec from
    # EngineConfig.enable_expert_parallel. True: each TP rank holds num_experts / tp whole experts.
    expert_parallel: bool = False

    def is_moe_layer(self, layer: int) -> bool:
        """Hugging Face's rule (Qwen2-MoE / Qwen3-MoE; Mixtral has no exceptions)."""
        return (layer not in self.mlp_only_layers and self.num_experts > 0
                and (layer + 1) % self.decoder_sparse_step == 0)

    @classmethod
    def from_dict(cls, arch: str, raw: dict[str, Any]) -> MoEConfig:
        counts = {raw[k] for k in _EXPERT_COUNT_KEYS if raw.get(k) is not None}
        if len(counts) != 1:
            raise ValueError(f"model: {arch} needs one expert count ({' / '.join(_EXPERT_COUNT_KEYS)}); the config "
                             f"gives {sorted(counts) or 'none'}")
        mixtral = arch == "MixtralForCausalLM"
        step = raw.get("decoder_sparse_step") or 1
        return cls(
            num_experts=counts.pop(),
            top_k=raw["num_experts_per_tok"],
            intermediate_size=raw["intermediate_size"] if mixtral else raw["moe_intermediate_size"],
            renormalize=True if mixtral else bool(raw.get("norm_topk_prob", False)),
            float32_routing_weights=mixtral,
            shared_expert_intermediate_size=0 if mixtral else raw.get("shared_expert_intermediate_size") or 0,
            decoder_sparse_step=1 if mixtral else step,
            mlp_only_layers=() if mixtral else tuple(raw.get("mlp_only_layers") or ()),
        )


@dataclass
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    tie_word_embeddings: bool
    qkv_bias: bool
    o_proj_bias: bool
    mlp_bias: bool
    qk_norm: bool
    sliding_window: int | None
    torch_dtype: str | None
    initializer_range: float
    bos_token_id: int | None
    eos_token_ids: list[int] = field(default_factory=list)
    quantization_config: dict[str, Any] | None = None  # the checkpoint's, as config.json has it
    moe: MoEConfig | None = None  # experts, for mixture-of-experts architectures

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        archs = raw.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ValueError(
                f"model: unsupported architecture {archs or raw.get('model_type')!r}; supported: "
                f"{', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        flags = SUPPORTED_ARCHITECTURES[arch]
        heads = raw["num_attention_heads"]
        rope = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
        rope_theta = float(rope.pop("rope_theta", raw.get("rope_theta", 10000.0)))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", "llama3"):
            raise ValueError(f"model: rope type {rope_type!r} is not supported (default, llama3)")
        eos = raw.get("eos_token_id")
        sliding = raw.get("sliding_window")
        if arch in _QWEN_SLIDING_FLAG and not raw.get("use_sliding_window", False):
            sliding = None
        return cls(
            architecture=arch,
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_hidden_layers=raw["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=raw.get("num_key_value_heads") or heads,
            head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            max_position_embeddings=raw.get("max_position_embeddings", 4096),
            rope_theta=rope_theta,
            rope_scaling=rope if rope_type == "llama3" else None,
            tie_word_embeddings=raw.get("tie_word_embeddings", False),
            qkv_bias=raw.get("qkv_bias", flags.get("qkv_bias", raw.get("attention_bias", False))),
            o_proj_bias=flags.get("o_proj_bias", raw.get("attention_bias", False)),
            mlp_bias=raw.get("mlp_bias", False),
            qk_norm=flags.get("qk_norm", False),
            sliding_window=sliding,
            torch_dtype=raw.get("dtype") or raw.get("torch_dtype"),
            initializer_range=raw.get("initializer_range", 0.02),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=[] if eos is None else ([eos] if isinstance(eos, int) else list(eos)),
            quantization_config=raw.get("quantization_config"),
            moe=MoEConfig.from_dict(arch, raw) if arch in MOE_ARCHITECTURES else None,
        )

    @classmethod
    def from_pretrained(cls, path: str | Path) -> ModelConfig:
        return cls.from_dict(json.loads((Path(path) / "config.json").read_text()))
