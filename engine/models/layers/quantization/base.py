"""The interface between a linear layer and the format of its weights.

A layer knows its shapes (full and, under tensor parallelism, this rank's partition) and how to slice a
checkpoint tensor for this rank; its QuantMethod decides which parameters exist and how they compute.
Parameters carry the facts the layer's weight loader needs to slice them (vLLM's convention):
`output_dim` / `input_dim` (which tensor dim runs along the layer's output / input features) and, for
packed integer tensors, `packed_dim` and `pack_factor` (values per stored element along that dim). A
parameter may instead carry its own `weight_loader(param, loaded, shard_id)`, and one marked `optional`
may be absent from a checkpoint (GPTQ's g_idx)."""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from typing import Any

import torch
from torch import nn

from ops.cpu.decode_stack import Projection


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

    def process_weights_after_loading(self, layer: nn.Module,  # noqa: B027 - optional hook, a no-op by default
                                      batch_size_hint: int) -> None:
        """Turn loaded weights into their compute form (once, after every shard is loaded)."""

    @abstractmethod
    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x [tokens, input_size_per_partition] -> [tokens, sum(output_partition_sizes)]."""

    def decode_projection(self, layer: nn.Module) -> Projection | None:
        """`apply` as ops/cpu/decode_stack.cpp's kernels compute it (its bias aside), or None where they do not:
        the layers of a step then run in Python."""
        return None


class QuantizationConfig(ABC):
    """A checkpoint's (or an online) quantization scheme: which method each linear layer gets."""

    name: str
    # Our fused layer -> the checkpoint modules fused into it (q, k, v -> qkv_proj); the model sets it.
    fused_modules: dict[str, list[str]] = {}

    @abstractmethod
    def get_quant_method(self, layer: nn.Module, prefix: str) -> QuantMethod | None:
        """The method of the linear layer named `prefix` (e.g. `model.layers.0.self_attn.qkv_proj`), or
        None to leave it dense."""

    def checkpoint_names(self, prefix: str) -> list[str]:
        """The checkpoint's module names behind our layer `prefix`."""
        parent, _, leaf = prefix.rpartition(".")
        return [f"{parent}.{name}" for name in self.fused_modules.get(leaf, [leaf])]

    def is_skipped(self, prefix: str, patterns: list[str]) -> bool:
        """Whether the checkpoint left this layer unquantized (its `modules_to_not_convert`, `ignore`...):
        a pattern is `re:<regex>` (matched from the start) or a substring of the module name."""
        skipped = [any(_matches(name, p) for p in patterns) for name in self.checkpoint_names(prefix)]
        if any(skipped) and not all(skipped):
            raise ValueError(f"model: {prefix} fuses {', '.join(self.checkpoint_names(prefix))}, which the "
                             f"checkpoint's {self.name} quantization_config quantizes only partly; unsupported")
        return all(skipped)


def _matches(name: str, pattern: str) -> bool:
    return re.match(pattern[3:], name) is not None if pattern.startswith("re:") else pattern in name
