"""Vocabulary-parallel embedding and LM head: each rank holds a contiguous slice of the vocabulary's rows.

The embedding looks up the ids in its slice (others give zeros) and all-reduces; the LM head computes its
slice's logits and gathers them on the group's first rank (the one that samples), trimming the padding
that makes the vocabulary divisible by the number of ranks."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.distributed import get_tp_group
from engine.models.checkpoint import CheckpointTensor
from engine.models.layers.quantization import DenseLinearMethod


class VocabParallelEmbedding(nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        self.tp_group = get_tp_group()
        self.tp_rank, self.tp_size = self.tp_group.rank_in_group, self.tp_group.size
        self.num_embeddings = num_embeddings
        self.rows_per_partition = -(-num_embeddings // self.tp_size)
        self.vocab_start = self.tp_rank * self.rows_per_partition
        # The last rank's slice may run past the vocabulary: those rows stay zero and are trimmed.
        self.num_real_rows = max(0, min(num_embeddings - self.vocab_start, self.rows_per_partition))
        self.weight = nn.Parameter(torch.zeros(self.rows_per_partition, embedding_dim), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: torch.Tensor, loaded: CheckpointTensor, shard_id: int | None = None) -> None:
        if loaded.shape[0] != self.num_embeddings or loaded.shape[1:] != param.shape[1:]:
            raise ValueError(f"has shape {tuple(loaded.shape)}, expected {(self.num_embeddings, *param.shape[1:])}")
        param.data[: self.num_real_rows].copy_(loaded.narrow(0, self.vocab_start, self.num_real_rows).load())

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        outside = (input_ids < self.vocab_start) | (input_ids >= self.vocab_start + self.rows_per_partition)
        out = F.embedding((input_ids - self.vocab_start).masked_fill(outside, 0), self.weight)
        out.masked_fill_(outside.unsqueeze(-1), 0)
        return self.tp_group.all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """The output projection, through the dense linear method (prepacked on CPU)."""

    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__(num_embeddings, embedding_dim)
        self.quant_method = DenseLinearMethod()

    def tie_to(self, embedding: VocabParallelEmbedding) -> None:
        self.weight = embedding.weight
        self.keeps_weight = True

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Full-vocabulary logits on the TP group's first rank; None on the others."""
        logits = self.quant_method.apply(self, hidden, None)
        if self.tp_size > 1:
            logits = self.tp_group.gather(logits, dim=-1)
            if logits is None:
                return None
        return logits[..., : self.num_embeddings] if logits.shape[-1] != self.num_embeddings else logits
