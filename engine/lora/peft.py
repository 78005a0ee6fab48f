"""PEFT LoRA adapters: read, validate against the base model, and identify by content.

A PEFT folder holds `adapter_config.json` (r, lora_alpha, target_modules, use_rslora, ...) and
`adapter_model.safetensors` with `base_model.model.model.layers.{i}.{self_attn|mlp}.{proj}.lora_A.weight`
[r, in] and `...lora_B.weight` [out, r] (some exporters drop one `model.`). The adapter adds
scale * B @ A to the projection's weight, scale = lora_alpha / r (lora_alpha / sqrt(r) with rsLoRA).

Mixture-of-experts models (engine/models/moe.py): adapters may target the attention projections, the
MLPs of dense layers (Qwen's `mlp_only_layers`) and Qwen2-MoE's shared expert
(`mlp.shared_expert.{gate,up,down}_proj`), never the experts or the router: a token's experts differ per
token, and a per-expert delta would need a grouped LoRA kernel we do not have.

What we refuse, each with a message naming the field or the module: DoRA (`use_dora`), `modules_to_save`
(full copies of modules), per-module ranks or alphas (`rank_pattern`, `alpha_pattern`), trained biases
(`bias`), `fan_in_fan_out`, `target_parameters` (PEFT's LoRA of raw parameters: MoE experts), ranks above
`max_lora_rank`, adapters on modules other than the projections above (embeddings, LM head, experts,
router), and tensors whose shapes do not fit the base model.

The digest is the adapter's identity in the prefix cache (engine/core/block_hash.py): blake2b of the canonical
config (rank, scale) and every tensor, name, dtype, shape and bytes. Two names for the same files share KV
blocks; new weights under an old name never meet the old KV."""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from hashlib import blake2b
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from engine.models.config import ModelConfig

# The projections an adapter may target, as Hugging Face names them.
ATTENTION_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
TARGET_MODULES = ATTENTION_MODULES + MLP_MODULES
SHARED_EXPERT = "shared_expert."  # the prefix of a Qwen2-MoE shared expert's projections in a ModuleKey
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# layers.{i}.{module path}.lora_{A|B}: the path is e.g. self_attn.q_proj, mlp.shared_expert.up_proj, mlp.experts
_KEY = re.compile(r"^(?:base_model\.model\.)?(?:model\.)?layers\.(\d+)\.([\w.]+?)\.lora_([AB])(?:\.default)?\.weight$")
_EXPERTS = re.compile(r"(^|\.)(experts|block_sparse_moe)(\.|$)")  # any MoE expert weight, whatever the exporter

# (layer index, module name: "q_proj", "gate_proj", or "shared_expert.gate_proj")
ModuleKey = tuple[int, str]


@dataclass(frozen=True, eq=False)
class LoRAAdapter:
    """An adapter in host memory: per targeted projection, A [r, in] and B [out, r] with the scale folded
    into B (float32, full shapes: each rank takes its shard when it loads the adapter into a slot)."""

    name: str
    int_id: int
    path: str
    rank: int
    scale: float
    digest: str  # hex; the adapter's identity in block hashes
    weights: dict[ModuleKey, tuple[torch.Tensor, torch.Tensor]]

    @property
    def target_modules(self) -> list[str]:
        return sorted({m for _, m in self.weights})

    @property
    def num_bytes(self) -> int:
        return sum(a.numel() * a.element_size() + b.numel() * b.element_size() for a, b in self.weights.values())


def _refuse(name: str, message: str) -> ValueError:
    return ValueError(f"lora_path: adapter {name!r}: {message}")


def read_adapter_config(path: Path, name: str, max_lora_rank: int) -> dict:
    """adapter_config.json, checked: rank and scale are usable, and nothing we would silently ignore."""
    file = path / CONFIG_FILE
    if not file.is_file():
        raise _refuse(name, f"{CONFIG_FILE} not found in the adapter folder")
    try:
        config = json.loads(file.read_text())  # OSError: load_peft_adapter names the unreadable folder
    except (UnicodeDecodeError, ValueError) as e:
        raise _refuse(name, f"{CONFIG_FILE} is not valid JSON ({e})") from None
    if not isinstance(config, dict):
        raise _refuse(name, f"{CONFIG_FILE} must hold a JSON object")
    peft_type = config.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise _refuse(name, f"peft_type is {peft_type!r}; only LORA adapters are supported")
    for key in ("r", "lora_alpha", "target_modules"):
        if key not in config:
            raise _refuse(name, f"{CONFIG_FILE} lacks `{key}`")
    r, alpha = config["r"], config["lora_alpha"]
    if isinstance(r, bool) or not isinstance(r, int) or r < 1:
        raise _refuse(name, f"`r` must be a positive int, got {r!r}")
    if r > max_lora_rank:
        raise _refuse(name, f"`r`={r} exceeds max_lora_rank={max_lora_rank}; raise max_lora_rank in the engine config")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)):
        raise _refuse(name, f"`lora_alpha` must be a number, got {alpha!r}")
    if config.get("use_dora"):
        raise _refuse(name, "`use_dora` is true: DoRA adapters are not supported; merge the magnitude vector or use a "
                      "plain LoRA")
    if config.get("modules_to_save"):
        raise _refuse(name, f"`modules_to_save` ({config['modules_to_save']}) is not supported: the adapter must "
                      "only add low-rank deltas to the base model's projections")
    # Before the patterns: PEFT >= 0.22 turns v4-style targets (`gate_proj`) on a fused-experts model into
    # `target_parameters` with a doubled rank for `gate_up_proj` in `rank_pattern`; the experts are the reason.
    if config.get("target_parameters"):
        raise _refuse(name, f"`target_parameters` ({config['target_parameters']}) is not supported: LoRA on raw "
                      "parameters (a mixture-of-experts model's experts) is not served; target the attention "
                      f"projections {list(ATTENTION_MODULES)} instead")
    for key in ("rank_pattern", "alpha_pattern"):
        if config.get(key):
            raise _refuse(name, f"`{key}` is not supported: every module must share `r` and `lora_alpha`")
    if config.get("bias", "none") != "none":
        raise _refuse(name, f"`bias` is {config['bias']!r}: trained biases are not supported (only 'none')")
    if config.get("fan_in_fan_out"):
        raise _refuse(name, "`fan_in_fan_out` is true: only adapters of nn.Linear layers (fan_in_fan_out=false) are "
                      "supported")
    targets = config["target_modules"]
    if isinstance(targets, list):  # PEFT matches an entry against the end of a module's name
        unknown = sorted(t for t in targets if str(t).rsplit(".", 1)[-1] not in TARGET_MODULES)
        if unknown:
            raise _refuse(name, f"`target_modules` names {unknown}; adapters may target {sorted(TARGET_MODULES)} "
                          "(a mixture-of-experts model's experts and router excepted)")
    return config


def adapter_scale(config: dict) -> float:
    r, alpha = config["r"], config["lora_alpha"]
    return alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r


def load_peft_adapter(name: str, int_id: int, path: str | Path, model_config: ModelConfig,
                      max_lora_rank: int) -> LoRAAdapter:
    """Read and validate a PEFT adapter folder against the base model. Raises ValueError naming the problem
    (a corrupt, mismatched or unreadable adapter), never anything else for bad files."""
    try:
        return _read_adapter(name, int_id, path, model_config, max_lora_rank)
    except OSError as e:  # permissions, a name too long, a file gone: the path is the caller's to fix
        raise _refuse(name, f"cannot read the adapter folder {path} ({type(e).__name__}: {e})") from None


def _read_adapter(name: str, int_id: int, path: str | Path, model_config: ModelConfig,
                  max_lora_rank: int) -> LoRAAdapter:
    folder = Path(path)
    if not folder.is_dir():
        raise _refuse(name, f"{path} is not an adapter folder")
    config = read_adapter_config(folder, name, max_lora_rank)
    rank, scale = config["r"], adapter_scale(config)
    weights_file = folder / WEIGHTS_FILE
    if not weights_file.is_file():
        raise _refuse(name, f"{WEIGHTS_FILE} not found in the adapter folder (adapter_model.bin is not read: "
                      "re-save with safe_serialization)")
    tensors: dict[tuple[int, str, str], torch.Tensor] = {}
    try:
        with safe_open(str(weights_file), framework="pt") as f:
            for key in f.keys():
                layer, module, which = _parse_key(name, key, model_config)
                tensors[(layer, module, which)] = f.get_tensor(key)
    except SafetensorError as e:
        raise _refuse(name, f"{WEIGHTS_FILE} is not a readable safetensors file ({e})") from None
    except OSError as e:  # a truncated or vanished file
        raise _refuse(name, f"{WEIGHTS_FILE} could not be read ({e})") from None
    if not tensors:
        raise _refuse(name, f"{WEIGHTS_FILE} holds no LoRA weights")
    weights: dict[ModuleKey, tuple[torch.Tensor, torch.Tensor]] = {}
    digest = blake2b(json.dumps({"r": rank, "scale": scale}, sort_keys=True).encode(), digest_size=16)
    for layer, module, which in sorted(tensors):
        if which == "B":
            continue
        a, b = tensors[(layer, module, "A")], tensors.get((layer, module, "B"))
        where = f"layers.{layer}.{module}"
        if b is None:
            raise _refuse(name, f"{where} has lora_A but no lora_B")
        out_features, in_features = targetable_projections(model_config, layer)[module]
        if tuple(a.shape) != (rank, in_features) or tuple(b.shape) != (out_features, rank):
            raise _refuse(name, f"{where}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do not fit the base "
                          f"model (expected {(rank, in_features)} and {(out_features, rank)} for r={rank}); is it an "
                          "adapter of another model?")
        if not (a.is_floating_point() and b.is_floating_point()):
            raise _refuse(name, f"{where}: LoRA weights must be floating point, got {a.dtype} and {b.dtype}")
        for label, t in (("A", a), ("B", b)):
            digest.update(f"{layer}.{module}.{label}:{t.dtype}:{tuple(t.shape)}".encode())
            digest.update(t.contiguous().view(torch.uint8).numpy().tobytes())
        a32, b32 = a.float(), b.float() * scale
        if not (torch.isfinite(a32).all() and torch.isfinite(b32).all()):
            raise _refuse(name, f"{where}: LoRA weights hold NaN or infinite values")
        weights[(layer, module)] = (a32.contiguous(), b32.contiguous())
    orphans = [f"layers.{layer}.{module}" for layer, module, which in tensors
               if which == "B" and (layer, module) not in weights]
    if orphans:
        raise _refuse(name, f"{orphans[0]} has lora_B but no lora_A")
    return LoRAAdapter(name, int_id, str(path), rank, scale, digest.hexdigest(), weights)


def _parse_key(name: str, key: str, c: ModelConfig) -> tuple[int, str, str]:
    """(layer, module, "A" or "B") of a tensor of the adapter, refusing one the base model cannot take."""
    match = _KEY.match(key)
    if match is None:
        raise _refuse(name, f"tensor {key!r} is not a LoRA A/B weight of an attention or MLP projection "
                      f"(adapters on embeddings, the LM head or biases are not supported)")
    layer, path, which = int(match[1]), match[2], match[3]
    if layer >= c.num_hidden_layers:
        raise _refuse(name, f"tensor {key!r} is for layer {layer}; the base model has {c.num_hidden_layers} layers")
    allowed = sorted(targetable_projections(c, layer))
    if _EXPERTS.search(path):
        raise _refuse(name, f"tensor {key!r} targets the experts of a mixture-of-experts layer "
                      f"(layers.{layer}.{path}); adapters on expert weights are not supported: layer {layer} "
                      f"of {c.architecture} may be targeted at {allowed}")
    block, _, module = path.partition(".")
    if module in allowed and block == ("self_attn" if module in ATTENTION_MODULES else "mlp"):
        return layer, module, which
    raise _refuse(name, f"tensor {key!r} targets layers.{layer}.{path}, which adapters may not target in the base "
                  f"model; layer {layer} of {c.architecture} may be targeted at {allowed}")


def targetable_projections(c: ModelConfig, layer: int) -> dict[str, tuple[int, int]]:
    """Module name -> (out, in) features of each projection of decoder layer `layer` an adapter may target:
    the attention's; the MLP's in a dense layer; the shared expert's in a sparse one (never its experts)."""
    h = c.hidden_size
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    shapes = {"q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q)}
    if c.moe is None or not c.moe.is_moe_layer(layer):
        prefix, i = "", c.intermediate_size
    elif c.moe.shared_expert_intermediate_size:
        prefix, i = SHARED_EXPERT, c.moe.shared_expert_intermediate_size
    else:
        return shapes
    return shapes | {f"{prefix}gate_proj": (i, h), f"{prefix}up_proj": (i, h), f"{prefix}down_proj": (h, i)}
