"""Checkpoint tensors read lazily: a rank narrows a tensor to its shard before any byte is read, so no
rank of a sharded engine materialises the whole model."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

_SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "I64": torch.int64, "I32": torch.int32,
    "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
}
if hasattr(torch, "float8_e8m0fnu"):
    _SAFETENSORS_DTYPES["F8_E8M0"] = torch.float8_e8m0fnu


class CheckpointTensor:
    """A tensor of a checkpoint (a safetensors slice, or an in-memory tensor) with the part of it that
    will be read: `narrow` composes, `load` reads."""

    def __init__(self, source, shape: tuple[int, ...], dtype: torch.dtype,
                 index: tuple[slice, ...] | None = None) -> None:
        self.source = source
        self.shape = shape
        self.dtype = dtype
        self.index = index if index is not None else tuple(slice(0, n) for n in shape)

    @classmethod
    def of(cls, tensor: torch.Tensor) -> CheckpointTensor:
        return cls(tensor, tuple(tensor.shape), tensor.dtype)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def narrow(self, dim: int, start: int, size: int) -> CheckpointTensor:
        dim %= self.ndim
        if start < 0 or size < 0 or start + size > self.shape[dim]:
            raise ValueError(f"narrow({dim}, {start}, {size}) out of range for shape {self.shape}")
        outer = self.index[dim]
        index = self.index[:dim] + (slice(outer.start + start, outer.start + start + size),) + self.index[dim + 1 :]
        return CheckpointTensor(self.source, self.shape[:dim] + (size,) + self.shape[dim + 1 :], self.dtype, index)

    def load(self) -> torch.Tensor:
        if isinstance(self.source, torch.Tensor):
            return self.source[self.index]
        return self.source[self.index] if self.ndim else self.source[:]


def checkpoint_files(path: Path) -> list[str]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        return sorted(set(json.loads(index.read_text())["weight_map"].values()))
    return sorted(p.name for p in path.glob("*.safetensors"))


def iter_checkpoint(path: Path) -> Iterator[tuple[str, CheckpointTensor]]:
    """Every tensor of a safetensors checkpoint folder, unread."""
    files = checkpoint_files(path)
    if not files:
        raise ValueError(f"model: no *.safetensors weights in {path}; use load_format='dummy' for random weights")
    for file in files:
        with safe_open(str(path / file), framework="pt") as f:
            for name in f.keys():
                part = f.get_slice(name)
                yield name, CheckpointTensor(part, tuple(part.get_shape()), _SAFETENSORS_DTYPES[part.get_dtype()])
