"""Bad input fails with an error naming the parameter, and the engine keeps serving."""

from __future__ import annotations

import pydantic
import pytest

from engine import LLM, EngineConfig, SamplingParams
from tests.conftest import TINY


@pytest.fixture(scope="module")
def llm():
    return LLM(TINY, max_model_len=64)


@pytest.mark.parametrize(
    "kwargs, param",
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": -3}, "max_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"logprobs": 21}, "logprobs"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"bogus": 1}, "bogus"),
    ],
)
def test_invalid_sampling_params_name_the_parameter(kwargs, param):
    with pytest.raises(pydantic.ValidationError) as e:
        SamplingParams(**kwargs)
    assert param in str(e.value)
    assert isinstance(e.value, ValueError)


@pytest.mark.parametrize(
    "kwargs, param",
    [
        ({"dtype": "float64"}, "dtype"),
        ({"block_size": 0}, "block_size"),
        ({"max_num_seqs": 0}, "max_num_seqs"),
        ({"device": "tpu"}, "device"),
        ({"attention_backend": "xformers"}, "attention_backend"),
        ({"num_kv_blocks": 1}, "num_kv_blocks"),
        ({"unknown_knob": True}, "unknown_knob"),
    ],
)
def test_invalid_engine_config_names_the_field(kwargs, param):
    with pytest.raises(pydantic.ValidationError) as e:
        EngineConfig(model=TINY, **kwargs)
    assert param in str(e.value)


@pytest.mark.parametrize(
    "kwargs, param",
    [
        ({"max_model_len": 100_000}, "max_model_len"),
        ({"num_kv_blocks": 3, "max_model_len": 512}, "num_kv_blocks"),
        ({"enable_chunked_prefill": False, "max_num_batched_tokens": 16, "max_model_len": 64},
         "max_num_batched_tokens"),
        ({"attention_backend": "flashinfer", "device": "cpu"}, "attention_backend"),
    ],
)
def test_inconsistent_engine_config_names_the_field(kwargs, param):
    with pytest.raises(ValueError, match=param):
        LLM(TINY, **kwargs)


def test_unknown_model_and_unsupported_architecture(tmp_path):
    with pytest.raises(ValueError, match="model"):
        LLM(str(tmp_path / "missing"))
    (tmp_path / "config.json").write_text('{"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}')
    with pytest.raises(ValueError, match="LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM"):
        LLM(str(tmp_path))


@pytest.mark.parametrize(
    "prompt, param",
    [
        ("", "prompt"),
        ([], "prompts"),
        ([[]], "prompt"),
        ([[1, 2, 32000]], "prompt"),
        ([[1, -5]], "prompt"),
        ([[1, 2.5]], "prompt"),
        ([list(range(1, 65))], "prompt"),  # 64 tokens: no room within max_model_len=64
        ([3.5], "prompts"),
    ],
)
def test_bad_prompts_fail_and_engine_keeps_serving(llm, prompt, param):
    good = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    with pytest.raises(ValueError, match=param):
        llm.generate(prompt, good, use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()
    out = llm.generate(["still serving"], good, use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 4


def test_a_bad_prompt_in_a_batch_submits_nothing(llm):
    good = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    with pytest.raises(ValueError, match="prompt"):
        llm.generate(["fine", [1, 99999], "also fine"], good, use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()
    pool = llm.llm_engine.core.scheduler.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_usable_blocks


def test_per_prompt_params_must_match(llm):
    with pytest.raises(ValueError, match="sampling_params"):
        llm.generate(["a", "b"], [SamplingParams()], use_tqdm=False)
    with pytest.raises(ValueError, match="stop_token_ids"):
        llm.generate(["a"], SamplingParams(stop_token_ids=[10**6]), use_tqdm=False)


def test_max_tokens_is_capped_by_max_model_len(llm):
    prompt = list(range(1, 60))  # 59 tokens: room for 5
    out = llm.generate([prompt], SamplingParams(max_tokens=50, ignore_eos=True), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 5 and out.outputs[0].finish_reason == "length"


@pytest.mark.parametrize(
    "call, param",
    [
        (lambda llm: llm.generate("hi \udcff there", use_tqdm=False), "prompt"),
        (lambda llm: llm.generate(["fine", "\ud83d"], use_tqdm=False), "prompt"),
        (lambda llm: llm.chat([{"role": "user", "content": "a\udcff"}], use_tqdm=False), "messages.0.content"),
        (lambda llm: llm.chat([{"role": "user", "content": [{"type": "text", "text": "\ude00"}]}], use_tqdm=False),
         "messages.0.content.0.text"),
        (lambda llm: SamplingParams(stop=["ok", "\udcff"]), "stop"),
        (lambda llm: SamplingParams(structured_outputs={"regex": "[a-z\ud800]"}), "structured_outputs"),
    ],
)
def test_text_that_is_not_unicode_is_refused_naming_the_parameter(llm, call, param):
    with pytest.raises(ValueError, match="unpaired UTF-16 surrogate") as e:
        call(llm)
    assert param in str(e.value) and "\udcff" not in str(e.value)
    assert not llm.llm_engine.has_unfinished_requests()


def test_a_prompt_too_long_for_any_tokenization_is_refused_before_tokenizing(llm):
    limit = llm.llm_engine.input_processor.max_prompt_chars
    assert limit == 64 * 16  # the built-in tokenizer's longest token is 16 characters
    with pytest.raises(ValueError,
                       match=r"^prompt: the prompt has 1025 characters, which cannot fit in max_model_len=64"):
        llm.generate("a" * (limit + 1), use_tqdm=False)
    with pytest.raises(ValueError, match=r"^messages: the chat prompt \(messages, system prompt and tools\) has \d+ "
                                         r"characters, which cannot fit"):
        llm.chat([{"role": "user", "content": "a" * (limit + 1)}], use_tqdm=False)
    with pytest.raises(ValueError, match=r"^prompt: \d+ tokens leave no room"):  # within the bound: tokenized
        llm.generate("a b " * 100, use_tqdm=False)


@pytest.mark.parametrize("text", [
    "a\x00b\x01\x1b[31m\x7f", "e\u0301\u0323\u0302", "\U0001F468\u200d\U0001F469\u200d\U0001F467",
    "\u202eabc\u202c \u05e9\u05dc\u05d5\u05dd", "\ufeff\uffff\U0010ffff"])
def test_hostile_but_valid_text_is_served(llm, text):
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, stop=[text])
    out = llm.generate(text, params, use_tqdm=False)[0]
    assert out.prompt == text and len(out.outputs[0].token_ids) == 3
    assert llm.chat([{"role": "user", "content": text}], params, use_tqdm=False)[0].outputs[0].finish_reason
