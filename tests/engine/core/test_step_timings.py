"""EngineConfig.collect_step_timings: each output carries the engine steps its request took part in."""

from engine import LLM, SamplingParams
from tests.conftest import TINY


def test_outputs_carry_each_step_once_and_only_when_asked():
    params = SamplingParams(max_tokens=4, temperature=0)
    prompts = ["word " * 100, "short"]  # the long prompt prefills in chunks of 64 tokens
    llm = LLM(TINY, max_model_len=256, max_num_batched_tokens=64, collect_step_timings=True)
    long, short = llm.generate(prompts, params, use_tqdm=False)
    prefill_steps = -(-len(long.prompt_token_ids) // 64)
    steps = long.metrics.steps
    assert len(steps) == prefill_steps + 3  # the last prefill chunk samples the first token
    assert [s.num_tokens for s in steps[:prefill_steps - 1]] == [64] * (prefill_steps - 1)
    assert all(s.num_tokens == 1 for s in steps[prefill_steps:])
    assert all(a.end_time <= b.start_time for a, b in zip(steps, steps[1:]))
    assert all(s.batch_tokens <= 64 and 1 <= s.batch_size <= 2 for s in steps)
    assert len(short.metrics.steps) == 4
    untimed = LLM(TINY, max_model_len=256).generate(prompts, params, use_tqdm=False)
    assert all(out.metrics.steps == () for out in untimed)
