"""Sampling on CPU through sampling.cpp: a sampled step's rows in one call, and top-k's and top-p's masks and the
draw on their own (for the distributions speculative decoding keeps): radix selection over each row's logits or
probabilities instead of a sort, and an inverse CDF in two passes. The sampler (engine/sample/sampler.py) calls
these where they apply (float32 on CPU, compiled), else its torch code."""

from __future__ import annotations

import torch

from ops.cpu import load_sampling_kernels


def _kernels_for(x: torch.Tensor):
    """The compiled module where `x` can go to it (float32 on CPU), else None."""
    return load_sampling_kernels() if x.is_cpu and x.dtype == torch.float32 else None


def top_k_mask(logits: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor | None:
    """`logits` [rows, V] with the values below each row's `top_k`-th largest (top_k [rows]; V or more: none)
    set to -inf, ties with it kept; None where the kernel does not apply."""
    return _row_mask("top_k_mask", logits, top_k.to(torch.int64))


def top_p_mask(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor | None:
    """`probs` [rows, V] zeroed outside each row's nucleus under `top_p` [rows] (a token is kept while the tokens
    ranked above it hold less than top_p; 1 keeps all) and renormalized; None where the kernel does not apply
    (not float32 on CPU, or nothing compiled)."""
    return _row_mask("top_p_mask", probs, top_p.to(torch.float32))


def _row_mask(kernel: str, x: torch.Tensor, per_row: torch.Tensor) -> torch.Tensor | None:
    """A new [rows, V] from the mask kernel `kernel` over `x` with one setting per row; None where it does not
    apply."""
    kernels = _kernels_for(x)
    if kernels is None:
        return None
    x = x.contiguous()
    out = torch.empty_like(x)
    getattr(kernels, kernel)(out, x, per_row.contiguous())
    return out


def draw(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor | None:
    """[rows]: one index per row of `weights` [rows, V] by inverse CDF with `u` [rows] (the sampler's `draw`);
    None where the kernel does not apply."""
    kernels = _kernels_for(weights)
    if kernels is None:
        return None
    tokens = torch.empty(weights.shape[0], dtype=torch.int64)
    kernels.draw(tokens, weights.contiguous(), u.to(torch.float64).contiguous())
    return tokens


def sample_rows(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor | None,
                top_p: torch.Tensor | None, u: torch.Tensor) -> torch.Tensor | None:
    """[rows]: one token per row of `logits` [rows, V], drawn with `u` [rows] from the distribution
    engine/sample/sampler.py's processed_probs makes without min_p (temperature [rows] > 0; top_k [rows], V or
    more: off; top_p [rows], 1: off), each row in one pass of the kernel through L2; None where it does not apply."""
    kernels = _kernels_for(logits)
    if kernels is None:
        return None
    rows, vocab = logits.shape
    top_k = torch.full((rows,), vocab, dtype=torch.int64) if top_k is None else top_k.to(torch.int64).contiguous()
    top_p = torch.ones(rows) if top_p is None else top_p.to(torch.float32).contiguous()
    tokens = torch.empty(rows, dtype=torch.int64)
    kernels.sample_rows(tokens, logits.contiguous(), temperature.to(torch.float32).contiguous(), top_k, top_p,
                        u.to(torch.float64).contiguous())
    return tokens
