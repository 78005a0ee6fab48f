"""Structured outputs on the engine, with the random-weight tiny model (which knows nothing of JSON):
every constrained output parses and validates, unconstrained neighbours are unchanged token for token,
compiles never stall the step loop, and matchers survive preemption and are released on finish/abort."""

from __future__ import annotations

import asyncio
import json
import re
import threading

import jsonschema
import pytest
import torch
import xgrammar as xgr

from engine import LLM, SamplingParams
from engine.sampling_params import MAX_GRAMMAR_BYTES, StructuredOutputsParams
from engine.structured_output import GrammarCompiler
from tests.conftest import TINY

# Nested objects, enums, arrays, required fields, integer ranges. Every string has a maxLength, every
# array a maxItems and every integer a range: the grammar cannot make a random model brief, but with a
# finite language it can bound what it may write (an unbounded number lets greedy decoding write digits
# forever). So every request ends by its grammar, well within max_tokens.
PET_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 12},
        "kind": {"enum": ["cat", "dog", "bird"]},
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
        "owner": {
            "type": "object",
            "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 100000}, "vip": {"type": "boolean"},
                           "email": {"type": "string", "maxLength": 10}},
            "required": ["id", "vip"],
        },
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
        "scores": {"type": "array", "items": {"type": "integer", "minimum": -50, "maximum": 50}, "minItems": 1,
                   "maxItems": 2},
    },
    "required": ["name", "kind", "age", "owner", "tags", "scores"],
}
PROMPTS = [f"Describe pet number {i}:" for i in range(50)]


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(TINY, max_model_len=1024, max_num_seqs=64)


def _so(**kwargs) -> StructuredOutputsParams:
    return StructuredOutputsParams(**kwargs)


def test_json_schema_every_output_validates(llm):
    params = SamplingParams(temperature=1.0, max_tokens=600, structured_outputs=_so(json=PET_SCHEMA))
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    finish = [o.outputs[0].finish_reason for o in outputs]
    assert finish == ["stop"] * 50  # the grammar's end stops each one, well before max_tokens
    for o in outputs:
        jsonschema.validate(json.loads(o.outputs[0].text), PET_SCHEMA)
    assert len({o.outputs[0].text for o in outputs}) > 40  # sampled, not one forced string
    assert llm.llm_engine.core.structured_output.num_active == 0  # every matcher released


def test_schema_given_as_text_and_greedy(llm):
    params = SamplingParams(temperature=0, max_tokens=600, structured_outputs=_so(json=json.dumps(PET_SCHEMA)))
    [a, b] = llm.generate(PROMPTS[:2], params, use_tqdm=False)
    for o in (a, b):
        assert o.outputs[0].finish_reason == "stop"
        jsonschema.validate(json.loads(o.outputs[0].text), PET_SCHEMA)


def test_regex_choice_grammar_and_json_object(llm):
    regex = r"[A-Z][a-z]{2,8}-\d{3}"
    choices = ["yes", "no", "maybe so", 'a "quoted" one']
    grammar = 'root ::= "(" num (" + " num){0,3} ")"\nnum ::= [1-9] [0-9]{0,2}'
    cases = [(_so(regex=regex), lambda t: re.fullmatch(regex, t)), (_so(choice=choices), lambda t: t in choices),
             (_so(grammar=grammar), lambda t: re.fullmatch(r"\([1-9]\d{0,2}( \+ [1-9]\d{0,2}){0,3}\)", t))]
    for so, check in cases:
        outputs = llm.generate(PROMPTS[:10], SamplingParams(temperature=1.0, max_tokens=64, structured_outputs=so),
                               use_tqdm=False)
        for o in outputs:
            assert o.outputs[0].finish_reason == "stop" and check(o.outputs[0].text), (so.kind, o.outputs[0].text)
    # Any object: arbitrary keys and nesting, so a random model may write a long one; assert on those that end.
    outputs = llm.generate(PROMPTS[:6], SamplingParams(temperature=1.0, max_tokens=300,
                                                       structured_outputs=_so(json_object=True)),
                           use_tqdm=False)
    ended = [o.outputs[0].text for o in outputs if o.outputs[0].finish_reason == "stop"]
    assert all(isinstance(json.loads(t), dict) for t in ended)
    assert all(o.outputs[0].text.startswith("{") for o in outputs)


def test_unconstrained_requests_in_the_batch_are_unaffected(llm):
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    seeded = SamplingParams(temperature=0.9, top_p=0.95, seed=7, max_tokens=24, ignore_eos=True)
    plain_prompts = ["The quick brown fox", "Once upon a time"]
    alone = [o.outputs[0].token_ids for o in llm.generate(plain_prompts, [greedy, seeded], use_tqdm=False)]
    constrained = SamplingParams(temperature=1.0, max_tokens=600, structured_outputs=_so(json=PET_SCHEMA))
    mixed = llm.generate(PROMPTS[:4] + plain_prompts + PROMPTS[4:8],
                         [constrained] * 4 + [greedy, seeded] + [constrained] * 4, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in mixed[4:6]] == alone
    for o in mixed[:4] + mixed[6:]:
        jsonschema.validate(json.loads(o.outputs[0].text), PET_SCHEMA)


def test_n_samples_each_have_their_own_matcher(llm):
    params = SamplingParams(n=4, temperature=1.0, seed=3, max_tokens=600, structured_outputs=_so(json=PET_SCHEMA))
    [out] = llm.generate(PROMPTS[:1], params, use_tqdm=False)
    texts = [c.text for c in out.outputs]
    assert len(set(texts)) == 4
    for c in out.outputs:
        assert c.finish_reason == "stop"
        jsonschema.validate(json.loads(c.text), PET_SCHEMA)
    [again] = llm.generate(PROMPTS[:1], params, use_tqdm=False)
    assert [c.text for c in again.outputs] == texts  # seeded: reproducible, grammar and all


def test_matchers_survive_preemption():
    small = LLM(TINY, max_model_len=256, num_kv_blocks=24, max_num_batched_tokens=128, max_num_seqs=16)
    params = SamplingParams(temperature=1.0, seed=5, max_tokens=200, structured_outputs=_so(json=PET_SCHEMA))
    long_prompts = [f"{p} " + "and more words " * 6 for p in PROMPTS[:12]]
    outputs = small.generate(long_prompts, params, use_tqdm=False)
    assert small.llm_engine.core.scheduler.num_preemptions > 0
    for o in outputs:
        assert o.outputs[0].finish_reason == "stop"
        jsonschema.validate(json.loads(o.outputs[0].text), PET_SCHEMA)


def test_a_slow_compile_does_not_stall_other_requests(llm):
    engine = llm.llm_engine
    compiler = engine.core.structured_output.compiler()
    gate = threading.Event()
    original = compiler.compile

    def gated(params):
        gate.wait(30)
        return original(params)

    compiler.compile = gated  # the real compile, only held back until we say so
    try:
        so = _so(regex=r"slow-[0-9]{4}")
        slow = engine.add_request("a prompt", SamplingParams(max_tokens=32, structured_outputs=so))
        fast = engine.add_request("b prompt", SamplingParams(max_tokens=8, ignore_eos=True))
        done = {}
        for _ in range(100):
            done.update({o.request_id: o for o in engine.step() if o.finished})
            if fast in done:
                break
        assert fast in done and slow not in done  # the plain request finished while the grammar compiled
        assert engine.get_stats().num_waiting == 1
    finally:
        gate.set()
        compiler.compile = original
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    assert re.fullmatch(r"slow-[0-9]{4}", done[slow].outputs[0].text) and done[slow].outputs[0].finish_reason == "stop"


def test_abort_releases_matchers_and_compiles(llm):
    engine = llm.llm_engine
    so = _so(json=PET_SCHEMA)
    running = engine.add_request("abort me", SamplingParams(max_tokens=600, structured_outputs=so))
    engine.step()
    engine.step()
    waiting = engine.add_request("me too", SamplingParams(n=2, max_tokens=600,
                                                          structured_outputs=_so(regex="[a-z]{1,200}")))
    outs = engine.abort_request([running, waiting])
    assert {o.request_id for o in outs} == {running, waiting}
    assert all(c.finish_reason == "abort" for o in outs for c in o.outputs)
    assert not engine.has_unfinished_requests() and engine.core.structured_output.num_active == 0


def test_a_grammar_that_fails_to_compile_fails_only_its_request(llm):
    bad, good = llm.generate(
        ["x", "y"],
        [SamplingParams(max_tokens=8, structured_outputs=_so(grammar="root ::= undefined_rule")),
         SamplingParams(max_tokens=8, ignore_eos=True)],
        use_tqdm=False,
    )
    assert bad.outputs[0].finish_reason == "error" and "structured_outputs" in bad.error
    assert good.outputs[0].finish_reason == "length" and len(good.outputs[0].token_ids) == 8


def test_grammar_end_stops_even_with_ignore_eos(llm):
    params = SamplingParams(max_tokens=64, ignore_eos=True, structured_outputs=_so(choice=["alpha", "beta"]))
    [out] = llm.generate(["pick"], params, use_tqdm=False)
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].text in ("alpha", "beta")


def test_params_validation():
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(regex="a", choice=["a"])
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="not a valid JSON schema at properties/a/type"):
        StructuredOutputsParams(json={"properties": {"a": {"type": "integr"}}})
    with pytest.raises(ValueError, match="not valid JSON"):
        StructuredOutputsParams(json="{oops")
    with pytest.raises(ValueError, match=f"at most {MAX_GRAMMAR_BYTES}"):
        StructuredOutputsParams(grammar='root ::= "' + "a" * MAX_GRAMMAR_BYTES + '"')
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(min_tokens=2, structured_outputs={"regex": "a+"})
    assert SamplingParams(structured_outputs={"json": {"type": "object"}}).structured_outputs.kind == "json"


XY_SCHEMA = {"type": "object", "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["x"]}


def test_json_whitespace_is_compact_unless_disable_any_whitespace_is_false(llm):
    def texts(**kwargs):
        params = SamplingParams(temperature=1.0, seed=5, max_tokens=200,
                                structured_outputs=_so(json=XY_SCHEMA, **kwargs))
        return [o.outputs[0].text for o in llm.generate(PROMPTS[:8], params, use_tqdm=False)]

    for compact in (texts(), texts(disable_any_whitespace=True)):
        assert all(re.fullmatch(r'\{"x": \d\}', t) for t in compact)
    loose = texts(disable_any_whitespace=False)  # a random model pads, where the grammar lets it
    assert any(re.search(r"\s{2}", t) for t in loose)
    assert all(json.loads(t)["x"] in range(10) for t in loose if t.rstrip().endswith("}"))


def test_structural_tag_constrains_its_tagged_region(llm):
    # A sequence of a regex and a tagged choice: finite. (xgrammar's JSON inside a tag allows free
    # whitespace, which a random model pads without end.)
    tag = {"type": "structural_tag", "format": {"type": "sequence", "elements": [
        {"type": "regex", "pattern": "[a-z]{1,4}"},
        {"type": "tag", "begin": "<f>", "content": {"type": "const_string", "value": "x=1"}, "end": "</f>"}]}}
    params = SamplingParams(temperature=1.0, max_tokens=60, structured_outputs=_so(structural_tag=json.dumps(tag)))
    for o in llm.generate(PROMPTS[:6], params, use_tqdm=False):
        assert o.outputs[0].finish_reason == "stop" and re.fullmatch(r"[a-z]{1,4}<f>x=1</f>", o.outputs[0].text)


def test_vllm_older_structural_tag_enters_its_schema_at_a_trigger(llm):
    tag = {"structures": [{"begin": "<f>", "schema": XY_SCHEMA, "end": "</f>"}], "triggers": ["<f"]}
    grammar = GrammarCompiler(llm.get_tokenizer(), 32064, {2}).compile(_so(structural_tag=json.dumps(tag)))
    free, bad = xgr.GrammarMatcher(grammar), xgr.GrammarMatcher(grammar)
    assert free.accept_string("any text at all, then <f>") and free.accept_string('{"x": 3}</f> and more text')
    assert bad.accept_string("text <f>") and not bad.accept_string("not json")


def test_vllm_structured_outputs_options():
    assert _so(json=XY_SCHEMA, disable_fallback=True, disable_additional_properties=True).kind == "json"
    assert _so(regex="a").cache_key != _so(json=XY_SCHEMA).cache_key
    assert _so(json=XY_SCHEMA).cache_key == _so(json=XY_SCHEMA, disable_any_whitespace=True).cache_key
    assert _so(json=XY_SCHEMA).cache_key != _so(json=XY_SCHEMA, disable_any_whitespace=False).cache_key
    with pytest.raises(ValueError, match="whitespace_pattern is not supported"):
        _so(json=XY_SCHEMA, whitespace_pattern=r"\s*")
    with pytest.raises(ValueError, match="structural_tag is not valid JSON"):
        _so(structural_tag="{oops")
    with pytest.raises(ValueError, match="each with begin, schema, end"):
        _so(structural_tag=json.dumps({"structures": [{"begin": "<f>"}], "triggers": ["<f>"]}))
    with pytest.raises(ValueError, match="exactly one"):
        _so(regex="a", structural_tag=json.dumps({"format": {}}))


def test_model_vocab_larger_than_the_tokenizer(llm):
    """Padded embeddings: the bitmask covers every logit and never allows an id the tokenizer lacks."""
    compiler = GrammarCompiler(llm.get_tokenizer(), 32064, {2})
    matcher = xgr.GrammarMatcher(compiler.compile(_so(json_object=True)))
    bitmask = xgr.allocate_token_bitmask(1, 32064)
    matcher.fill_next_token_bitmask(bitmask, 0)
    logits = torch.zeros(1, 32064)
    xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=32064)
    allowed = torch.isfinite(logits[0]).nonzero().flatten()
    assert len(allowed) > 0 and allowed.max() < 32000
    with pytest.raises(ValueError, match="structured_outputs: the regex cannot be compiled"):
        compiler.compile(_so(regex="a(b"))


def test_async_llm_streams_constrained_output_and_fails_a_bad_grammar():
    from engine import AsyncLLM, EngineConfig, RequestFailedError

    async def main(llm: AsyncLLM) -> None:
        params = SamplingParams(max_tokens=600, structured_outputs=_so(json=PET_SCHEMA))
        outs = [o async for o in llm.generate("stream me", params)]
        assert outs[-1].outputs[0].finish_reason == "stop" and len(outs) > 1  # deltas, not one final blob
        jsonschema.validate(json.loads("".join(o.outputs[0].text for o in outs)), PET_SCHEMA)
        with pytest.raises(RequestFailedError, match="structured_outputs: the regex cannot be compiled"):
            async for _ in llm.generate("bad", SamplingParams(structured_outputs=_so(regex="a(b"))):
                pass

    llm = AsyncLLM(EngineConfig(model=TINY, max_model_len=512, num_kv_blocks=128))
    try:
        asyncio.run(main(llm))
    finally:
        llm.shutdown()
