"""Weight-only quantized linear methods: every format reads its checkpoint tensors into one form,
`QuantizedWeight` (integers, and per group the scale and zero point that map them back to real numbers),
and this module turns that form into compute, once, after loading:

- int8, one group per row, zero point 128 (symmetric): the int8 kernel (ops/cpu/quant_linear.py);
- 4-bit, groups of equal, even length (after sorting act-order columns by group): the int4 kernel, with the
  integer zero point folded into a float one;
- anything else (grouped 8-bit, uneven act-order groups, a device without a kernel, a CPU without a
  compiler): dequantized once to the compute dtype and run as a dense layer.
The dequantized weights are always the oracle: W[n, k] = scales[g_idx[k], n] * (q[n, k] - zeros[g_idx[k], n])."""

from __future__ import annotations

import functools
import logging
from abc import abstractmethod
from dataclasses import dataclass

import torch
from torch import nn

from engine.models.layers.quantization.base import QuantMethod, set_weight_attrs
from engine.models.layers.quantization.dense import DenseLinearMethod
from ops.cpu import linear_kernels_available
from ops.cpu.quant_linear import int4_linear, int8_linear, pack_int4, pack_int4_params, pack_int8

logger = logging.getLogger(__name__)
_DENSE = DenseLinearMethod()  # what a dequantized layer computes with


@dataclass
class QuantizedWeight:
    """One rank's partition of a linear layer's weight, N output rows by K input columns."""

    q: torch.Tensor  # int32 [N, K], unsigned values in [0, 2**bits)
    scales: torch.Tensor  # float32 [G, N]
    zeros: torch.Tensor  # int32 [G, N], in the same unsigned domain as q
    g_idx: torch.Tensor  # int64 [K]: the group of each input column
    bits: int

    def dequantize(self) -> torch.Tensor:
        """float32 [N, K]."""
        return self.scales[self.g_idx].T * (self.q - self.zeros[self.g_idx].T).float()


def unpack_int32(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Split each int32 into 32 / bits values along `dim`, lowest bits first (GPTQ, AWQ before its
    reordering, compressed-tensors' pack-quantized for 4 and 8 bits)."""
    per_word = 32 // bits
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    values = (packed.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)  # [..., per_word] along a new last dim
    values = values.movedim(-1, dim + 1) if dim != packed.ndim - 1 else values
    shape = list(packed.shape)
    shape[dim] *= per_word
    return values.reshape(shape)


def contiguous_g_idx(layer: nn.Module, group_size: int) -> torch.Tensor:
    """The group of each input column this rank holds, for groups of `group_size` consecutive columns of
    the whole layer (a row-parallel rank holds columns from tp_rank * its input size on)."""
    size = layer.input_size_per_partition
    offset = layer.tp_rank * size if size != layer.input_size else 0
    return (torch.arange(size) + offset) // group_size


class WeightOnlyMethod(QuantMethod):
    """A format's method: `create_weights` registers its checkpoint tensors (sliced by the layer's weight
    loaders), `quantized_weight` reads them back as a QuantizedWeight; the rest is shared."""

    @abstractmethod
    def quantized_weight(self, layer: nn.Module) -> QuantizedWeight:
        """The loaded weight of this rank's partition."""

    def checkpoint_param_names(self, layer: nn.Module) -> list[str]:
        """Parameters dropped once the compute form exists."""
        return [name for name, _ in layer.named_parameters(recurse=False) if name != "bias"]

    def process_weights_after_loading(self, layer: nn.Module, batch_size_hint: int) -> None:
        qw = self.quantized_weight(layer)
        for name in self.checkpoint_param_names(layer):
            delattr(layer, name)
        layer.compute = select_compute(qw, qw.q.device)
        if layer.compute in ("int8", "int4"):
            for name, value in kernel_form(qw, layer.compute).items():
                if isinstance(value, int):
                    setattr(layer, name, value)
                else:
                    layer.register_buffer(name, value)
        else:
            weight = nn.Parameter(qw.dequantize().to(layer.params_dtype), requires_grad=False)
            layer.register_parameter("weight", weight)
            _DENSE.process_weights_after_loading(layer, batch_size_hint)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if layer.compute == "int8":
            return int8_linear(x, layer.int8_weight, layer.weight_scales, bias)
        if layer.compute == "int4":
            if layer.input_perm is not None:
                x = x.index_select(-1, layer.input_perm)
            return int4_linear(x, layer.int4_weight, layer.int4_params, layer.group_size, layer.out_features, bias)
        return _DENSE.apply(layer, x, bias)


def kernel_form(qw: QuantizedWeight, compute: str) -> dict[str, torch.Tensor | int | None]:
    """The tensors (and int4's sizes) that the `compute` kernel ("int8" or "int4", from select_compute)
    takes for `qw`, by the names a layer holds them under: int8_weight and weight_scales; int4_weight,
    int4_params (scales and zeros), input_perm (None for contiguous groups), group_size and out_features."""
    if compute == "int8":
        return {"int8_weight": pack_int8(qw.q - 128), "weight_scales": qw.scales[0].float().contiguous()}
    perm, group = int4_layout(qw)
    q, g_idx = (qw.q, qw.g_idx) if perm is None else (qw.q[:, perm], qw.g_idx[perm])
    runs = g_idx[::group]  # the group of each run of `group` columns
    scales = qw.scales[runs].T.float()
    zeros = -qw.zeros[runs].T * scales  # q*s - z*s
    return {"int4_weight": pack_int4(q), "int4_params": pack_int4_params(scales, zeros), "input_perm": perm,
            "group_size": group, "out_features": q.shape[0]}


def int4_layout(qw: QuantizedWeight) -> tuple[torch.Tensor | None, int] | tuple[None, None]:
    """(input permutation or None, group size) that make the groups contiguous runs of equal, even length
    (the int4 kernel pairs columns within a group); (None, None) when there are none (uneven act-order
    groups, or an odd group size)."""
    k = qw.g_idx.numel()
    perm = None
    g_idx = qw.g_idx
    if bool((g_idx[1:] < g_idx[:-1]).any()):  # act-order: sort the columns by group
        perm = torch.argsort(g_idx, stable=True)
        g_idx = g_idx[perm]
    starts = torch.nonzero(torch.diff(g_idx, prepend=g_idx[:1] - 1)).flatten()
    lengths = torch.diff(starts, append=torch.tensor([k]))
    group = int(lengths[0])
    if bool((lengths != group).any()) or k % group or group % 2:
        return None, None
    return perm, group


def select_compute(qw: QuantizedWeight, device: torch.device) -> str:
    """int8, int4 or dense (see the module docstring)."""
    if device.type != "cpu":
        return "dense"  # GPU kernels for these formats are future work: dequantized until then
    if qw.bits == 8 and qw.scales.shape[0] == 1 and bool((qw.zeros == 128).all()):
        return "int8" if quant_kernels_available() else "dense"
    if qw.bits == 4 and int4_layout(qw)[1] is not None:
        return "int4" if quant_kernels_available() else "dense"
    return "dense"


@functools.cache  # one warning per process, not one per layer
def quant_kernels_available() -> bool:
    if linear_kernels_available():
        return True
    logger.warning("no CPU quantized kernels (no compiler?): quantized weights dequantized to the compute dtype")
    return False


def quant_param(layer: nn.Module, name: str, shape: tuple[int, ...], dtype: torch.dtype, **attrs) -> nn.Parameter:
    """Register a checkpoint tensor's parameter with the attributes its layer's weight loader reads."""
    param = nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)
    set_weight_attrs(param, attrs)
    layer.register_parameter(name, param)
    return param


def g_idx_param(layer: nn.Module, name: str) -> nn.Parameter:
    """An act-order checkpoint's group index per input column (optional: absent means contiguous groups).
    Its own loader: sliced along the input like the weight, and the same for every fused sub-projection
    (they share their input, so GPTQ orders their columns alike)."""
    size = layer.input_size_per_partition
    param = quant_param(layer, name, (size,), torch.int32, optional=True)
    param.data.fill_(-1)

    def load(param: torch.Tensor, loaded, shard_id: int | None = None) -> None:
        if loaded.shape != (layer.input_size,):
            raise ValueError(f"has shape {tuple(loaded.shape)}, expected {(layer.input_size,)}")
        if size != layer.input_size:
            loaded = loaded.narrow(0, layer.tp_rank * size, size)
        values = loaded.load().to(torch.int32)
        if bool((param.data >= 0).all()) and not torch.equal(param.data, values):
            raise ValueError("differs between the sub-projections fused into one layer; unsupported")
        param.data.copy_(values)

    param.weight_loader = load
    return param


def loaded_g_idx(layer: nn.Module, param: torch.Tensor, group_size: int) -> torch.Tensor:
    """The checkpoint's g_idx if it had one, else contiguous groups of `group_size`."""
    return param.data.long() if bool((param.data >= 0).all()) else contiguous_g_idx(layer, group_size)


def num_groups(layer: nn.Module, group_size: int) -> int:
    """Groups along the whole layer's input (scales and zeros keep every group on every rank: a
    row-parallel rank's columns index them through g_idx)."""
    return 1 if group_size <= 0 else -(-layer.input_size // group_size)


def check_packing(layer: nn.Module, sizes: list[int], pack_factor: int, what: str) -> None:
    for size in sizes:
        if size % pack_factor:
            raise ValueError(f"model: {layer.prefix}: {size} {what} per rank do not pack into int32s of {pack_factor} "
                             "values; use another tensor_parallel_size")


def row_scale_loader(layer: nn.Module):
    """A weight_scale loader: a per-tensor scale (one value) fills its sub-projection's rows; a per-channel one
    ([N] or [N, 1]) is sliced like the weight's rows (FP8, compressed-tensors W8A8)."""

    def load(param: torch.Tensor, loaded, shard_id: int | None = None) -> None:
        if shard_id is None:
            offset, size, source = 0, param.shape[0], layer.tp_rank
        else:
            offset, size = layer.shard_offset_and_size(shard_id)
            source = layer.shard_source_index(shard_id)
        rows = param.data.narrow(0, offset, size)
        if loaded.shape in ((), (1,)):
            rows.fill_(float(loaded.load().reshape(())))
            return
        if loaded.shape[1:] not in ((), (1,)):
            raise ValueError(f"has shape {tuple(loaded.shape)}; a weight_scale is one value or one per row")
        start = source * size if loaded.shape[0] != size else 0  # row-parallel layers keep every row
        rows.copy_(loaded.narrow(0, start, size).load().reshape(size))

    return load
