"""Top-k's and top-p's masks and the draw on CPU through sampling.cpp: radix selection over each row's
logits or probabilities instead of a sort, and an inverse CDF in two passes. The sampler
(engine/sample/sampler.py) calls these where they apply (float32 on CPU, compiled), else its torch code."""

from __future__ import annotations

import torch

from ops.cpu import load_sampling_kernels


def _kernels_for(x: torch.Tensor):
    """The compiled module where `x` can go to it (float32 on CPU), else None."""
    return load_sampling_kernels() if x.is_cpu and x.dtype == torch.float32 else None


def top_k_mask(logits: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor | None:
    """`logits` [rows, V] with the values below each row's `top_k`-th largest (top_k [rows]; V or more: none)
    set to -inf, ties with it kept; None where the kernel does not apply."""
    kernels = _kernels_for(logits)
    if kernels is None:
        return None
    logits = logits.contiguous()
    masked = torch.empty_like(logits)
    kernels.top_k_mask(masked, logits, top_k.to(torch.int64).contiguous())
    return masked


def top_p_mask(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor | None:
    """`probs` [rows, V] zeroed outside each row's nucleus under `top_p` [rows] (a token is kept while the tokens
    ranked above it hold less than top_p; 1 keeps all) and renormalized; None where the kernel does not apply
    (not float32 on CPU, or nothing compiled)."""
    kernels = _kernels_for(probs)
    if kernels is None:
        return None
    probs = probs.contiguous()
    kept = torch.empty_like(probs)
    kernels.top_p_mask(kept, probs, top_p.to(torch.float32).contiguous())
    return kept


def draw(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor | None:
    """[rows]: one index per row of `weights` [rows, V] by inverse CDF with `u` [rows] (the sampler's `draw`);
    None where the kernel does not apply."""
    kernels = _kernels_for(weights)
    if kernels is None:
        return None
    tokens = torch.empty(weights.shape[0], dtype=torch.int64)
    kernels.draw(tokens, weights.contiguous(), u.to(torch.float64).contiguous())
    return tokens
