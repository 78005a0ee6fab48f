"""The LoRA wrapper of the parallel linear layers, and one rank's adapter slots.

`LinearWithLoRA` wraps a ColumnParallelLinear (incl. the fused qkv and gate_up) or a RowParallelLinear:
y = base(x) + per token of an adapter, shrink then expand: (x @ A) @ B. Each wrapper holds every slot's
weights stacked, A [max_loras, in, R] and B [max_loras, R, out] with R = sub-projections x max_lora_rank:
a slot's adapter fills the first n * r columns of A for the n sub-projections it targets (q, k, v
stacked) and the matching rows of B, block-diagonally, each sub-projection's block at its columns of the
fused output, with the scale folded in; the rest stays zero. Under tensor parallelism a slot is sharded
like the base weight: column layers keep A whole and take their rows of each B (KV heads replicated as
the base does); row layers take their columns of A and keep B whole, and since (sum_k x_k A_k) B =
sum_k x_k A_k B, each rank adds its partial delta to its partial base output and the layer's one
all-reduce sums both.

Tokens of the base model (slot -1) cost nothing. The driver orders each step's batch by slot (decodes
first, then prefills), so an adapter's tokens form few runs. Long runs (prefill chunks) take two matmuls
each on the slot's exact-rank weights. Short runs (decodes, one per adapter in the batch) are gathered
into one [max_loras, width] grid and take two batched matmuls for all adapters together: on CPU a small
matmul costs its fixed overhead more than its FLOPs, so a decode step with 8 adapters runs ~5 ops per
layer instead of 16 (vLLM's CPU path gathers A and B per token instead, [tokens, in, r] per layer)."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from engine.lora.peft import SHARED_EXPERT, LoRAAdapter
from engine.models.layers.direct_call import DirectCall
from engine.models.layers.linear import ColumnParallelLinear, LinearBase, MergedColumnParallelLinear, RowParallelLinear
from engine.models.llama import MLP

# Our fused module -> the Hugging Face projections it holds, in its sub-projection order.
FUSED_MODULES = {
    "qkv_proj": ["q_proj", "k_proj", "v_proj"],
    "o_proj": ["o_proj"],
    "gate_up_proj": ["gate_proj", "up_proj"],
    "down_proj": ["down_proj"],
}
LONG_RUN = 32  # runs of more tokens than this take their own matmuls; shorter ones are batched together
MIN_GROUPED_RUNS = 3  # fewer short runs than this are cheaper one by one


class LoRABatch:
    """This step's tokens with an adapter, shared by every wrapper: `runs` (slot, first row, end row) that
    take their own matmuls, and the grid of the others: `grid_rows` [max_loras * width] token rows by slot
    (padding repeats a real row), `grid_mask` [max_loras, width, 1] (0 on padding)."""

    def __init__(self) -> None:
        self.runs: list[tuple[int, int, int]] = []
        self.grid_rows: torch.Tensor | None = None
        self.grid_mask: torch.Tensor | None = None
        self.width = 0

    @property
    def empty(self) -> bool:
        return not self.runs and self.grid_rows is None

    def update(self, slots: np.ndarray | None, max_loras: int, dtype: torch.dtype, device: torch.device) -> None:
        self.runs, self.grid_rows, self.grid_mask, self.width = [], None, None, 0
        if slots is None or not len(slots):
            return
        starts = np.flatnonzero(np.diff(slots)) + 1
        bounds = np.concatenate(([0], starts, [len(slots)])).tolist()
        runs = [(s, a, b) for s, a, b in zip(slots[bounds[:-1]].tolist(), bounds[:-1], bounds[1:]) if s >= 0]
        short = [r for r in runs if r[2] - r[1] <= LONG_RUN]
        if len(short) < MIN_GROUPED_RUNS:
            self.runs = runs
            return
        self.runs = [r for r in runs if r[2] - r[1] > LONG_RUN]
        rows: list[list[int]] = [[] for _ in range(max_loras)]
        for slot, a, b in short:
            rows[slot].extend(range(a, b))
        width = max(len(r) for r in rows)
        grid = np.full((max_loras, width), short[0][1], dtype=np.int64)
        mask = np.zeros((max_loras, width, 1), dtype=np.float32)
        for slot, r in enumerate(rows):
            grid[slot, : len(r)] = r
            mask[slot, : len(r)] = 1.0
        self.width = width
        self.grid_rows = torch.from_numpy(grid.reshape(-1)).to(device)
        self.grid_mask = torch.from_numpy(mask).to(device, dtype)


class LinearWithLoRA(DirectCall, nn.Module):
    def __init__(self, base: LinearBase, layer_index: int, modules: list[str], max_loras: int, max_rank: int,
                 batch: LoRABatch, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        if not isinstance(base, (ColumnParallelLinear, RowParallelLinear)):
            raise TypeError(f"no LoRA wrapper for {type(base).__name__}")
        self.base_layer = base
        self.layer_index = layer_index
        self.modules_ = modules  # Hugging Face names of the sub-projections, in fused order
        self.is_row = isinstance(base, RowParallelLinear)
        self.batch = batch
        width = len(modules) * max_rank
        self.a_stack = torch.zeros(max_loras, base.input_size_per_partition, width, dtype=dtype, device=device)
        self.b_stack = torch.zeros(max_loras, width, sum(base.output_partition_sizes), dtype=dtype, device=device)
        self.cols = [0] * max_loras  # columns of A (rows of B) the slot's adapter uses here; 0: none

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
                                               for k, m in enumerate(self.modules_)
                                               if (self.layer_index, m) in adapter.weights]
        base = self.base_layer
        a_slot, b_slot = self.a_stack[slot], self.b_stack[slot]
        a_slot.zero_()
        b_slot.zero_()
        self.cols[slot] = 0
        if not present:
            return
        r = adapter.rank
        for j, (k, (a, b)) in enumerate(present):
            cols = slice(j * r, (j + 1) * r)
            if self.is_row:
                size = base.input_size_per_partition
                a_slot[:, cols] = a[:, base.tp_rank * size : (base.tp_rank + 1) * size].T
                b_slot[cols] = b.T
            else:
                offset, first, size = self._column_rows(k)
                a_slot[:, cols] = a.T
                b_slot[cols, offset : offset + size] = b[first : first + size].T
        self.cols[slot] = len(present) * r

    def _add_lora(self, x: torch.Tensor, y: torch.Tensor) -> None:
        batch = self.batch
        for slot, start, end in batch.runs:
            cols = self.cols[slot]
            if cols:  # 0: the adapter does not target this projection
                y[start:end].addmm_(torch.mm(x[start:end], self.a_stack[slot, :, :cols]), self.b_stack[slot, :cols])
        if batch.grid_rows is not None:
            num_slots, width = self.a_stack.shape[0], batch.width
            shrunk = torch.bmm(x.index_select(0, batch.grid_rows).view(num_slots, width, -1), self.a_stack)
            shrunk.mul_(batch.grid_mask)  # padding rows repeat a real token: their delta must be zero
            y.index_add_(0, batch.grid_rows, torch.bmm(shrunk, self.b_stack).view(num_slots * width, -1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        base = self.base_layer
        if self.batch.empty:
            return base(x)
        if not self.is_row:
            y = base(x)
            self._add_lora(x, y)
            return y
        # Row-parallel: the partial base output and the partial delta are summed by one all-reduce.
        y = base.quant_method.apply(base, x, base.bias if base.tp_rank == 0 else None)
        self._add_lora(x, y)
        return base.tp_group.all_reduce(y) if base.reduce_results and base.tp_size > 1 else y


def lora_projections(layer: nn.Module) -> list[tuple[nn.Module, str, list[str]]]:
    """(parent, attribute, Hugging Face sub-projections) of each linear layer of a decoder layer that adapters
    may reach (engine/lora/peft.py targetable_projections): the attention's; the MLP of a dense layer; the
    shared expert of a sparse mixture-of-experts block (its experts and router never)."""
    attn = layer.self_attn
    found = [(attn, "qkv_proj", FUSED_MODULES["qkv_proj"]), (attn, "o_proj", FUSED_MODULES["o_proj"])]
    if isinstance(layer.mlp, MLP):
        mlp, prefix = layer.mlp, ""
    else:  # a sparse block
        mlp, prefix = getattr(layer.mlp, "shared_expert", None), SHARED_EXPERT
    if mlp is not None:
        found += [(mlp, attr, [prefix + m for m in FUSED_MODULES[attr]]) for attr in ("gate_up_proj", "down_proj")]
    return found


class LoRASlots:
    """One rank's adapter slots: wraps the model's attention and MLP projections at construction, then
    loads slots (on every rank, through Executor.collective_rpc) and takes each step's token slots."""

    def __init__(self, model: nn.Module, max_loras: int, max_rank: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.max_loras, self.dtype, self.device = max_loras, dtype, device
        self.batch = LoRABatch()
        self.layers: list[LinearWithLoRA] = []
        decoder = model.model
        for index in range(decoder.start_layer, decoder.end_layer):
            for parent, attr, modules in lora_projections(decoder.layers[index]):
                wrapper = LinearWithLoRA(getattr(parent, attr), index, modules, max_loras, max_rank, self.batch, dtype,
                                         device)
                setattr(parent, attr, wrapper)
                self.layers.append(wrapper)

    @property
    def num_bytes(self) -> int:
        return sum(w.a_stack.numel() * w.a_stack.element_size() + w.b_stack.numel() * w.b_stack.element_size()
                   for w in self.layers)

    def load(self, slot: int, adapter: LoRAAdapter) -> None:
        if not 0 <= slot < self.max_loras:
            raise ValueError(f"slot {slot} is outside [0, max_loras={self.max_loras})")
        for layer in self.layers:
            layer.set_slot(slot, adapter)

    def set_step(self, slots: np.ndarray | None) -> None:
        self.batch.update(slots, self.max_loras, self.dtype, self.device)
