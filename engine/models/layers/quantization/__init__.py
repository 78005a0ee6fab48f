"""Quantization methods of linear layers: each linear layer holds one QuantMethod, which creates its
weights, turns them into their compute form after loading, and applies them. `dense` is the method of
an unquantized model."""

from engine.models.layers.quantization.base import QuantizationConfig, QuantMethod, set_weight_attrs
from engine.models.layers.quantization.dense import DenseLinearMethod

__all__ = ["QuantizationConfig", "QuantMethod", "DenseLinearMethod", "set_weight_attrs"]
