"""The sampling surface through the engine: n, logit_bias, penalties, min_p, min_tokens, stop strings,
prompt logprobs, priorities and chat."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.sample.sampler import Penalties, apply_penalties
from tests.conftest import TINY

PROMPT = "The quick brown fox jumps over the lazy dog"


@pytest.fixture(scope="module")
def llm():
    return LLM(TINY, max_model_len=512)


def test_n_samples_differ_and_share_prompt_blocks(llm):
    engine = llm.llm_engine
    prompt = list(range(100, 100 + 70))  # 70 tokens: blocks 0-3 full, the 5th holds the last 6
    rid = engine.add_request(prompt, SamplingParams(n=4, temperature=1.0, seed=3, max_tokens=20, ignore_eos=True))
    outputs = []
    while engine.has_unfinished_requests():
        running = [r for r in engine.core.scheduler.running if r.external_id == rid]
        if len(running) == 4 and all(r.num_output_tokens >= 1 for r in running):
            tables = [engine.core.scheduler.kv_cache_manager.get_block_ids(r) for r in running]
            shared = (len(prompt) - 1) // 16  # the first sample's full prompt blocks, hit by the others
            assert all(t[:shared] == tables[0][:shared] for t in tables)
            in_use = {b for t in tables for b in t}
            assert len(in_use) == shared + sum(len(t) - shared for t in tables)  # the rest is private
        outputs.extend(engine.step())
    final = [o for o in outputs if o.finished][0]
    samples = [c.token_ids for c in final.outputs]
    assert [c.index for c in final.outputs] == [0, 1, 2, 3]
    assert len({tuple(s) for s in samples}) == 4 and all(len(s) == 20 for s in samples)
    again = llm.generate([prompt], SamplingParams(n=4, temperature=1.0, seed=3, max_tokens=20, ignore_eos=True),
                         use_tqdm=False)
    assert [c.token_ids for c in again[0].outputs] == samples  # seeded n > 1 is reproducible


def test_logit_bias_forces_a_token(llm):
    out = llm.generate([PROMPT], SamplingParams(temperature=1.0, max_tokens=12, logit_bias={777: 100.0},
                                                ignore_eos=True), use_tqdm=False)
    assert out[0].outputs[0].token_ids == [777] * 12


def test_penalties_follow_the_openai_definition():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0]])
    p = Penalties(
        rows=torch.tensor([0]), presence=torch.tensor([0.5]), frequency=torch.tensor([0.25]),
        repetition=torch.tensor([2.0]), output_tokens=torch.tensor([[0, 0, 1, 4]]),  # 4 = padding
        prompt_tokens=torch.tensor([[3, 4]]),
    )
    apply_penalties(logits, p)
    # token 0: seen twice: 2/2 - 0.25*2 - 0.5; token 1: once: -1*2 - 0.25 - 0.5; token 2: unseen;
    # token 3: prompt only: repetition only, 3/2
    torch.testing.assert_close(logits, torch.tensor([[1.0 - 0.5 - 0.5, -2.0 - 0.25 - 0.5, 0.5, 1.5]]))


def test_frequency_penalty_reduces_repetition(llm):
    def repeats(params):
        tokens = llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0].token_ids
        return len(tokens) - len(set(tokens))

    base = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    assert repeats(base) > 10  # the random tiny model loops
    assert repeats(base.model_copy(update={"frequency_penalty": 2.0, "presence_penalty": 2.0})) < repeats(base)
    assert repeats(base.model_copy(update={"repetition_penalty": 5.0})) < repeats(base)


def test_min_p_one_is_greedy(llm):
    greedy = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), use_tqdm=False)
    min_p = llm.generate([PROMPT], SamplingParams(temperature=1.0, min_p=1.0, max_tokens=10, ignore_eos=True),
                         use_tqdm=False)
    assert greedy[0].outputs[0].token_ids == min_p[0].outputs[0].token_ids


def test_min_tokens_holds_back_eos(llm):
    eos = llm.get_tokenizer().eos_token_id
    forced = SamplingParams(temperature=0, max_tokens=20, logit_bias={eos: 100.0})
    assert llm.generate([PROMPT], forced, use_tqdm=False)[0].outputs[0].token_ids == [eos]
    out = llm.generate([PROMPT], forced.model_copy(update={"min_tokens": 5}), use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 6 and out.token_ids[-1] == eos and eos not in out.token_ids[:5]
    assert out.finish_reason == "stop" and "</s>" not in out.text


def test_stop_string_through_the_engine(llm):
    base = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    full = llm.generate([PROMPT], base, use_tqdm=False)[0].outputs[0]
    # A stop string straddling the boundary between two output tokens, first seen there.
    for k in range(5, 25):
        head = llm.generate([PROMPT], base.model_copy(update={"max_tokens": k}), use_tqdm=False)[0].outputs[0].text
        stop = head[-2:] + full.text[len(head) : len(head) + 2]
        if len(stop) == 4 and full.text.index(stop) == len(head) - 2:
            break
    else:
        pytest.fail("no token boundary with a fresh 4-character stop string")
    cut = len(head) - 2
    out = llm.generate([PROMPT], base.model_copy(update={"stop": [stop]}), use_tqdm=False)[0].outputs[0]
    assert out.text == full.text[:cut] and out.finish_reason == "stop" and out.stop_reason == stop
    kept = llm.generate([PROMPT], base.model_copy(update={"stop": [stop], "include_stop_str_in_output": True}),
                        use_tqdm=False)
    assert kept[0].outputs[0].text == full.text[: cut + len(stop)]


def test_prompt_logprobs_match_transformers(llm, tiny_model_path):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()
    prompt = llm.get_tokenizer().encode(PROMPT * 4)
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=3)
    chunked = LLM(TINY, max_model_len=512, max_num_batched_tokens=16)
    for engine in (llm, chunked):
        out = engine.generate([prompt], params, use_tqdm=False)[0]
        with torch.no_grad():
            ref = hf(torch.tensor([prompt])).logits[0].log_softmax(-1)
        assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
        for pos in range(1, len(prompt)):
            entry = out.prompt_logprobs[pos]
            assert entry[prompt[pos]].logprob == pytest.approx(ref[pos - 1, prompt[pos]].item(), abs=1e-4)
            top = ref[pos - 1].topk(3).indices.tolist()
            assert all(t in entry for t in top)


def test_prompt_logprobs_are_computed_despite_a_cached_prefix(llm):
    prompt = list(range(200, 264))
    llm.generate([prompt], SamplingParams(max_tokens=1), use_tqdm=False)  # caches the prefix
    out = llm.generate([prompt], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
    assert out.num_cached_tokens == 0 and all(e is not None for e in out.prompt_logprobs[1:])


def test_priority_policy_serves_lower_values_first():
    llm = LLM(TINY, max_model_len=256, scheduling_policy="priority", max_num_seqs=1)
    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    for rid, priority in [("a", 5), ("b", 1), ("c", 3), ("d", -2), ("e", 3)]:
        engine.add_request([1, 2, 3], params, request_id=rid, priority=priority)
    order = []
    while engine.has_unfinished_requests():
        order += [o.request_id for o in engine.step() if o.finished]
    assert order == ["d", "b", "c", "e", "a"]


def test_priority_preemption_victim_is_the_lowest_priority():
    llm = LLM(TINY, max_model_len=64, scheduling_policy="priority", num_kv_blocks=7, block_size=16)
    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    engine.add_request(list(range(1, 30)), params, request_id="low", priority=10)
    engine.add_request(list(range(1, 30)), params, request_id="high", priority=0)
    preempted = []
    while engine.has_unfinished_requests():
        so_before = {r.request_id: r.num_preemptions for r in engine.core.scheduler.requests.values()}
        engine.step()
        preempted += [rid for rid, n in so_before.items() if rid in engine.core.scheduler.requests
                      and engine.core.scheduler.requests[rid].num_preemptions > n]
    assert preempted and set(preempted) == {"low"}


def test_chat_goes_through_the_template(llm):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    out = llm.chat(messages, SamplingParams(max_tokens=4), use_tqdm=False)[0]
    expected = llm.get_tokenizer().apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                       return_dict=False)
    assert out.prompt_token_ids == list(expected)
    assert out.prompt_token_ids[0] == 1 and out.prompt_token_ids.count(1) == 1  # one BOS
    with pytest.raises(ValueError, match="messages"):
        llm.chat([], use_tqdm=False)
