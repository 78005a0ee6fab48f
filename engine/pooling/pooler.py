"""Pooling a step's hidden states into embeddings. A prompt may be computed over several steps (chunked
prefill), so the driver keeps each request's running sum of the positions its pooling reads: the last token's
state (`last`), the first's (`cls`), or all of them (`mean`). The workers return only those sums, one row per
scheduled request that pools in the step, never every token's state."""

from __future__ import annotations

import numpy as np
import torch

from engine.pooling.config import PoolerConfig
from engine.pooling.params import PoolingParams


def segment_sums(hidden: torch.Tensor, segments: np.ndarray) -> torch.Tensor:
    """float32 [len(segments), hidden]: the sum of hidden's rows first..first+count for each (first, count)."""
    rows = torch.from_numpy(np.concatenate([np.arange(first, first + count) for first, count in segments]))
    owner = torch.from_numpy(np.repeat(np.arange(len(segments)), segments[:, 1])).to(hidden.device)
    sums = torch.zeros(len(segments), hidden.shape[-1], dtype=torch.float32, device=hidden.device)
    return sums.index_add_(0, owner, hidden[rows.to(hidden.device)].float())


class Pooler:
    def __init__(self, config: PoolerConfig) -> None:
        self.pooling_type = config.pooling_type
        self.normalize = bool(config.normalize)

    def rows(self, start: int, num_tokens: int, num_prompt_tokens: int) -> tuple[int, int] | None:
        """(first, count) of the step's tokens start..start+num_tokens that pooling reads, relative to the
        request's first row in the step; None when it reads none of them."""
        if self.pooling_type == "mean":
            return 0, num_tokens
        if self.pooling_type == "cls":
            return (0, 1) if start == 0 else None
        return (num_tokens - 1, 1) if start + num_tokens == num_prompt_tokens else None

    def accumulate(self, running: torch.Tensor | None, start: int, step_sum: torch.Tensor) -> torch.Tensor:
        """The request's running sum after this step's. Only a mean adds up; a step from position 0 starts it
        afresh (a preempted request recomputes its prompt from the start: mean never reads the prefix cache)."""
        if running is None or start == 0 or self.pooling_type != "mean":
            return step_sum
        return running + step_sum

    def finish(self, running: torch.Tensor, num_prompt_tokens: int, params: PoolingParams) -> np.ndarray:
        """The embedding of a whole prompt's sum: averaged (mean), cut to `dimensions`, then normalized."""
        vector = running / num_prompt_tokens if self.pooling_type == "mean" else running
        if params.dimensions is not None:
            vector = vector[: params.dimensions]
        if self.normalize if params.normalize is None else params.normalize:
            vector = torch.nn.functional.normalize(vector, dim=-1)
        return vector.cpu().numpy()
