"""Verification of draft tokens against the target model's distributions (Leviathan et al. 2023).

For each request, draft tokens x_1..x_k were drawn from q_1..q_k (a point mass for n-gram or greedy
drafts) and the target gave p_1..p_{k+1} at the same positions, p being the *processed* distribution the
sampler would draw from (penalties, temperature, top-k/top-p/min-p applied). Draft x_i is accepted with
probability min(1, p_i(x_i) / q_i(x_i)); the first rejected position instead emits a token from
norm(max(0, p_i - q_i)); when all k are accepted, a bonus token comes from p_{k+1}. Every emitted token is
then distributed exactly as if sampled from the target alone."""

from __future__ import annotations

import torch

from engine.sample.sampler import draw


def accept_greedy(draft_token_ids: list[int], target_token_ids: list[int]) -> list[int]:
    """Greedy verification: drafts while they equal the target's argmax at their position, then the
    target's own token (the correction, or the bonus after k accepted drafts). `target_token_ids` holds
    the argmax at each of the len(drafts) + 1 positions."""
    num_accepted = 0
    while num_accepted < len(draft_token_ids) and draft_token_ids[num_accepted] == target_token_ids[num_accepted]:
        num_accepted += 1
    return draft_token_ids[:num_accepted] + [target_token_ids[num_accepted]]


def rejection_sample(
    target_probs: torch.Tensor,
    draft_token_ids: list[list[int]],
    draft_probs: torch.Tensor | None,
    generator: torch.Generator | None = None,
) -> list[list[int]]:
    """Emitted tokens of each request: its accepted drafts, then one recovered or bonus token.

    target_probs: [sum(k_i + 1), V], request i's k_i + 1 rows in order (one per draft, then the bonus).
    draft_probs: [sum(k_i), V], request i's k_i rows in order; None means each draft is a point mass
    (n-gram lookup, greedy drafting): accepted with probability p(x), recovered from p without x."""
    device = target_probs.device
    num_drafts = [len(d) for d in draft_token_ids]
    draft_rows, bonus_rows, row = [], [], 0
    for k in num_drafts:
        draft_rows.extend(range(row, row + k))
        bonus_rows.append(row + k)
        row += k + 1
    if row != target_probs.shape[0]:
        raise ValueError(f"target_probs: {target_probs.shape[0]} rows for drafts needing {row}")
    bonus = draw_from(target_probs[bonus_rows], generator).tolist()
    if not draft_rows:
        return [[b] for b in bonus]
    drafts = torch.tensor([t for d in draft_token_ids for t in d], dtype=torch.long, device=device)
    p = target_probs[draft_rows].float()
    p_x = p.gather(1, drafts[:, None]).squeeze(1)
    if draft_probs is None:
        q_x = torch.ones_like(p_x)
        residual = p.scatter(1, drafts[:, None], 0.0)
    else:
        q = draft_probs.float()
        q_x = q.gather(1, drafts[:, None]).squeeze(1)
        residual = (p - q).clamp_(min=0.0)
    # u < p/q without dividing: q(x) > 0 for a token drawn from q.
    accepted = (torch.rand(p_x.shape, generator=generator, device=device) * q_x < p_x).tolist()
    # A residual without mass means p <= q everywhere, i.e. p == q: no draft is ever rejected there,
    # so the fallback only keeps the draw well defined.
    empty = residual.sum(dim=1) <= 0
    if empty.any():
        residual[empty] = p[empty]
    recovered = draw_from(residual, generator).tolist()

    emitted, flat = [], 0
    for i, (tokens, k) in enumerate(zip(draft_token_ids, num_drafts)):
        num_accepted = 0
        while num_accepted < k and accepted[flat + num_accepted]:
            num_accepted += 1
        last = recovered[flat + num_accepted] if num_accepted < k else bonus[i]
        emitted.append(list(tokens[:num_accepted]) + [last])
        flat += k
    return emitted


def draw_from(weights: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One token per row, with probability proportional to its (unnormalized) weight, as the sampler draws."""
    return draw(weights, torch.rand(weights.shape[0], generator=generator, dtype=torch.float64,
                                    device=weights.device))
