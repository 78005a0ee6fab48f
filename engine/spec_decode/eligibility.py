"""Which decoding requests get draft tokens. Speculation emits several tokens per step; requests whose
sampling carries per-token state that a batch of tokens would break get none and decode one token at a
time, exactly as without speculation."""

from __future__ import annotations

from engine.core.request import Request


def can_draft(request: Request) -> bool:
    params = request.sampling_params
    # Structured outputs advance a grammar matcher token by token and mask each position by its state.
    if getattr(params, "structured_outputs", None) is not None:
        return False
    # A thinking budget forces its end tag at one position, known only once the tokens before it are.
    if request.thinking is not None and not request.thinking.in_answer:
        return False
    # A seeded request draws its noise from (seed, output index); verification draws from the engine's
    # generator, so drafting would change its samples. Greedy seeded requests use no noise at all.
    if request.seed is not None and not params.greedy:
        return False
    # Until min_tokens, EOS and stop tokens are banned position by position and stop strings ignored;
    # one token per step keeps both exact, and the restriction ends with min_tokens.
    return request.num_output_tokens >= params.min_tokens
