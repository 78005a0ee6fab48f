"""The oracle of every parity test (dense, parallel, MoE, quantized, LoRA): Hugging Face transformers'
greedy decoding on the same weights, and the one rule by which our tokens may differ from its tokens.

The rule: tokens must be equal, except that at the first position where they differ, Hugging Face's
top-2 logits may be closer than `tie_threshold` (the two candidates are tied up to float summation
order, which a different matmul, a sharded reduction or a quantized kernel legitimately changes) and our
token must be its runner-up. After such a tie the two continuations are different texts and are not
compared further. A test states its threshold; 1e-4 for float32 dense models."""

from __future__ import annotations

from functools import cache

import torch

TIE_THRESHOLD = 1e-4


@cache
def hf_model(path: str, dtype: torch.dtype = torch.float32, **kwargs):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **kwargs).eval()


def hf_greedy(path: str, prompt: list[int], n: int, quantize_inputs_of: tuple[str, ...] = (),
              row_parallel_ranks: int = 1, **model_kwargs) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy tokens and each step's log_softmax, one prompt at a time (no padding). Cached: the parity
    tests of several files ask for the same references; callers must not modify them.
    `quantize_inputs_of`: the decoder layers' linear modules by name (q_proj, ..., and `experts`: every
    projection inside Hugging Face's fused experts) whose inputs are rounded to int8 per token on the way in
    (W8A8's activations, by their definition: scale = max|x| / 127, round half to even, back to float).
    `row_parallel_ranks`: o_proj's and down_proj's inputs rounded in that many equal slices, each with its own
    scale, as tensor-parallel ranks holding a slice of each token do."""
    if "experts" in quantize_inputs_of:  # the eager experts are the ones that call F.linear
        model_kwargs.setdefault("experts_implementation", "eager")
    return _hf_greedy(path, tuple(prompt), n, quantize_inputs_of, row_parallel_ranks, **model_kwargs)


def _int8_per_token(x: torch.Tensor, slices: int = 1) -> torch.Tensor:
    if slices > 1:
        return torch.cat([_int8_per_token(part) for part in x.chunk(slices, dim=-1)], dim=-1)
    scale = x.abs().amax(-1, keepdim=True) / 127
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    return torch.round(x / scale).clamp(-127, 127) * scale


def _quantize_inputs(name: str, module: torch.nn.Module, slices: int) -> list:
    """Hooks rounding a module's inputs (fused experts: every F.linear inside its forward) to int8 per token, in
    `slices` slices."""
    if name.split(".")[-1] != "experts":
        return [module.register_forward_pre_hook(lambda m, args: (_int8_per_token(args[0], slices), *args[1:]))]
    linear = torch.nn.functional.linear

    def patch(m, args):
        torch.nn.functional.linear = lambda x, w, b=None: linear(_int8_per_token(x), w, b)

    def restore(m, args, out):
        torch.nn.functional.linear = linear

    return [module.register_forward_pre_hook(patch), module.register_forward_hook(restore)]


@cache
@torch.inference_mode()
def _hf_greedy(path: str, prompt: tuple[int, ...], n: int, quantize_inputs_of: tuple[str, ...] = (),
               row_parallel_ranks: int = 1, **model_kwargs) -> tuple[list[int], list[torch.Tensor]]:
    model = hf_model(path, **model_kwargs)
    leaf = lambda name: name.split(".")[-1]  # noqa: E731
    hooks = [hook for name, m in model.named_modules() if ".layers." in name and leaf(name) in quantize_inputs_of
             for hook in _quantize_inputs(name, m, row_parallel_ranks if leaf(name) in ("o_proj", "down_proj") else 1)]
    try:
        return greedy(model, prompt, n)
    finally:
        for hook in hooks:
            hook.remove()


def quantize_base_layer_inputs(model) -> list:
    """A PEFT model's LoRA-wrapped linear layers: their base layers' inputs rounded to int8 per token (W8A8's
    base), the adapters' inputs left as they are. Returns the hooks, for the caller to remove."""
    return [hook for name, module in model.named_modules() if name.endswith(".base_layer")
            for hook in _quantize_inputs(name, module, 1)]


@torch.inference_mode()
def greedy(model, prompt: tuple[int, ...], n: int) -> tuple[list[int], list[torch.Tensor]]:
    """hf_greedy's loop on a model already built."""
    out = model(torch.tensor([list(prompt)]), use_cache=True)
    tokens, logprobs = [], []
    for i in range(n):
        lp = out.logits[0, -1].float().log_softmax(-1)
        token = int(lp.argmax())
        tokens.append(token)
        logprobs.append(lp)
        if i + 1 < n:  # the last token's forward pass would predict a token nobody reads
            out = model(torch.tensor([[token]]), cache=out.cache, use_cache=True)
    return tokens, logprobs


def assert_tokens_match(
    ours: list[int], reference: list[int], reference_logprobs: list[torch.Tensor],
    tie_threshold: float = TIE_THRESHOLD, what: str = "",
) -> int | None:
    """Assert the rule above; returns the position of a tolerated tie, or None when all tokens are equal."""
    assert len(ours) == len(reference), f"{what}: {len(ours)} tokens, the reference has {len(reference)}"
    for i, (a, b) in enumerate(zip(ours, reference)):
        if a == b:
            continue
        values, ids = reference_logprobs[i].topk(2)
        gap = float(values[0] - values[1])
        assert gap < tie_threshold and a == int(ids[1]), (
            f"{what}: token {i} is {a}, the reference's is {b}; its top-2 are {ids.tolist()} with a gap of "
            f"{gap:.2e}, which is no tie (threshold {tie_threshold:.0e})"
        )
        return i
    return None


def assert_output_matches(out, reference: tuple[list[int], list[int], list[torch.Tensor]], what: str = "",
                          logprob_tolerance: float = 1e-4) -> None:
    """An engine RequestOutput (asked for logprobs=1) against Hugging Face's (prompt ids, greedy tokens, each
    step's log_softmax): the same prompt, the tokens by the rule above, and each token's logprob up to a tie."""
    prompt_ids, tokens, logprobs = reference
    assert out.prompt_token_ids == prompt_ids, what
    tie = assert_tokens_match(out.outputs[0].token_ids, tokens, logprobs, what=what)
    for i, (token, entry) in enumerate(zip(out.outputs[0].token_ids[:tie], out.outputs[0].logprobs)):
        assert abs(entry[token].logprob - float(logprobs[i][token])) < logprob_tolerance, (what, i)
