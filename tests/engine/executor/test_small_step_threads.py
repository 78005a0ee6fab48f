"""EngineConfig.small_step_threads: steps of few tokens run on fewer torch threads, the others on num_threads."""

import pytest
import torch

from engine import LLM, SamplingParams
from tests.conftest import TINY


@pytest.fixture
def restore_threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def test_small_steps_run_on_small_step_threads(restore_threads):
    llm = LLM(TINY, max_model_len=256, num_threads=2, small_step_threads=1, small_step_max_tokens=4)
    greedy = SamplingParams(max_tokens=3, temperature=0)
    prompts = ["word " * 40, "short"]
    decoded = llm.generate(prompts, greedy, use_tqdm=False)  # ends with a decode step of 1 or 2 tokens
    assert torch.get_num_threads() == 1
    llm.generate(["word " * 40], SamplingParams(max_tokens=1), use_tqdm=False)  # only a prefill step
    assert torch.get_num_threads() == 2
    plain = LLM(TINY, max_model_len=256, num_threads=2).generate(prompts, greedy, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in decoded] == [o.outputs[0].token_ids for o in plain]


def test_without_small_step_threads_every_step_keeps_num_threads(restore_threads):
    llm = LLM(TINY, max_model_len=256, num_threads=2)
    llm.generate(["short"], SamplingParams(max_tokens=3), use_tqdm=False)
    assert torch.get_num_threads() == 2


@pytest.mark.parametrize(("num_threads", "small"), [(2, 1), (1, 1)])
def test_auto_leaves_one_thread_to_the_serving_path(restore_threads, num_threads, small):
    llm = LLM(TINY, max_model_len=256, num_threads=num_threads, small_step_threads="auto")
    llm.generate(["short"], SamplingParams(max_tokens=3), use_tqdm=False)  # ends with a decode step of 1 token
    assert torch.get_num_threads() == small
