"""gpt-oss (engine/models/gpt_oss.py): what it does not support yet is refused by name at load. Parity with
Hugging Face in every scheduling mode is in tests/engine/models/test_moe.py, TP=2 in test_parallel.py, its
attention sinks against a reference in tests/ops/test_torch_attention.py."""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams


@pytest.mark.parametrize("option,value", [("quantization", "int8"), ("enable_expert_parallel", True)])
def test_unsupported_options_are_refused_by_name(option, value, hf_checkpoint):
    with pytest.raises(ValueError, match=option):
        LLM(str(hf_checkpoint("gpt_oss")), dtype="float32", num_kv_blocks=64, tensor_parallel_size=1,
            **{option: value})


def test_the_builtin_gpt_oss_serves_with_its_sliding_window_kv_group():
    llm = LLM("pagedserve-tiny-gpt-oss", num_kv_blocks=256, max_model_len=1024)
    kv = llm.llm_engine.core.scheduler.kv_cache_manager
    assert [g.window for g in kv.window_groups] == [128]
    out = llm.generate([list(range(5, 600))], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                       use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 4
