"""Quantization methods of linear layers: each linear layer holds one QuantMethod, which creates its
weights, turns them into their compute form after loading, and applies them. `dense` is the method of
an unquantized model; checkpoint formats (gptq, awq, compressed-tensors, fp8, mxfp4) and online quantization
(int8, int4, w8a8, w4a8) are resolved once per engine by `resolve_quant_config`."""

from __future__ import annotations

import importlib
from typing import Any

from engine.models.layers.quantization.base import QuantizationConfig, QuantMethod, set_weight_attrs
from engine.models.layers.quantization.dense import DenseLinearMethod

# quant_method of a checkpoint's quantization_config -> "module:class" of its config, imported when an engine
# uses it: a format's module (and what it imports, such as the MoE layer) loads only where it runs. A new
# format adds a line here.
CHECKPOINT_FORMATS = {
    "gptq": "engine.models.layers.quantization.gptq:GPTQConfig",
    "awq": "engine.models.layers.quantization.awq:AWQConfig",
    "compressed-tensors": "engine.models.layers.quantization.compressed_tensors:CompressedTensorsConfig",
    "fp8": "engine.models.layers.quantization.fp8:Fp8Config",
    "mxfp4": "engine.models.layers.quantization.mxfp4:Mxfp4Config",
}
ONLINE_SCHEMES = ("int8", "int4", "w8a8", "w4a8")
ONLINE_CONFIG = "engine.models.layers.quantization.online_config:OnlineQuantConfig"


def _config_class(path: str) -> type[QuantizationConfig]:
    module, name = path.split(":")
    return getattr(importlib.import_module(module), name)


def resolve_quant_config(requested: str | None, checkpoint: dict[str, Any] | None) -> QuantizationConfig | None:
    """The quantization of an engine: `requested` is EngineConfig.quantization (None: whatever the
    checkpoint's `quantization_config` says; a checkpoint format's name: a check that the checkpoint is in
    it; int8 / int4 / w8a8 / w4a8: quantize a dense checkpoint at load)."""
    method = None
    if checkpoint is not None:
        method = str(checkpoint.get("quant_method", "")).replace("_", "-")
        if method not in CHECKPOINT_FORMATS:
            raise ValueError(f"model: the checkpoint's quantization_config.quant_method={method!r} is not supported; "
                             f"supported: {', '.join(CHECKPOINT_FORMATS)}")
    if requested in ONLINE_SCHEMES:
        if method is not None:
            raise ValueError(f"quantization: {requested!r} quantizes a dense checkpoint at load, but this checkpoint "
                             f"is already quantized ({method}); use quantization=None or {method!r}")
        return _config_class(ONLINE_CONFIG)(requested)
    if requested is not None and requested != method:
        found = f"is in {method!r}" if method else "is not quantized (no quantization_config)"
        raise ValueError(f"quantization: {requested!r} was asked for, but the checkpoint {found}; use "
                         f"quantization={method!r}"
                         + ("" if method else " or an online scheme ('int8', 'int4', 'w8a8', 'w4a8')"))
    return _config_class(CHECKPOINT_FORMATS[method]).from_config(checkpoint) if method else None


__all__ = [
    "QuantizationConfig", "QuantMethod", "DenseLinearMethod", "set_weight_attrs", "resolve_quant_config",
    "CHECKPOINT_FORMATS", "ONLINE_SCHEMES",
]
