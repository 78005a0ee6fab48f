"""Features taken in pairs (README: "Feature pairs"): every pair of TP/PP, quantization, LoRA, MoE, P/D,
speculative decoding and structured outputs is either supported, with a test, or refused by name at load.
Here: each refused pair's message, raised before any weights load; and the supported pairs of P/D that no
other test runs (MoE, quantization, n-gram speculation, structured outputs), all in one transfer."""

from __future__ import annotations

import json

import pytest

from engine import LLM, EngineConfig, SamplingParams, StructuredOutputsParams
from tests.conftest import TINY
from tests.engine.kv_transfer.test_kv_transfer import _engine, _run

DRAFT = {"method": "draft_model", "model": TINY}


def _gptq_moe(hf_checkpoint, tmp_path):
    """A Qwen3-MoE folder whose config says GPTQ over dense weights: no weights are read before the refusal."""
    dense, folder = hf_checkpoint("qwen3_moe"), tmp_path / "gptq"
    folder.mkdir()
    for f in dense.iterdir():
        if f.name != "config.json":
            (folder / f.name).symlink_to(f)
    config = json.loads((dense / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": False,
                                     "sym": True}
    (folder / "config.json").write_text(json.dumps(config))
    return LLM(str(folder), dtype="float32", num_kv_blocks=64, max_model_len=256)


# pair -> (what builds the engine, the message). Each refusal comes from a config check (EngineConfig) or from
# building the model's modules, before any weights are read.
REFUSED = {
    "pd_consumer_x_draft_model": (
        lambda *_: EngineConfig(model=TINY, kv_transfer_config={"kv_role": "kv_consumer"}, speculative_config=DRAFT),
        "speculative_config: method='draft_model' cannot run with kv_transfer_config.kv_role='kv_consumer'"),
    "pd_both_x_draft_model": (
        lambda *_: EngineConfig(model=TINY, kv_transfer_config={"kv_role": "kv_both"}, speculative_config=DRAFT),
        "speculative_config: method='draft_model' cannot run with kv_transfer_config.kv_role='kv_both'"),
    "quantized_checkpoint_x_moe": (_gptq_moe, r"quantization: gptq has no method for MoE experts \(model.layers.0"),
    "w4a8_x_moe": (lambda hf_checkpoint, _: LLM(str(hf_checkpoint("qwen3_moe")), dtype="float32", num_kv_blocks=64,
                                                 max_model_len=256, quantization="w4a8"),
                   r"quantization: 'w4a8' has no method for MoE experts \(model.layers.0.mlp.experts\)"),
}


@pytest.mark.parametrize("pair", REFUSED)
def test_refused_pairs_are_refused_by_name_at_load(pair, hf_checkpoint, tmp_path):
    build, message = REFUSED[pair]
    with pytest.raises(ValueError, match=message):
        build(hf_checkpoint, tmp_path)


def test_producer_side_draft_model_is_allowed():
    """A prefill engine may keep its draft model (it drafts nothing there: its requests stop after one token)."""
    EngineConfig(model=TINY, kv_transfer_config={"kv_role": "kv_producer"}, speculative_config=DRAFT)
    EngineConfig(model=TINY, kv_transfer_config={"kv_role": "kv_consumer"}, speculative_config={"method": "ngram"})


def test_disaggregated_moe_int8_with_ngram_and_a_json_schema(hf_checkpoint):
    """A Qwen3-MoE base quantized to int8 at load on both sides; the consumer speculates by n-gram lookup. Each
    request, remote-prefilled (the consumer computes only its last prompt token), gives the tokens the
    producer's engine gives it prefilled and decoded locally without speculation: greedy text (logprobs within
    1e-4) and a JSON schema. Prefix caching off on both, so that neither side reads the other's KV from a cache."""
    from engine import RequestOutputKind

    path = hf_checkpoint("qwen3_moe")
    both = dict(quantization="int8", enable_prefix_caching=False, num_threads=1)
    producer = _engine(path, "kv_producer", **both)
    consumer = _engine(path, "kv_consumer", speculative_config={"method": "ngram", "num_speculative_tokens": 3},
                       collect_step_timings=True, **both)
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=2,
                            output_kind=RequestOutputKind.FINAL_ONLY)
    schema = {"type": "object", "properties": {"a": {"enum": [1, 22, 333]}}, "required": ["a"]}
    constrained = SamplingParams(temperature=0, max_tokens=40, output_kind=RequestOutputKind.FINAL_ONLY,
                                 structured_outputs=StructuredOutputsParams(json=schema))
    prefill = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    try:
        # A prompt holding the model's own continuation of its start: n-gram lookup finds drafts that verify.
        seed = [1, 4021, 77, 905, 31000, 12, 8, 640]
        more = _run(producer, {"seed": (seed, greedy, None)})["seed"].outputs[0].token_ids
        requests = {"text": (seed + more + seed + more[:4], greedy), "json": (seed * 3, constrained)}
        local = _run(producer, {rid: (prompt, params, None) for rid, (prompt, params) in requests.items()})
        staged = _run(producer, {rid: (prompt, prefill, {"do_remote_decode": True})
                                 for rid, (prompt, _) in requests.items()})
        remote = _run(consumer, {rid: (prompt, params, staged[rid].kv_transfer_params)
                                 for rid, (prompt, params) in requests.items()})
        for rid in requests:
            ours, ref = remote[rid].outputs[0], local[rid].outputs[0]
            assert remote[rid].metrics.steps[0].num_tokens == 1, rid  # the prompt's KV was loaded
            assert ours.token_ids == ref.token_ids, rid
        for ours, theirs in zip(remote["text"].outputs[0].logprobs, local["text"].outputs[0].logprobs):
            for token, lp in theirs.items():
                assert ours[token].logprob == pytest.approx(lp.logprob, abs=1e-4)
        assert json.loads(remote["json"].outputs[0].text)["a"] in (1, 22, 333)
        assert consumer.get_stats().spec_decode_num_accepted_tokens > 0
    finally:
        producer.shutdown()
        consumer.shutdown()
