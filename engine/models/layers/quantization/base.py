"""The interface between a linear layer and the format of its weights.

A layer knows its shapes (full and, under tensor parallelism, this rank's partition) and how to slice a
checkpoint tensor for this rank; its QuantMethod decides which parameters exist and how they compute.
Parameters carry the facts the layer's weight loader needs to slice them (vLLM's convention):
`output_dim` / `input_dim` (which tensor dim runs along the layer's output / input features) and, for
packed integer tensors, `packed_dim` and `pack_factor` (values per stored element along that dim). A
parameter may instead carry its own `weight_loader(param, loaded, shard_id)`."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch
from torch import nn


def set_weight_attrs(param: torch.Tensor, attrs: dict[str, Any]) -> None:
    for key, value in attrs.items():
        setattr(param, key, value)


class QuantMethod(ABC):
    @abstractmethod
    def create_weights(
        self,
        layer: nn.Module,
        input_size_per_partition: int,
        output_partition_sizes: list[int],
        params_dtype: torch.dtype,
    ) -> None:
        """Register the layer's weight parameters for this rank's partition. `output_partition_sizes`
        holds one size per fused sub-projection (q, k, v; gate, up), already divided across ranks."""

    def process_weights_after_loading(self, layer: nn.Module, batch_size_hint: int) -> None:
        """Turn loaded weights into their compute form (once, after every shard is loaded)."""

    @abstractmethod
    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x [tokens, input_size_per_partition] -> [tokens, sum(output_partition_sizes)]."""


class QuantizationConfig(ABC):
    """A checkpoint's (or an online) quantization scheme: which method each linear layer gets."""

    name: str

    @abstractmethod
    def get_quant_method(self, layer: nn.Module, prefix: str) -> QuantMethod | None:
        """The method of the linear layer named `prefix` (e.g. `model.layers.0.self_attn.qkv_proj`), or
        None to leave it dense."""
