"""Decode-only steps on CPU run a Llama model's layers in one C++ call (ops/cpu/decode_stack.py): the same kernels in
the same order as the Python layers, so tokens and logprobs must be the same bit for bit; layers that compute
something else (LoRA, a weight-only quantization) keep the Python path. Where every token samples, that call also
takes the embedding, the final norm and the LM head (LlamaForCausalLM.decode_logits), with the same bits."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.models.llama import LlamaForCausalLM, LlamaModel
from ops.cpu import load_decode_stack, load_elementwise_kernels, missing_toolchain
from ops.cpu.linear import bfloat16_panels_preferred

pytestmark = pytest.mark.skipif(bool(missing_toolchain()), reason="no compiler: no CPU kernels")

PROMPTS = [[1, 5, 9, 200, 31], [1, 77, 3], [1, *range(400, 420)]]


def _llm(**kwargs) -> LLM:
    # No prefix caching: a second run of a prompt would prefill less of it, through another attention path.
    return LLM("pagedserve-tiny", num_kv_blocks=64, max_num_seqs=4, max_model_len=256, enable_prefix_caching=False,
               **kwargs)


def _model(llm: LLM) -> LlamaModel:
    return llm.llm_engine.core.executor.driver_worker.model.model


def _run(llm: LLM) -> list[tuple[list[int], list[list]]]:
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=3)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    return [(o.outputs[0].token_ids, [sorted((t, lp.logprob) for t, lp in d.items()) for d in o.outputs[0].logprobs])
            for o in outs]


@pytest.mark.parametrize("dtype, quantization", [("float32", None), ("bfloat16", None), ("float32", "w8a8"),
                                                 ("bfloat16", "w8a8"), ("float32", "w4a8")])
def test_decode_steps_through_the_stack_match_the_python_layers(dtype, quantization, monkeypatch):
    if dtype == "bfloat16" and quantization is None and not bfloat16_panels_preferred():
        pytest.skip("bfloat16 weights go to oneDNN on this CPU: no bfloat16 panels for the stack")
    llm = _llm(dtype=dtype, quantization=quantization)
    calls = []
    stack = _model(llm).decode_stack
    monkeypatch.setattr(LlamaModel, "decode_stack", lambda self: calls.append(1) or stack())
    fused = _run(llm)
    assert _model(llm)._decode_stack is not None and len(calls) >= 23  # every decode step of the longest request
    monkeypatch.setattr(LlamaModel, "decode_stack", lambda self: None)
    assert _run(llm) == fused


@pytest.mark.parametrize("dtype, quantization", [("float32", None), ("bfloat16", None), ("float32", "w8a8")])
def test_decode_steps_run_from_token_ids_to_logits_in_one_call(dtype, quantization, monkeypatch):
    if dtype == "bfloat16" and not bfloat16_panels_preferred():
        pytest.skip("bfloat16 weights go to oneDNN on this CPU: no bfloat16 panels for the stack")
    llm = _llm(dtype=dtype, quantization=quantization)
    whole = LlamaForCausalLM.decode_logits
    steps = []
    monkeypatch.setattr(LlamaForCausalLM, "decode_logits",
                        lambda self, *args: steps.append(1) or whole(self, *args))
    one_call = _run(llm)
    assert len(steps) >= 23  # every decode step of the longest request; a step with a prefill goes the other way
    # The layers still in one call, but the attention plan, embedding, norm and LM head in Python around it
    monkeypatch.setattr(LlamaForCausalLM, "decode_logits", lambda self, *args: None)
    assert _run(llm) == one_call


def test_greedy_tokens_without_logprobs_are_those_with_them():
    """Greedy rows asking nothing else are their argmax without the batched sampler; with logprobs (or beside a
    sampled row) the step goes through it. Either way the same tokens."""
    llm = _llm(dtype="float32")
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]

    def tokens(**extra) -> list[list[int]]:
        params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, **extra)
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]

    bare = tokens()
    assert bare == tokens(logprobs=0)
    sampled = SamplingParams(temperature=1.0, seed=5, max_tokens=16, ignore_eos=True)
    mixed = llm.generate([*prompts, "a sampled row beside them"],
                         [SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)] * 3 + [sampled],
                         use_tqdm=False)
    assert [o.outputs[0].token_ids for o in mixed[:3]] == bare


def test_a_token_id_outside_the_embedding_is_refused():
    llm = _llm(dtype="float32")
    _run(llm)
    model = llm.llm_engine.core.executor.driver_worker.model
    stack, vocab = model.model._decode_stack, model.lm_head.num_embeddings
    ids = torch.tensor([vocab], dtype=torch.int64)
    zeros = torch.zeros(1, dtype=torch.int64)
    with pytest.raises(RuntimeError, match=f"token id {vocab} outside the embedding"):
        stack.logits(ids, zeros, torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32), zeros, 16)


def test_decode_batches_past_a_linear_call_s_rows_split_as_the_python_path_does(monkeypatch):
    llm = LLM("pagedserve-tiny", dtype="float32", num_kv_blocks=600, max_num_seqs=520, max_model_len=64,
              max_num_batched_tokens=2048, enable_prefix_caching=False)
    prompts = [{"prompt_token_ids": [1, 3 + i % 500, 7]} for i in range(520)]
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, logprobs=1)

    def run():
        return [[sorted((t, lp.logprob) for t, lp in d.items()) for d in o.outputs[0].logprobs]
                for o in llm.generate(prompts, params, use_tqdm=False)]

    fused = run()
    assert _model(llm)._decode_stack is not None
    monkeypatch.setattr(LlamaModel, "decode_stack", lambda self: None)
    assert run() == fused


@pytest.mark.parametrize("kwargs", [{"dtype": "float32", "quantization": "int8"},
                                    {"dtype": "float32", "enable_lora": True}], ids=["weight-only-int8", "lora"])
def test_layers_that_compute_otherwise_keep_the_python_path(kwargs):
    llm = _llm(**kwargs)
    _run(llm)
    assert _model(llm).decode_stack() is None


def test_a_capsule_of_another_kernel_is_refused():
    kernels = {"float32_linear": load_elementwise_kernels().rms_norm_kernel}
    with pytest.raises(RuntimeError, match="expected a LinearKernel kernel capsule, got RmsNormKernel"):
        load_decode_stack().DecodeStack(kernels, [], torch.zeros(4, 2), torch.zeros(4, 2), 1e-5, 1.0, 8, 16, 2, 1, 4)
