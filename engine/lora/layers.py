"""The LoRA wrapper of the parallel linear layers, and one rank's adapter slots.

`LinearWithLoRA` wraps a ColumnParallelLinear (incl. the fused qkv and gate_up) or a RowParallelLinear:
y = base(x), plus for each run of tokens of one slot, shrink then expand: y[run] += (x[run] @ A) @ B.
A slot's A is [in, n * r] for the n sub-projections the adapter targets (q, k, v stacked), B [n * r, out]
block-diagonal, each sub-projection's block written at its columns of the fused output, with the scale
folded in. Under tensor parallelism a slot is sharded like the base weight: column layers keep A whole
and take their rows of each B (KV heads replicated as the base does); row layers take their columns of A
and keep B whole, and since (sum_k x_k A_k) B = sum_k x_k A_k B, each rank adds its partial delta to its
partial base output and the layer's one all-reduce sums both.

Tokens of the base model (slot -1) cost nothing. The driver orders each step's batch by slot (decodes
first, then prefills), so a step has at most two runs per adapter in use: a few small matmuls per layer
instead of a per-token gather of A and B. CPU and CUDA alike (plain torch ops)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from engine.lora.peft import LoRAAdapter
from engine.models.layers.linear import ColumnParallelLinear, LinearBase, MergedColumnParallelLinear, RowParallelLinear

# Our fused module -> the Hugging Face projections it holds, in its sub-projection order.
FUSED_MODULES = {
    "qkv_proj": ["q_proj", "k_proj", "v_proj"],
    "o_proj": ["o_proj"],
    "gate_up_proj": ["gate_proj", "up_proj"],
    "down_proj": ["down_proj"],
}


@dataclass
class LoRABatch:
    """This step's runs of tokens with an adapter: (slot, first row, end row), shared by every wrapper."""

    runs: list[tuple[int, int, int]]

    @classmethod
    def from_slots(cls, slots: np.ndarray | None) -> LoRABatch:
        if slots is None or not len(slots):
            return cls([])
        starts = np.flatnonzero(np.diff(slots)) + 1
        bounds = np.concatenate(([0], starts, [len(slots)])).tolist()
        values = slots[bounds[:-1]].tolist()
        return cls([(s, a, b) for s, a, b in zip(values, bounds[:-1], bounds[1:]) if s >= 0])


class LinearWithLoRA(nn.Module):
    def __init__(self, base: LinearBase, layer_index: int, modules: list[str], max_loras: int, batch: LoRABatch,
                 dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.dtype, self.device = dtype, device
        if not isinstance(base, (ColumnParallelLinear, RowParallelLinear)):
            raise TypeError(f"no LoRA wrapper for {type(base).__name__}")
        self.base_layer = base
        self.layer_index = layer_index
        self.modules_ = modules  # Hugging Face names of the sub-projections, in fused order
        self.is_row = isinstance(base, RowParallelLinear)
        self.batch = batch
        # Per slot: (A [in_part, n * r], B [n * r, out_part]) in the model's dtype, or None.
        self.slots: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * max_loras

    def _column_rows(self, k: int) -> tuple[int, int, int]:
        """Sub-projection k: offset in this rank's fused output, rows of the full B to take, and size."""
        base = self.base_layer
        if isinstance(base, MergedColumnParallelLinear):
            offset, size = base.shard_offset_and_size(k)
            return offset, base.shard_source_index(k) * size, size
        size = base.output_partition_sizes[0]
        return 0, base.tp_rank * size, size

    def set_slot(self, slot: int, adapter: LoRAAdapter | None) -> None:
        """Load this rank's shard of `adapter` into `slot` (None clears it)."""
        present = [] if adapter is None else [(k, adapter.weights[(self.layer_index, m)])
                                               for k, m in enumerate(self.modules_) if (self.layer_index, m) in adapter.weights]
        if not present:
            self.slots[slot] = None
            return
        base = self.base_layer
        r = adapter.rank
        n = len(present)
        out_part = sum(base.output_partition_sizes)
        a_cat = torch.empty(n * r, base.input_size_per_partition)
        b_blocks = torch.zeros(n * r, out_part)
        for j, (k, (a, b)) in enumerate(present):
            if self.is_row:
                size = base.input_size_per_partition
                a_cat[j * r : (j + 1) * r] = a[:, base.tp_rank * size : (base.tp_rank + 1) * size]
                b_blocks[j * r : (j + 1) * r] = b.T
            else:
                offset, first, size = self._column_rows(k)
                a_cat[j * r : (j + 1) * r] = a
                b_blocks[j * r : (j + 1) * r, offset : offset + size] = b[first : first + size].T
        self.slots[slot] = (a_cat.T.contiguous().to(self.device, self.dtype), b_blocks.to(self.device, self.dtype))

    def _add_lora(self, x: torch.Tensor, y: torch.Tensor) -> None:
        slots = self.slots
        for slot, start, end in self.batch.runs:
            weights = slots[slot]
            if weights is not None:  # None: the adapter does not target this projection
                a, b = weights
                y[start:end].addmm_(torch.mm(x[start:end], a), b)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        base = self.base_layer
        if not self.batch.runs:
            return base(x)
        if not self.is_row:
            y = base(x)
            self._add_lora(x, y)
            return y
        # Row-parallel: the partial base output and the partial delta are summed by one all-reduce.
        y = base.quant_method.apply(base, x, base.bias if base.tp_rank == 0 else None)
        self._add_lora(x, y)
        return base.tp_group.all_reduce(y) if base.reduce_results and base.tp_size > 1 else y


class LoRASlots:
    """One rank's adapter slots: wraps the model's attention and MLP projections at construction, then
    loads and clears slots (on every rank, through Executor.collective_rpc) and takes each step's slots."""

    def __init__(self, model: nn.Module, max_loras: int, dtype: torch.dtype, device: torch.device) -> None:
        self.max_loras = max_loras
        self.batch = LoRABatch([])
        self.layers: list[LinearWithLoRA] = []
        decoder = model.model
        for index in range(decoder.start_layer, decoder.end_layer):
            layer = decoder.layers[index]
            for parent, attr in ((layer.self_attn, "qkv_proj"), (layer.self_attn, "o_proj"),
                                 (layer.mlp, "gate_up_proj"), (layer.mlp, "down_proj")):
                wrapper = LinearWithLoRA(getattr(parent, attr), index, FUSED_MODULES[attr], max_loras, self.batch,
                                         dtype, device)
                setattr(parent, attr, wrapper)
                self.layers.append(wrapper)

    def check_slot(self, slot: int) -> None:
        if not 0 <= slot < self.max_loras:
            raise ValueError(f"slot {slot} is outside [0, max_loras={self.max_loras})")

    def load(self, slot: int, adapter: LoRAAdapter) -> None:
        self.check_slot(slot)
        for layer in self.layers:
            layer.set_slot(slot, adapter)

    def clear(self, slot: int) -> None:
        self.check_slot(slot)
        for layer in self.layers:
            layer.set_slot(slot, None)

    def set_step(self, slots: np.ndarray | None) -> None:
        self.batch.runs = LoRABatch.from_slots(slots).runs
