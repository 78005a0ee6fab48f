"""Layers of the decoders: parallel linear layers with pluggable quantization methods, vocab-parallel
embedding and LM head, RMSNorm, rotary embeddings."""

from engine.models.layers.linear import (
    ColumnParallelLinear,
    LinearBase,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from engine.models.layers.norm import RMSNorm
from engine.models.layers.rotary import MRotaryEmbedding, RotaryEmbedding
from engine.models.layers.vocab_embedding import ParallelLMHead, VocabParallelEmbedding

__all__ = [
    "LinearBase",
    "ReplicatedLinear",
    "ColumnParallelLinear",
    "MergedColumnParallelLinear",
    "QKVParallelLinear",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "ParallelLMHead",
    "RMSNorm",
    "RotaryEmbedding",
    "MRotaryEmbedding",
]
