"""Disaggregated prefill/decode inside the engine (engine/kv_transfer): a producer engine computes prompts
and stages their KV; a consumer engine loads it, recomputes only the last prompt token and decodes the
same greedy tokens and logprobs as an engine that did everything; the producer holds the blocks under a
lease, released by the consumer's confirmation or by time; nothing is left staged or held."""

from __future__ import annotations

import time

import pytest

from engine import EngineConfig, LLMEngine, RequestOutputKind, SamplingParams
from engine.shm_files import staged_path
from tests.engine.models.test_hf_parity import PROMPTS

# FINAL_ONLY: the final output's metrics then hold every step the request took part in.
DECODE = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3,
                        output_kind=RequestOutputKind.FINAL_ONLY)
PREFILL = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
ENGINE = dict(dtype="float32", num_kv_blocks=256, max_num_seqs=8, max_model_len=400, max_num_batched_tokens=128)


def _engine(path, role: str | None = None, **kwargs) -> LLMEngine:
    transfer = {"kv_transfer_config": {"kv_role": role, "lease_s": 30.0}} if role else {}
    return LLMEngine(EngineConfig(model=str(path), **{**ENGINE, **transfer, **kwargs}))


def _run(engine: LLMEngine, requests: dict[str, tuple[list[int], SamplingParams, dict | None]]) -> dict:
    for rid, (prompt, params, transfer) in requests.items():
        engine.add_request(prompt, params, request_id=rid, kv_transfer_params=transfer)
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    return finished


def _idle(engine: LLMEngine) -> bool:
    pool = engine.core.scheduler.kv_cache_manager.block_pool
    return pool.get_num_free_blocks() == pool.num_usable_blocks and not engine.core.scheduler.in_flight


@pytest.mark.parametrize("layout", [(1, 1), (2, 1)], ids=["tp1", "tp2"])
def test_decode_from_transferred_kv_equals_colocated(hf_checkpoint, layout):
    path = hf_checkpoint("qwen3")
    tp, pp = layout
    prompts = {f"r{i}": p for i, p in enumerate(PROMPTS[:5])}
    colocated = _run(_engine(path), {rid: (p, DECODE, None) for rid, p in prompts.items()})
    producer = _engine(path, "kv_producer", tensor_parallel_size=tp, pipeline_parallel_size=pp)
    consumer = _engine(path, "kv_consumer", tensor_parallel_size=tp, pipeline_parallel_size=pp,
                       collect_step_timings=True)
    try:
        prefilled = _run(producer, {rid: (p, PREFILL, {"do_remote_decode": True}) for rid, p in prompts.items()})
        assert producer.core.kv_connector.num_held == len(prompts) and not _idle(producer)  # under lease
        decoded = _run(consumer, {rid: (p, DECODE, prefilled[rid].kv_transfer_params) for rid, p in prompts.items()})
        for rid, _prompt in prompts.items():
            ours, ref = decoded[rid].outputs[0], colocated[rid].outputs[0]
            assert ours.token_ids == ref.token_ids, rid
            for mine, theirs in zip(ours.logprobs, ref.logprobs):
                for token, lp in theirs.items():
                    assert mine[token].logprob == pytest.approx(lp.logprob, abs=1e-4)
            assert decoded[rid].metrics.steps[0].num_tokens == 1  # only the last prompt token was computed
            params = prefilled[rid].kv_transfer_params
            assert not any(staged_path("/dev/shm", params["name"], r).exists() for r in range(tp * pp))  # loaded: gone
        for rid in prompts:
            producer.release_kv(rid)
        assert producer.poll_kv_leases() == len(prompts)
        assert producer.core.kv_connector.num_held == 0 and _idle(producer) and _idle(consumer)
    finally:
        producer.shutdown()
        consumer.shutdown()


def test_lease_expiry_frees_the_blocks_and_the_staged_kv(tiny_model_path):
    producer = LLMEngine(EngineConfig(model=str(tiny_model_path), num_kv_blocks=64, max_model_len=512,
                                      kv_transfer_config={"kv_role": "kv_producer", "lease_s": 0.3}))
    out = _run(producer, {"a": (PROMPTS[3], PREFILL, {"do_remote_decode": True})})["a"]
    name = out.kv_transfer_params["name"]
    assert staged_path("/dev/shm", name, 0).is_file() and not _idle(producer)
    with pytest.raises(ValueError, match="request_id: 'a' is already in flight"):  # it would share the held blocks
        producer.add_request(PROMPTS[2], PREFILL, request_id="a", kv_transfer_params={"do_remote_decode": True})
    time.sleep(0.4)
    producer.poll_kv_leases()
    assert _idle(producer) and not staged_path("/dev/shm", name, 0).exists()


def test_unusable_transfers_are_recomputed(hf_checkpoint, tmp_path):
    """A consumer recomputes the prompt when the staged KV is gone, of another layout (here: another
    dtype), or computed under another LoRA adapter's weights (another digest); it neither reads nor deletes
    a file that is no staged KV; an aborted producer request stages nothing and holds nothing."""
    path = hf_checkpoint("llama")
    prompt = PROMPTS[4]
    reference = _run(_engine(path), {"a": (prompt, DECODE, None)})["a"].outputs[0].token_ids
    producer = _engine(path, "kv_producer")
    staged = _run(producer, {rid: (prompt, PREFILL, {"do_remote_decode": True}) for rid in ("a", "b")})
    params = staged["a"].kv_transfer_params
    assert params["lora_digest"] is None  # the base model's KV
    other_dtype = _engine(path, "kv_consumer", dtype="bfloat16", collect_step_timings=True)
    out = _run(other_dtype, {"a": (prompt, DECODE, params)})["a"]
    assert out.metrics.steps[0].num_tokens > 1  # recomputed
    consumer = _engine(path, "kv_consumer", collect_step_timings=True)
    other_adapter = {**staged["b"].kv_transfer_params, "lora_digest": "0" * 32}
    out = _run(consumer, {"b": (prompt, DECODE, other_adapter)})["b"]
    assert out.outputs[0].token_ids == reference and out.metrics.steps[0].num_tokens > 1
    victim = tmp_path / "victim.rank0.kv"
    victim.write_bytes(b"not ours")
    out = _run(consumer, {"c": (prompt, DECODE, {**params, "name": str(tmp_path / "victim")})})["c"]
    assert out.outputs[0].token_ids == reference and victim.read_bytes() == b"not ours"
    for rid in ("a", "b"):
        producer.release_kv(rid)
    producer.poll_kv_leases()
    out = _run(consumer, {"a": (prompt, DECODE, params)})["a"]  # the staged files went with the release
    assert out.outputs[0].token_ids == reference and out.metrics.steps[0].num_tokens > 1
    producer.add_request(prompt, PREFILL, request_id="d", kv_transfer_params={"do_remote_decode": True})
    producer.abort_request("d")
    assert producer.core.kv_connector.num_held == 0 and _idle(producer) and _idle(consumer)


@pytest.mark.parametrize("make", [lambda tmp: tmp / "missing", lambda tmp: (tmp / "a_file").touch() or tmp / "a_file"],
                         ids=["missing", "not_a_directory"])
def test_unusable_staging_dir_is_refused_at_start(tiny_model_path, tmp_path, make):
    staging = make(tmp_path)
    with pytest.raises(ValueError, match=rf"kv_transfer_config.staging_dir: '{staging}'"):
        LLMEngine(EngineConfig(model=str(tiny_model_path), num_kv_blocks=64, max_model_len=512,
                               kv_transfer_config={"kv_role": "kv_consumer", "staging_dir": str(staging)}))


def test_n_samples_share_the_transferred_prefix(hf_checkpoint):
    path = hf_checkpoint("qwen3")
    prompt = PROMPTS[5]
    sampled = SamplingParams(temperature=0.8, seed=3, n=3, max_tokens=8, ignore_eos=True)
    reference = _run(_engine(path), {"a": (prompt, sampled, None)})["a"]
    producer, consumer = _engine(path, "kv_producer"), _engine(path, "kv_consumer")
    params = _run(producer, {"a": (prompt, PREFILL, {"do_remote_decode": True})})["a"].kv_transfer_params
    out = _run(consumer, {"a": (prompt, sampled, params)})["a"]
    assert [c.token_ids for c in out.outputs] == [c.token_ids for c in reference.outputs]
    assert out.num_cached_tokens == 0  # the consumer's own prefix cache had nothing: the KV came from afar


def test_a_failed_step_loads_the_kv_again_for_each_retried_request(hf_checkpoint):
    """A step whose KV load fails (a decode replica deleted the staged KV of a request whose client left) is
    retried request by request: the others load their KV again and decode the right tokens, the culprit fails."""
    path = hf_checkpoint("qwen3")
    prompts = {"a": PROMPTS[1], "b": PROMPTS[2]}
    colocated = _run(_engine(path), {"a": (prompts["a"], DECODE, None)})["a"].outputs[0].token_ids
    producer, consumer = _engine(path, "kv_producer"), _engine(path, "kv_consumer")
    try:
        staged = _run(producer, {rid: (p, PREFILL, {"do_remote_decode": True}) for rid, p in prompts.items()})
        worker = consumer.core.executor.driver_worker.kv_connector
        load = worker.start_load_kv

        def load_after_b_is_gone(meta, kv_caches):
            staged_path("/dev/shm", staged["b"].kv_transfer_params["name"], 0).unlink(missing_ok=True)
            load(meta, kv_caches)

        worker.start_load_kv = load_after_b_is_gone
        for rid, prompt in prompts.items():
            consumer.add_request(prompt, DECODE, request_id=rid, kv_transfer_params=staged[rid].kv_transfer_params)
        finished = {}
        while consumer.has_unfinished_requests():
            finished.update({out.request_id: out for out in consumer.step() if out.finished})
        assert finished["a"].error is None and finished["a"].outputs[0].token_ids == colocated
        assert finished["b"].error is not None
        assert _idle(consumer)
    finally:
        producer.shutdown()
        consumer.shutdown()
