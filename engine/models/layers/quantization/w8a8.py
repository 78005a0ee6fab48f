"""W8A8: int8 weights, symmetric per output row, times int8 activations quantized per token as they arrive
(dynamic, symmetric), in integer dot products (ops/cpu/quant_linear.py's w8a8_linear: VNNI's vpdpbusd where
the CPU has it). The format CPU servers ship (compressed-tensors' int-quantized W8A8, as RedHatAI publishes it;
vLLM CPU and SGLang CPU run it); here from such checkpoints (compressed_tensors.py) and online, as
`quantization: "w8a8"` on a dense checkpoint (weights quantized like online int8: scale = max|w| / 127 per row).

Accuracy contract, per output: y = sx * sw * sum_k qx_k qw_k with qx = round(x / sx), sx = max|x| / 127 per
token (vLLM's dynamic per-token scale), and the integer sum exact: against x . w on the dequantized weight, the
error is at most (sx / 2) * sum_k |w_k| (each activation within half a step), plus float32 rounding. Where no
kernel runs (another device, no compiler) the same numbers are computed by torch matmuls (`w8a8_reference`)."""

from __future__ import annotations

from abc import abstractmethod

import torch
from torch import nn

from engine.models.layers.quantization.base import QuantMethod
from engine.models.layers.quantization.weight_only import quant_kernels_available
from ops.cpu.decode_stack import Projection
from ops.cpu.quant_linear import pack_w8a8, quantize_activations, w8a8_linear


def w8a8_reference(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The kernel's numbers in torch: x [..., K] quantized per row, times int8 q [N, K] with float32 scales [N]."""
    x2 = x.reshape(-1, x.shape[-1]).float()
    xq, x_scales = quantize_activations(x2)
    out = (xq.double() @ q.double().T).float() * x_scales[:, None] * scales  # float64: exact integer sums
    if bias is not None:
        out += bias
    return out.to(x.dtype).view(*x.shape[:-1], q.shape[0])


def w8a8_weight(q: torch.Tensor) -> torch.Tensor:
    """What a layer (or an expert) computes with: the kernel's panels (uint8, 4-D) on a CPU with the kernels, else
    the int8 rows [N, K] for w8a8_reference."""
    return pack_w8a8(q) if q.device.type == "cpu" and quant_kernels_available() else q.to(torch.int8)


def w8a8_apply(weight: torch.Tensor, scales: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x times a w8a8_weight with its float32 scales [N]."""
    if weight.dim() == 4:
        return w8a8_linear(x, weight, scales, bias)
    return w8a8_reference(x, weight, scales, bias)


class W8A8Method(QuantMethod):
    """A source of W8A8 weights: `create_weights` registers them, `int8_weight` reads them back; the compute is
    shared."""

    @abstractmethod
    def int8_weight(self, layer: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's partition: q [N, K] (values in [-128, 127]) and float32 scales [N]."""

    def process_weights_after_loading(self, layer: nn.Module, batch_size_hint: int) -> None:
        q, scales = self.int8_weight(layer)
        for name in [name for name, _ in layer.named_parameters(recurse=False) if name != "bias"]:
            delattr(layer, name)
        layer.register_buffer("w8a8_weight", w8a8_weight(q))
        layer.register_buffer("weight_scales", scales.float().contiguous())
        layer.compute = "w8a8"

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return w8a8_apply(layer.w8a8_weight, layer.weight_scales, x, bias)

    def decode_projection(self, layer: nn.Module) -> Projection | None:
        return Projection("w8a8", layer.w8a8_weight, layer.weight_scales) if layer.w8a8_weight.dim() == 4 else None
