"""ModelConfig: the architecture facts the engine needs, read from a Hugging Face config.json.

Reads the raw JSON rather than transformers' config classes so that both rope formats (legacy
`rope_theta` + `rope_scaling`, and transformers 5's `rope_parameters`) resolve the same way, and so that
every spelling of a mixture-of-experts config (hub files and transformers 5's own) resolves alike."""

from __future__ import annotations

import dataclasses
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
    # The same decoders saved without their LM head (AutoModel's base models): embedders (task 'embed').
    "LlamaModel": {},
    "MistralModel": {},
    "Qwen2Model": {"qkv_bias": True, "o_proj_bias": False},
    "Qwen3Model": {"qk_norm": True},
    # Mixtures of experts (engine/models/moe.py): the Llama-family attention, experts in place of MLPs.
    "MixtralForCausalLM": {},
    "Qwen2MoeForCausalLM": {"qkv_bias": True, "o_proj_bias": False},
    "Qwen3MoeForCausalLM": {"qk_norm": True},
    # engine/models/gemma3.py: Gemma's norms and embedding scale, 5 sliding-window layers to 1 global. The
    # multimodal checkpoints (4B, 12B, 27B) serve their language model, text only.
    "Gemma3ForCausalLM": {"qk_norm": True},
    "Gemma3ForConditionalGeneration": {"qk_norm": True},
    # engine/models/deepseek.py: multi-head latent attention and DeepSeek's routed plus shared experts.
    "DeepseekV2ForCausalLM": {},
    "DeepseekV3ForCausalLM": {},
    # engine/models/gpt_oss.py: attention sinks, alternating sliding-window layers, clamped SwiGLU experts.
    "GptOssForCausalLM": {},
    # engine/models/llava.py: a CLIP vision tower and a projector in front of any of the dense language
    # models above (text_config); what differs is the language model's.
    "LlavaForConditionalGeneration": {},
    # engine/models/qwen2_vl.py: Qwen's vision transformer and patch merger in front of a Qwen2 language model
    # whose rotary positions are three-dimensional (M-RoPE).
    "Qwen2VLForConditionalGeneration": {},
    "Qwen2_5_VLForConditionalGeneration": {},
}
_QWEN_VL = frozenset({"Qwen2VLForConditionalGeneration", "Qwen2_5_VLForConditionalGeneration"})
# A LLaVA checkpoint's language model, by its text_config's model_type.
_LLAVA_LANGUAGE_MODELS = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}
# Where each MoE architecture's config.json counts its experts: transformers 5 writes `num_local_experts`
# for Qwen3-MoE (an attribute_map) where hub files say `num_experts`; DeepSeek says `n_routed_experts`.
MOE_ARCHITECTURES = frozenset({"MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM",
                               "DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", "GptOssForCausalLM"})
DEEPSEEK = frozenset({"DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM"})
# Qwen configs carry a sliding_window that only applies with use_sliding_window.
HEADLESS_ARCHITECTURES = frozenset({"LlamaModel", "MistralModel", "Qwen2Model", "Qwen3Model"})
_QWEN_SLIDING_FLAG = frozenset({"Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM",
                                "Qwen2Model", "Qwen3Model"})
_EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")
_GEMMA3 = frozenset({"Gemma3ForCausalLM", "Gemma3ForConditionalGeneration"})
# Gemma3TextConfig's defaults: hub files (the multimodal ones' text_config above all) leave them out.
_GEMMA3_DEFAULTS = {"vocab_size": 262_208, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
                    "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
                    "hidden_activation": "gelu_pytorch_tanh", "max_position_embeddings": 131_072,
                    "rms_norm_eps": 1e-6, "query_pre_attn_scalar": 256, "sliding_window": 4096,
                    "rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0, "tie_word_embeddings": True,
                    "bos_token_id": 2, "eos_token_id": 1, "sliding_window_pattern": 6}
SLIDING, FULL = "sliding_attention", "full_attention"
_ROPE_TYPES = ("default", "llama3", "linear", "yarn")


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
    # DeepSeek: scores (softmax, or V3's sigmoid), how the top-k is chosen (greedy; V2's group_limited_greedy:
    # the topk_group best of n_group expert groups first; V3's noaux_tc: groups and experts chosen on the
    # scores plus a learned e_score_correction_bias, weighted by the plain scores), a scale on the weights,
    # plain shared experts (n_shared_experts x moe_intermediate_size, no gate) and dense layers before
    # first_k_dense_replace.
    scoring: str = "softmax"
    topk_method: str = "greedy"
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    first_k_dense_replace: int = 0
    moe_layer_freq: int = 1
    # gpt-oss's clamped SwiGLU experts (engine/models/gpt_oss.py)
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    # How the engine runs the experts, not a checkpoint fact: set by ModelSpec from
    # EngineConfig.enable_expert_parallel. True: each TP rank holds num_experts / tp whole experts.
    expert_parallel: bool = False

    def is_moe_layer(self, layer: int) -> bool:
        """Hugging Face's rule (Qwen2-MoE / Qwen3-MoE; DeepSeek; Mixtral has no exceptions)."""
        return (layer not in self.mlp_only_layers and self.num_experts > 0
                and (layer + 1) % self.decoder_sparse_step == 0
                and layer >= self.first_k_dense_replace and layer % self.moe_layer_freq == 0)

    @classmethod
    def from_dict(cls, arch: str, raw: dict[str, Any]) -> MoEConfig:
        counts = {raw[k] for k in _EXPERT_COUNT_KEYS if raw.get(k) is not None}
        if len(counts) != 1:
            raise ValueError(f"model: {arch} needs one expert count ({' / '.join(_EXPERT_COUNT_KEYS)}); the config "
                             f"gives {sorted(counts) or 'none'}")
        mixtral = arch == "MixtralForCausalLM"
        step = raw.get("decoder_sparse_step") or 1
        if arch == "GptOssForCausalLM":  # the softmax runs over the top-k logits alone, in the model's dtype
            return cls(num_experts=counts.pop(), top_k=raw["num_experts_per_tok"],
                       intermediate_size=raw["intermediate_size"], renormalize=False, float32_routing_weights=False,
                       swiglu_alpha=raw.get("swiglu_alpha", 1.702), swiglu_limit=raw.get("swiglu_limit", 7.0))
        if arch in DEEPSEEK:
            v3 = arch == "DeepseekV3ForCausalLM"
            method = "noaux_tc" if v3 else raw.get("topk_method") or "greedy"
            if method not in ("greedy", "group_limited_greedy", "noaux_tc"):
                raise ValueError(f"model: topk_method {method!r} is not supported (greedy, group_limited_greedy, "
                                 "noaux_tc)")
            if (raw.get("scoring_func") or ("sigmoid" if v3 else "softmax")) != ("sigmoid" if v3 else "softmax"):
                raise ValueError(f"model: scoring_func {raw['scoring_func']!r} is not {arch}'s")
            return cls(
                num_experts=counts.pop(), top_k=raw["num_experts_per_tok"],
                intermediate_size=raw["moe_intermediate_size"],
                renormalize=v3 and bool(raw.get("norm_topk_prob", True)),  # V2's router never renormalizes
                float32_routing_weights=True,
                shared_expert_intermediate_size=raw["moe_intermediate_size"] * (raw.get("n_shared_experts") or 0),
                scoring="sigmoid" if v3 else "softmax", topk_method=method, n_group=raw.get("n_group") or 1,
                topk_group=raw.get("topk_group") or 1, routed_scaling_factor=raw.get("routed_scaling_factor", 1.0),
                first_k_dense_replace=raw.get("first_k_dense_replace") or 0,
                moe_layer_freq=raw.get("moe_layer_freq") or 1,
            )
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


@dataclass(frozen=True)
class MLAConfig:
    """Multi-head latent attention (DeepSeek-V2/V3): K and V come from one latent of kv_lora_rank values per
    token, shared by every head, plus a rotary key part of qk_rope_head_dim; the KV cache holds just those."""

    kv_lora_rank: int
    q_lora_rank: int | None  # None: q_proj straight from the hidden state (V2-Lite)
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int

    @property
    def latent_dim(self) -> int:
        """Values one token keeps in a layer's KV cache: kv_lora_rank + qk_rope_head_dim (576 for the real models)."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


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
    sliding_window: int | None  # the window of the layers layer_types calls sliding
    torch_dtype: str | None
    initializer_range: float
    bos_token_id: int | None
    eos_token_ids: list[int] = field(default_factory=list)
    quantization_config: dict[str, Any] | None = None  # the checkpoint's, as config.json has it
    moe: MoEConfig | None = None  # experts, for mixture-of-experts architectures
    layer_types: tuple[str, ...] = ()  # per layer, SLIDING or FULL; empty: every layer full
    hidden_act: str = "silu"  # of the MLP's gate
    query_pre_attn_scalar: float | None = None  # attention scores scale by its inverse root (None: head_dim)
    final_logit_softcapping: float | None = None  # logits = cap * tanh(logits / cap)
    # The sliding layers' rotary base and scaling, where they differ from the full layers' (Gemma 3).
    local_rope_theta: float | None = None
    local_rope_scaling: dict[str, Any] | None = None
    rope_interleaved: bool = False  # rotary pairs (x0, x1), (x2, x3), ... (DeepSeek), not the two halves
    mla: MLAConfig | None = None  # multi-head latent attention (DeepSeek)
    # DeepSeek-V3's multi-token prediction layers, stored after the decoder's (engine/models/deepseek_mtp.py)
    num_mtp_layers: int = 0
    # A vision-language model's image side: LLaVA's CLIP tower (engine/models/llava.py) or Qwen's
    # (engine/models/qwen2_vl.py).
    vision: VisionConfig | QwenVisionConfig | None = None
    # M-RoPE (Qwen-VL): the rotary frequencies split into sections that rotate by the temporal, height and
    # width position of a token in turn; a text token's three positions are equal.
    mrope_section: tuple[int, ...] | None = None

    def sliding_window_of(self, layer: int) -> int | None:
        """The window layer `layer` attends over (the last this-many positions, its own included), or None."""
        return self.sliding_window if self.layer_types and self.layer_types[layer] == SLIDING else None

    @property
    def headless(self) -> bool:
        """A base model saved without its LM head (`Qwen3Model`): it can embed, not generate."""
        return self.architecture in HEADLESS_ARCHITECTURES

    @property
    def attention_scale(self) -> float:
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        archs = raw.get("architectures") or []
        if "LlavaForConditionalGeneration" in archs:
            return _llava(raw)
        if _QWEN_VL & set(archs):
            return _qwen_vl(raw, next(a for a in archs if a in _QWEN_VL))
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ValueError(
                f"model: unsupported architecture {archs or raw.get('model_type')!r}; supported: "
                f"{', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        flags = SUPPORTED_ARCHITECTURES[arch]
        if arch in _GEMMA3:
            raw = _gemma3_text_config(raw)
            _refuse_gemma3_options(raw)
        heads = raw["num_attention_heads"]
        rope = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
        local_rope: dict[str, Any] | None = None
        if FULL in rope or SLIDING in rope:  # transformers 5 writes one set per layer type (Gemma 3)
            rope, local_rope = dict(rope.get(FULL) or {}), dict(rope.get(SLIDING) or {})
        rope_theta, rope_scaling = _rope(rope, raw.get("rope_theta", 10000.0))
        local_theta, local_scaling = (_rope(local_rope or {}, raw.get("rope_local_base_freq", rope_theta))
                                      if local_rope is not None or "rope_local_base_freq" in raw else (None, None))
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
            # DeepSeek's is the rotary part's (qk_rope_head_dim), which is all the rotary embedding needs
            head_dim=(raw["qk_rope_head_dim"] if arch in DEEPSEEK
                      else raw.get("head_dim") or raw["hidden_size"] // heads),
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            max_position_embeddings=raw.get("max_position_embeddings", 4096),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
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
            layer_types=_layer_types(arch, raw, sliding),
            hidden_act=raw.get("hidden_activation") or raw.get("hidden_act") or "silu",
            query_pre_attn_scalar=raw.get("query_pre_attn_scalar"),
            final_logit_softcapping=raw.get("final_logit_softcapping"),
            local_rope_theta=local_theta,
            local_rope_scaling=local_scaling,
            rope_interleaved=arch in DEEPSEEK and raw.get("rope_interleave", True) is not False,
            mla=_mla(raw) if arch in DEEPSEEK else None,
            num_mtp_layers=(raw.get("num_nextn_predict_layers") or 0) if arch in DEEPSEEK else 0,
        )

    @classmethod
    def from_pretrained(cls, path: str | Path) -> ModelConfig:
        return cls.from_dict(json.loads((Path(path) / "config.json").read_text()))


@dataclass(frozen=True)
class VisionConfig:
    """A LLaVA checkpoint's vision tower (CLIP's or SigLIP's ViT), the hidden states its features come from,
    and the projector that maps them into the language model's embeddings."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    image_size: int
    patch_size: int
    num_channels: int
    layer_norm_eps: float
    hidden_act: str
    feature_layers: tuple[int, ...]  # hidden-state indices (0: the embeddings), concatenated when several
    select_strategy: str  # "default": drop the CLS position; "full": keep it
    projector_hidden_act: str
    projector_bias: bool
    image_token_id: int
    tower: str = "clip"  # "siglip": no class embedding, no pre-norm, a patch embedding with a bias

    @property
    def tokens_per_image(self) -> int:
        """Patches, plus CLIP's class position, less the first position under the "default" strategy."""
        positions = (self.image_size // self.patch_size) ** 2 + (self.tower == "clip")
        return positions - (self.select_strategy == "default")

    def tokens_for(self, grid_thw: tuple[int, int, int] | None) -> int:
        """Placeholder tokens of an image: CLIP sees every image at one size."""
        return self.tokens_per_image

    @property
    def num_layers_run(self) -> int:
        """Encoder layers the features need: up to the deepest selected hidden state."""
        n = self.num_hidden_layers
        return max(i if i >= 0 else n + 1 + i for i in self.feature_layers)


@dataclass(frozen=True)
class QwenVisionConfig:
    """Qwen2-VL's and Qwen2.5-VL's vision transformer: 3-D patches (temporal x spatial), 2-D rotary positions,
    full attention within each image (Qwen2.5-VL: within windows, except in the full-attention blocks), and a
    patch merger folding each spatial_merge_size x spatial_merge_size square into one embedding."""

    gated_mlp: bool  # Qwen2.5-VL: RMSNorm and a gated MLP (gate/up/down); Qwen2-VL: LayerNorm and fc1/fc2
    hidden_size: int
    intermediate_size: int
    depth: int
    num_heads: int
    patch_size: int
    temporal_patch_size: int
    spatial_merge_size: int
    in_channels: int
    out_hidden_size: int  # the language model's hidden size
    hidden_act: str
    rope_theta: float
    window_size: int  # in pixels; 0: no window attention (Qwen2-VL)
    fullatt_block_indexes: tuple[int, ...]
    image_token_id: int

    def tokens_for(self, grid_thw: tuple[int, int, int]) -> int:
        """Placeholder tokens of an image of this patch grid: one per merged square."""
        t, h, w = grid_thw
        return t * h * w // self.spatial_merge_size**2


def _qwen_vl(raw: dict[str, Any], arch: str) -> ModelConfig:
    """Released checkpoints keep the language model's keys at the top level; transformers 5 nests them in
    text_config. The rope's mrope_section is kept apart; the rest is a Qwen2 language model's."""
    vision = dict(raw.get("vision_config") or {})
    text = {k: v for k, v in raw.items() if k not in ("vision_config", "text_config")}
    text |= raw.get("text_config") or {}
    rope = dict(text.pop("rope_parameters", None) or text.pop("rope_scaling", None) or {})
    text.pop("rope_scaling", None)
    section = rope.pop("mrope_section", None)
    if rope.pop("type", None) == "mrope" or rope.get("rope_type") == "mrope":
        rope["rope_type"] = "default"
    language = ModelConfig.from_dict({**text, "rope_parameters": rope, "architectures": ["Qwen2ForCausalLM"]})
    if section is None or 2 * sum(section) != language.head_dim:
        raise ValueError(f"model: {arch} needs rope mrope_section summing to head_dim / 2 = {language.head_dim // 2}; "
                         f"the config has {section}")
    qwen2_5 = arch == "Qwen2_5_VLForConditionalGeneration"
    width = vision.get("hidden_size" if qwen2_5 else "embed_dim", 1280)
    vision_rope = vision.get("rope_parameters") or {}
    return dataclasses.replace(language, architecture=arch, mrope_section=tuple(section), vision=QwenVisionConfig(
        gated_mlp=qwen2_5, hidden_size=width,
        intermediate_size=vision.get("intermediate_size", 3420) if qwen2_5 else width * vision.get("mlp_ratio", 4),
        depth=vision.get("depth", 32), num_heads=vision.get("num_heads", 16),
        patch_size=vision.get("patch_size", 14), temporal_patch_size=vision.get("temporal_patch_size", 2),
        spatial_merge_size=vision.get("spatial_merge_size", 2),
        in_channels=vision.get("in_channels", vision.get("in_chans", 3)),
        out_hidden_size=vision.get("out_hidden_size" if qwen2_5 else "hidden_size", language.hidden_size),
        hidden_act=vision.get("hidden_act", "silu" if qwen2_5 else "quick_gelu"),
        rope_theta=float(vision_rope.get("rope_theta", 10000.0)),
        window_size=vision.get("window_size", 112) if qwen2_5 else 0,
        fullatt_block_indexes=tuple(vision.get("fullatt_block_indexes", (7, 15, 23, 31))) if qwen2_5 else (),
        image_token_id=raw.get("image_token_id", text.get("image_token_id", 151655))))


def _llava(raw: dict[str, Any]) -> ModelConfig:
    vision, text = dict(raw.get("vision_config") or {}), dict(raw.get("text_config") or {})
    tower = {"clip_vision_model": "clip", "siglip_vision_model": "siglip"}.get(
        vision.get("model_type", "clip_vision_model"))
    if tower is None:
        raise ValueError(f"model: LLaVA with a {vision['model_type']!r} vision tower is not supported yet; "
                         "CLIP (clip_vision_model) and SigLIP (siglip_vision_model) are")
    siglip = tower == "siglip"
    text_type = text.get("model_type", "llama")
    if text_type not in _LLAVA_LANGUAGE_MODELS:
        raise ValueError(f"model: LLaVA over a {text_type!r} language model is not supported; "
                         f"supported: {', '.join(_LLAVA_LANGUAGE_MODELS)}")
    strategy = raw.get("vision_feature_select_strategy", "default")
    if strategy not in ("default", "full"):
        raise ValueError(f"model: vision_feature_select_strategy {strategy!r} is not one of default, full")
    layers = raw.get("vision_feature_layer", -2)
    language = ModelConfig.from_dict({**text, "architectures": [_LLAVA_LANGUAGE_MODELS[text_type]],
                                      **({"eos_token_id": raw["eos_token_id"]} if "eos_token_id" in raw else {})})
    image_size, patch_size = vision.get("image_size", 224), vision.get("patch_size", 16 if siglip else 32)
    return dataclasses.replace(language, architecture="LlavaForConditionalGeneration", vision=VisionConfig(
        hidden_size=vision.get("hidden_size", 768), intermediate_size=vision.get("intermediate_size", 3072),
        num_hidden_layers=vision.get("num_hidden_layers", 12),
        num_attention_heads=vision.get("num_attention_heads", 12),
        image_size=image_size, patch_size=patch_size, num_channels=vision.get("num_channels", 3),
        layer_norm_eps=vision.get("layer_norm_eps", 1e-6 if siglip else 1e-5),
        hidden_act=vision.get("hidden_act", "gelu_pytorch_tanh" if siglip else "quick_gelu"),
        feature_layers=(layers,) if isinstance(layers, int) else tuple(layers), select_strategy=strategy,
        projector_hidden_act=raw.get("projector_hidden_act", "gelu"),
        projector_bias=raw.get("multimodal_projector_bias", True),
        image_token_id=raw.get("image_token_id", raw.get("image_token_index", 32000)), tower=tower),
        quantization_config=raw.get("quantization_config"))


def _rope(params: dict[str, Any], theta: float) -> tuple[float, dict[str, Any] | None]:
    """(base, scaling or None) of one set of rotary parameters."""
    params = dict(params)
    theta = float(params.pop("rope_theta", theta))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in _ROPE_TYPES:
        raise ValueError(f"model: rope type {rope_type!r} is not supported ({', '.join(_ROPE_TYPES)})")
    return theta, None if rope_type == "default" else {**params, "rope_type": rope_type}


def _mla(raw: dict[str, Any]) -> MLAConfig:
    return MLAConfig(kv_lora_rank=raw["kv_lora_rank"], q_lora_rank=raw.get("q_lora_rank"),
                     qk_nope_head_dim=raw["qk_nope_head_dim"], qk_rope_head_dim=raw["qk_rope_head_dim"],
                     v_head_dim=raw["v_head_dim"])


def _layer_types(arch: str, raw: dict[str, Any], sliding: int | None) -> tuple[str, ...]:
    """Which layers attend over a window: the config's layer_types (transformers 5 writes them), else each
    family's rule as Hugging Face's code has it (Gemma 3: every sliding_window_pattern-th layer is full; Qwen2
    and Qwen3: layers from max_window_layers on; Qwen2-MoE: even layers below it; the others: all)."""
    n = raw["num_hidden_layers"]
    if not sliding:
        return ()
    if raw.get("layer_types"):
        types = tuple(raw["layer_types"])
        if len(types) != n or not set(types) <= {SLIDING, FULL}:
            raise ValueError(f"model: layer_types must name {n} layers, each {SLIDING!r} or {FULL!r}")
        return types
    if arch in _GEMMA3:
        pattern = raw.get("sliding_window_pattern", 6)
        return tuple(SLIDING if (i + 1) % pattern else FULL for i in range(n))
    if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        first = raw.get("max_window_layers", 28)
        return tuple(SLIDING if i >= first else FULL for i in range(n))
    if arch == "Qwen2MoeForCausalLM":
        last = raw.get("max_window_layers", 28)
        return tuple(SLIDING if (i + 1) % 2 and i < last else FULL for i in range(n))
    return (SLIDING,) * n


def _gemma3_text_config(raw: dict[str, Any]) -> dict[str, Any]:
    """The language model's config: a multimodal checkpoint nests it in text_config; defaults filled in."""
    text = raw.get("text_config") or {}
    merged = {**_GEMMA3_DEFAULTS, **raw, **text}
    merged.pop("text_config", None)
    merged["architectures"] = raw["architectures"]
    if "quantization_config" in raw:
        merged["quantization_config"] = raw["quantization_config"]
    if "eos_token_id" in raw:  # the multimodal checkpoints' end of turn is at the top level
        merged["eos_token_id"] = raw["eos_token_id"]
    return merged


def _refuse_gemma3_options(raw: dict[str, Any]) -> None:
    if raw.get("attn_logit_softcapping") is not None:
        raise ValueError("model: attn_logit_softcapping is not supported (Gemma 2's soft-capped attention scores); "
                         "Gemma 3 checkpoints leave it null")
    if raw.get("use_bidirectional_attention"):
        raise ValueError("model: use_bidirectional_attention is not supported: the engine decodes causally")
