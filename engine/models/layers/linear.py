"""Linear layers sharded for tensor parallelism (Megatron's split, as vLLM lays it out).

- ColumnParallelLinear splits the output features across ranks; no communication.
- MergedColumnParallelLinear (gate_up) and QKVParallelLinear (qkv) fuse several projections, each
  split on its own, so a rank holds [q_r; k_r; v_r], not a slice of the concatenation. When there are
  fewer KV heads than ranks, each KV head is replicated on tp / num_kv_heads ranks.
- RowParallelLinear splits the input features and all-reduces the partial sums; rank 0 adds the bias.
- ReplicatedLinear is whole on every rank.
Every layer delegates its weights to a QuantMethod (dense by default) and loads checkpoint tensors
through `weight_loader`, which narrows each tensor to this rank's part before it is read."""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from engine.distributed import get_tp_group
from engine.models.checkpoint import CheckpointTensor
from engine.models.layers.direct_call import DirectCall
from engine.models.layers.quantization.base import QuantizationConfig, set_weight_attrs
from engine.models.layers.quantization.dense import DenseLinearMethod
from ops.cpu.decode_stack import Projection


def divide(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator:
        raise ValueError(f"tensor_parallel_size: {what}={numerator} is not divisible by {denominator}")
    return numerator // denominator


def copy_checked(param: torch.Tensor, loaded: CheckpointTensor) -> None:
    if tuple(param.shape) != tuple(loaded.shape):
        raise ValueError(f"has shape {tuple(loaded.shape)} (after sharding), expected {tuple(param.shape)}")
    param.data.copy_(loaded.load())


def _to_param_units(param: torch.Tensor, dim: int, size: int) -> int:
    """Features along `dim` -> stored elements (packed integer weights hold pack_factor per element)."""
    return size // param.pack_factor if getattr(param, "packed_dim", None) == dim else size


class LinearBase(DirectCall, nn.Module):
    def __init__(
        self,
        input_size: int,
        output_size: int,
        input_size_per_partition: int,
        output_partition_sizes: list[int],
        bias: bool,
        quant_config: QuantizationConfig | None,
        prefix: str,
    ) -> None:
        super().__init__()
        self.tp_group = get_tp_group()
        self.tp_rank, self.tp_size = self.tp_group.rank_in_group, self.tp_group.size
        self.input_size, self.output_size = input_size, output_size
        self.input_size_per_partition = input_size_per_partition
        self.output_partition_sizes = output_partition_sizes
        self.prefix = prefix
        self.params_dtype = torch.get_default_dtype()  # the compute dtype (build_model sets the default)
        method = quant_config.get_quant_method(self, prefix) if quant_config is not None else None
        self.quant_method = method or DenseLinearMethod()
        self.quant_method.create_weights(self, input_size_per_partition, output_partition_sizes, self.params_dtype)
        for param in self.parameters(recurse=False):
            if not hasattr(param, "weight_loader"):  # a quant method may bring its own
                param.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(torch.zeros(sum(output_partition_sizes)), requires_grad=False)
            set_weight_attrs(self.bias, {"output_dim": 0, "weight_loader": self.weight_loader})
        else:
            self.register_parameter("bias", None)

    @property
    def num_shards(self) -> int:
        """Checkpoint tensors fused into each parameter (q, k, v: 3)."""
        return 1

    def weight_loader(self, param: torch.Tensor, loaded: CheckpointTensor, shard_id: int | None = None) -> None:
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.quant_method.apply(self, x, self.bias)

    def decode_projection(self) -> Projection | None:
        """This layer as ops/cpu/decode_stack.cpp computes it (its method's kernel and a float32 bias), or None:
        not under tensor parallelism (no all-reduce there), nor where its method has no kernel in it."""
        projection = self.quant_method.decode_projection(self) if self.tp_size == 1 else None
        if projection is None or self.bias is None:
            return projection
        return replace(projection, bias=self.bias.float().contiguous())


class ReplicatedLinear(LinearBase):
    def __init__(self, input_size: int, output_size: int, bias: bool = False,
                 quant_config: QuantizationConfig | None = None, prefix: str = "") -> None:
        super().__init__(input_size, output_size, input_size, [output_size], bias, quant_config, prefix)

    def weight_loader(self, param, loaded, shard_id=None) -> None:
        copy_checked(param, loaded)


class ColumnParallelLinear(LinearBase):
    def __init__(self, input_size: int, output_size: int, bias: bool = False,
                 quant_config: QuantizationConfig | None = None, prefix: str = "",
                 output_sizes: list[int] | None = None) -> None:
        tp_size = get_tp_group().size
        output_sizes = output_sizes or [output_size]
        partition = [divide(n, tp_size, f"{prefix or 'a layer'} output size") for n in output_sizes]
        super().__init__(input_size, output_size, input_size, partition, bias, quant_config, prefix)

    def weight_loader(self, param, loaded, shard_id=None) -> None:
        dim = getattr(param, "output_dim", None)
        if dim is not None:
            size = param.shape[dim]
            loaded = loaded.narrow(dim, self.tp_rank * size, size)
        copy_checked(param, loaded)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of the same input in one matmul (gate and up)."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False,
                 quant_config: QuantizationConfig | None = None, prefix: str = "") -> None:
        super().__init__(input_size, sum(output_sizes), bias, quant_config, prefix, output_sizes=output_sizes)

    @property
    def num_shards(self) -> int:
        return len(self.output_partition_sizes)

    def shard_offset_and_size(self, shard_id: int) -> tuple[int, int]:
        """This rank's features of sub-projection `shard_id`: offset in the fused output, and size."""
        sizes = self.output_partition_sizes
        return sum(sizes[:shard_id]), sizes[shard_id]

    def shard_source_index(self, shard_id: int) -> int:
        """Which of the checkpoint tensor's tp_size equal parts this rank holds."""
        return self.tp_rank

    def weight_loader(self, param, loaded, shard_id=None) -> None:
        dim = getattr(param, "output_dim", None)
        if shard_id is None or dim is None:
            return super().weight_loader(param, loaded, shard_id)
        offset, size = (_to_param_units(param, dim, n) for n in self.shard_offset_and_size(shard_id))
        loaded = loaded.narrow(dim, self.shard_source_index(shard_id) * size, size)
        copy_checked(param.data.narrow(dim, offset, size), loaded)


class QKVParallelLinear(MergedColumnParallelLinear):
    def __init__(self, hidden_size: int, head_size: int, total_num_heads: int, total_num_kv_heads: int,
                 bias: bool = False, quant_config: QuantizationConfig | None = None, prefix: str = "") -> None:
        tp_size = get_tp_group().size
        self.num_heads = divide(total_num_heads, tp_size, "num_attention_heads")
        if tp_size >= total_num_kv_heads:
            # Fewer KV heads than ranks: each rank holds one KV head, shared by tp / kv_heads ranks.
            self.num_kv_head_replicas = divide(tp_size, total_num_kv_heads, "num_key_value_heads (replicated)")
            self.num_kv_heads = 1
        else:
            self.num_kv_head_replicas = 1
            self.num_kv_heads = divide(total_num_kv_heads, tp_size, "num_key_value_heads")
        self.head_size = head_size
        # The k and v parts are sized so that tp_size equal parts give each rank its (replicated) heads.
        q, kv = total_num_heads * head_size, self.num_kv_heads * tp_size * head_size
        super().__init__(hidden_size, [q, kv, kv], bias, quant_config, prefix)
        self.output_size = (total_num_heads + 2 * total_num_kv_heads) * head_size

    def shard_source_index(self, shard_id: int) -> int:
        return self.tp_rank if shard_id == 0 else self.tp_rank // self.num_kv_head_replicas


class RowParallelLinear(LinearBase):
    def __init__(self, input_size: int, output_size: int, bias: bool = False,
                 quant_config: QuantizationConfig | None = None, prefix: str = "",
                 reduce_results: bool = True) -> None:
        tp_size = get_tp_group().size
        super().__init__(input_size, output_size, divide(input_size, tp_size, f"{prefix or 'a layer'} input size"),
                         [output_size], bias, quant_config, prefix)
        self.reduce_results = reduce_results

    def weight_loader(self, param, loaded, shard_id=None) -> None:
        dim = getattr(param, "input_dim", None)
        if dim is not None:
            size = param.shape[dim]
            loaded = loaded.narrow(dim, self.tp_rank * size, size)
        copy_checked(param, loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The bias joins once, on rank 0, so that the all-reduce adds it once.
        y = self.quant_method.apply(self, x, self.bias if self.tp_rank == 0 else None)
        return self.tp_group.all_reduce(y) if self.reduce_results else y
