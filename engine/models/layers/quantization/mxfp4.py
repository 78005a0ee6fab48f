"""MXFP4 checkpoints (`quant_method: mxfp4`, gpt-oss's release format): the experts' weights in blocks of 32
FP4 (e2m1) values sharing one power-of-two scale (e8m0), two values a byte, low nibble first. Only the experts
are in it (`modules_to_not_convert` covers the rest), so no linear layer gets a method here; gpt-oss's expert
layer (engine/models/gpt_oss.py) reads the `*_blocks` and `*_scales` tensors and dequantizes them as they load:
CPUs have no FP4 arithmetic, and the dense experts then run as a float checkpoint's would."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from engine.models.layers.quantization.base import QuantizationConfig, QuantMethod

# e2m1 by its 4-bit code: sign bit 3, then exponent and mantissa (the OCP microscaling spec's table).
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
BLOCK = 32  # values sharing one scale


class Mxfp4Config(QuantizationConfig):
    name = "mxfp4"

    @classmethod
    def from_config(cls, raw: dict[str, Any]) -> Mxfp4Config:
        return cls()

    def get_quant_method(self, layer: nn.Module, prefix: str) -> QuantMethod | None:
        return None


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """blocks uint8 [..., G, 16] and scales uint8 [..., G] (e8m0: 2 ** (s - 127)) -> float32 [..., G * 32]."""
    table = torch.tensor(FP4_VALUES, dtype=torch.float32)
    blocks = blocks.to(torch.int64)
    values = torch.stack([table[blocks & 0x0F], table[blocks >> 4]], dim=-1).flatten(-2)  # low nibble first
    values = torch.ldexp(values, scales.to(torch.int32)[..., None] - 127)
    return values.flatten(-2)
