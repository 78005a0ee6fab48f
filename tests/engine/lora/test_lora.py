"""Multi-LoRA serving offline: adapters written by `peft`, each request's greedy tokens equal Hugging Face's
on the base model merged with its adapter (tests/parity.py, tie-aware), in batches mixing adapters and
the base model, and under a JSON schema; slots evicted and reloaded; the prefix cache keyed by the adapter's
weights; bad adapters refused by name while the engine goes on; tensor and pipeline parallelism (the latter
on an int8 base, with a draft model) equal to one rank. Mixture-of-experts bases (adapters on attention,
shared expert and dense layers; expert weights refused naming the module) and quantized bases (the float
delta on a GPTQ or online-int8 base against the dequantized merge)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from engine import LLM, LoRARequest, SamplingParams, StructuredOutputsParams
from engine.core.block_hash import hash_block_chain
from engine.lora.manager import LoRAManager
from engine.lora.peft import load_peft_adapter
from tests.engine.models.quantized_checkpoints import LINEAR, write_gptq
from tests.engine.models.test_hf_parity import PROMPTS, _random_prompts
from tests.engine.models.test_moe import HF_EXPERTS
from tests.engine.models.test_quantization import LOGPROB_TOL, TIE, _oracle_online
from tests.lora_adapters import write_peft_adapter
from tests.parity import TIE_THRESHOLD, assert_tokens_match, hf_greedy

BASE_NAME = "pagedserve-tiny"
NEW_TOKENS = 12
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# name -> (rank, target modules, extra LoraConfig fields): different ranks and target sets
ADAPTERS = {
    "everything": (8, ALL, {}),
    "attention": (4, ["q_proj", "v_proj"], {"use_rslora": True}),
    "mlp": (16, ["o_proj", "gate_proj", "up_proj", "down_proj"], {"lora_alpha": 8}),
    "sparse": (8, ["k_proj", "down_proj"], {}),
}
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=3)
ENGINE = dict(dtype="float32", enable_lora=True, max_lora_rank=16, num_kv_blocks=256, max_model_len=400)
LONG_PROMPT = _random_prompts(7, [70])[0]  # four full blocks of 16


@pytest.fixture(scope="module")
def lora_setup(hf_checkpoint, tmp_path_factory):
    """(base checkpoint, {name: (adapter folder, merged oracle folder)})."""
    base = hf_checkpoint("llama")
    root = tmp_path_factory.mktemp("loras")
    adapters = {}
    for seed, (name, (r, targets, extra)) in enumerate(ADAPTERS.items()):
        extra = dict(extra)
        alpha = extra.pop("lora_alpha", None)
        folder, merged = root / name, root / f"{name}-merged"
        write_peft_adapter(base, folder, r, targets, seed=seed, alpha=alpha, merged=merged, **extra)
        adapters[name] = (folder, merged)
    return base, adapters


def _request(adapters, name: str, int_id: int | None = None) -> LoRARequest:
    return LoRARequest(name, int_id or list(ADAPTERS).index(name) + 1, str(adapters[name][0]))


def _check_tokens(token_ids: list[int], token_logprobs: list[dict], prompt, oracle, what: str, tol: float = 1e-4,
                  tie: float = TIE_THRESHOLD, **hf_kwargs) -> None:
    """Tokens equal the oracle's (ties below `tie` excepted); their logprobs within `tol`, up to a tie."""
    tokens, logprobs = hf_greedy(str(oracle), prompt, NEW_TOKENS, **hf_kwargs)
    tie_at = assert_tokens_match(token_ids, tokens, logprobs, tie, what=what)
    for i, (token, ours) in enumerate(zip(token_ids[:tie_at], token_logprobs)):
        assert ours[token].logprob == pytest.approx(logprobs[i][token].item(), abs=tol), f"{what}: token {i}"


def _check(out, prompt, oracle, what: str, **kwargs) -> None:
    _check_tokens(out.outputs[0].token_ids, out.outputs[0].logprobs, prompt, oracle, what, **kwargs)


def _check_all(outs, prompts, names, base, adapters, what: str, **kwargs) -> None:
    for prompt, out, name in zip(prompts, outs, names):
        oracle = base if name is None else adapters[name][1]
        _check(out, prompt, oracle, f"{what}: {name or 'base'}, {len(prompt)} tokens", **kwargs)


def test_mixed_batch_matches_merged_models(lora_setup):
    """Three adapters of different ranks and targets and the base model in one batch; structured outputs."""
    base, adapters = lora_setup
    names = ["everything", "attention", "mlp", None] * 2
    llm = LLM(str(base), max_loras=4, **ENGINE)
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False,
                        lora_request=[_request(adapters, n) if n else None for n in names])
    _check_all(outs, PROMPTS, names, base, adapters, "mixed batch")
    # Each adapter changes the output: the comparison above is not the base model's against itself.
    plain = llm.generate(PROMPTS[:3], GREEDY, use_tqdm=False)
    assert all(a.outputs[0].token_ids != b.outputs[0].token_ids for a, b in zip(outs[:3], plain))
    assert llm.llm_engine.get_stats().num_lora_slot_loads == 3
    # A JSON schema under an adapter: the merged model's own constrained tokens.
    schema = {"type": "object", "properties": {"a": {"enum": [1, 22, 333]}}, "required": ["a"]}
    constrained = SamplingParams(temperature=0, max_tokens=40, structured_outputs=StructuredOutputsParams(json=schema))
    ours = llm.generate(PROMPTS[:1], constrained, use_tqdm=False, lora_request=_request(adapters, "everything"))[0]
    merged = LLM(str(adapters["everything"][1]), **{k: v for k, v in ENGINE.items() if "lora" not in k})
    theirs = merged.generate(PROMPTS[:1], constrained, use_tqdm=False)[0]
    assert (json.loads(ours.outputs[0].text)["a"] in (1, 22, 333)
            and ours.outputs[0].token_ids == theirs.outputs[0].token_ids)


def test_eviction_and_reload_in_rotation(lora_setup):
    """Four adapters through two slots: requests wait for a slot rather than fail, slots are evicted and
    refilled, and every request still matches its merged model."""
    base, adapters = lora_setup
    names = [*ADAPTERS, None] * 2
    prompts = _random_prompts(11, [20, 40, 60, 33, 17, 25, 50, 75, 100, 30])
    llm = LLM(str(base), max_loras=2, max_cpu_loras=3, **ENGINE)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False,
                        lora_request=[_request(adapters, n) if n else None for n in names])
    _check_all(outs, prompts, names, base, adapters, "max_loras=2")
    stats = llm.llm_engine.get_stats()
    assert stats.num_lora_slot_loads > len(ADAPTERS)  # at least one adapter was evicted and loaded again
    pool = llm.llm_engine.core.scheduler.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_usable_blocks
    assert llm.llm_engine.core.lora_manager.pins == [0, 0]


def test_prefix_cache_is_keyed_by_adapter_weights(lora_setup, tmp_path):
    base, adapters = lora_setup
    llm = LLM(str(base), max_loras=2, **ENGINE)

    def run(lora: LoRARequest | None):
        return llm.generate([LONG_PROMPT], GREEDY, use_tqdm=False, lora_request=lora)[0]

    first = run(_request(adapters, "everything"))
    assert first.num_cached_tokens == 0
    # Neither the base model nor another adapter reads its blocks.
    assert run(None).num_cached_tokens == 0
    assert run(_request(adapters, "attention")).num_cached_tokens == 0
    # The same adapter again, or under another name and id (same weights): cache hits.
    assert run(_request(adapters, "everything")).num_cached_tokens == 64
    alias = run(LoRARequest("alias", 42, str(adapters["everything"][0])))
    assert alias.num_cached_tokens == 64 and alias.outputs[0].token_ids == first.outputs[0].token_ids

    # New weights at the same path, under a new id, and under the old id after remove_lora: no stale hits.
    folder = tmp_path / "reloaded"
    shutil.copytree(adapters["everything"][0], folder)
    v1 = run(LoRARequest("reloaded", 7, str(folder)))
    assert v1.num_cached_tokens == 64  # same weights as "everything" so far
    shutil.rmtree(folder)
    write_peft_adapter(base, folder, 8, ALL, seed=99, merged=tmp_path / "reloaded-merged")
    v2 = run(LoRARequest("reloaded", 8, str(folder)))
    assert v2.num_cached_tokens == 0
    _check(v2, LONG_PROMPT, tmp_path / "reloaded-merged", "reloaded adapter")
    assert llm.llm_engine.remove_lora(8) and 8 not in llm.llm_engine.list_loras()
    again = run(LoRARequest("reloaded", 8, str(folder)))
    assert again.num_cached_tokens == 64 and again.outputs[0].token_ids == v2.outputs[0].token_ids


def test_bad_adapters_are_refused_by_field_and_the_engine_goes_on(lora_setup, hf_checkpoint, tmp_path):
    base, adapters = lora_setup
    llm = LLM(str(base), max_loras=1, **ENGINE)
    good = adapters["everything"][0]

    def patched(name: str, **config) -> str:
        folder = tmp_path / name
        shutil.copytree(good, folder)
        data = json.loads((folder / "adapter_config.json").read_text())
        (folder / "adapter_config.json").write_text(json.dumps({**data, **config}))
        return str(folder)

    corrupt = tmp_path / "corrupt"
    shutil.copytree(good, corrupt)
    weights = corrupt / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    other_model = write_peft_adapter(hf_checkpoint("qwen3"), tmp_path / "qwen3-adapter", 8, ["q_proj"], seed=1)
    cases = {
        patched("dora", use_dora=True): "use_dora",
        patched("saved", modules_to_save=["lm_head"]): "modules_to_save",
        patched("big", r=32): "max_lora_rank=16",
        patched("pattern", rank_pattern={"q_proj": 4}): "rank_pattern",
        patched("unknown", target_modules=["q_proj", "wq"]): "target_modules",
        patched("rank", r=4): "do not fit the base model",
        str(other_model): "do not fit the base model",
        str(corrupt): "not a readable safetensors",
        str(tmp_path / "missing"): "not an adapter folder",
    }
    for i, (path, message) in enumerate(cases.items(), start=1):
        with pytest.raises(ValueError, match=message):
            llm.generate([LONG_PROMPT], GREEDY, use_tqdm=False, lora_request=LoRARequest(f"bad{i}", 100 + i, path))
    with pytest.raises(ValueError, match="lora_request: this engine was started without enable_lora"):
        LLM(str(base), dtype="float32", num_kv_blocks=64, max_model_len=256).generate(
            [[1, 2]], lora_request=_request(adapters, "mlp"))
    out = llm.generate([LONG_PROMPT], GREEDY, use_tqdm=False, lora_request=_request(adapters, "mlp"))[0]
    _check(out, LONG_PROMPT, adapters["mlp"][1], "after refusals")


# layout -> (tensor_parallel_size, pipeline_parallel_size, what both engines run, what the parallel one adds)
LAYOUTS = {
    "tp2": (2, 1, {}, {}),
    # Pipeline stages on an int8 base, with a draft model (the base itself: it drafts without the adapter).
    "pp2_int8_draft": (1, 2, {"quantization": "int8"}, {"speculative_config": {"method": "draft_model",
                                                                                "num_speculative_tokens": 3}}),
}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_parallel_layouts_equal_one_rank(layout, lora_setup):
    """TP=2 (gloo worker processes): each rank loads its shard of every adapter (column layers their rows of B,
    row layers their columns of A); PP=2: each stage its layers' part. Tokens equal one rank's and logprobs are
    within 1e-4."""
    base, adapters = lora_setup
    tp, pp, both, parallel = LAYOUTS[layout]
    if "speculative_config" in parallel:
        parallel = {"speculative_config": {**parallel["speculative_config"], "model": str(base)}}
    names = ["everything", "attention", None, "mlp"]
    loras = [_request(adapters, n) if n else None for n in names]
    prompts = PROMPTS[:4]
    one = LLM(str(base), max_loras=2, **ENGINE, **both).generate(prompts, GREEDY, use_tqdm=False, lora_request=loras)
    llm = LLM(str(base), max_loras=2, tensor_parallel_size=tp, pipeline_parallel_size=pp, **ENGINE, **both, **parallel)
    try:
        outs = llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=loras)
        if parallel:  # drafts were verified, some rejected: the adapters' tokens are not the draft's
            stats = llm.llm_engine.get_stats()
            assert 0 < stats.spec_decode_num_accepted_tokens < stats.spec_decode_num_draft_tokens
    finally:
        llm.shutdown()
    for ref, out in zip(one, outs):
        assert out.outputs[0].token_ids == ref.outputs[0].token_ids
        for ours, theirs in zip(out.outputs[0].logprobs, ref.outputs[0].logprobs):
            for token, lp in theirs.items():
                assert ours[token].logprob == pytest.approx(lp.logprob, abs=1e-4)


# --- mixture-of-experts and quantized bases -------------------------------------------------------------------

# arch -> ((tensor_parallel_size, pipeline_parallel_size), target_modules). Qwen2-MoE's MLP projections are
# named by their parents: PEFT >= 0.22 reads a bare `gate_proj` as transformers 4 did, the experts included.
_QWEN2_MOE_MLPS = [f"{parent}.{proj}" for parent in ("shared_expert", "mlp") for proj in ALL[4:]]
MOE_ADAPTERS = {"mixtral": ((1, 2), ALL[:4]), "qwen2_moe": ((2, 1), ALL[:4] + _QWEN2_MOE_MLPS)}


@pytest.mark.parametrize("arch", MOE_ADAPTERS)
def test_moe_adapters_match_merged_models(arch, hf_checkpoint, tmp_path):
    """Adapters on a mixture-of-experts base: attention everywhere (Mixtral in two pipeline stages), and on
    Qwen2-MoE the shared expert (its down projection's partial sums left to the sparse block's all-reduce
    under TP=2) and the dense layer."""
    from engine.models.config import ModelConfig

    (tp, pp), targets = MOE_ADAPTERS[arch]
    base = hf_checkpoint(arch)
    folder = write_peft_adapter(base, tmp_path / "adapter", 8, targets, seed=3, merged=tmp_path / "merged")
    if arch == "qwen2_moe":
        adapter = load_peft_adapter("moe", 1, folder, ModelConfig.from_pretrained(base), 16)
        assert {(0, "shared_expert.gate_proj"), (0, "shared_expert.down_proj"), (1, "gate_proj"), (1, "down_proj"),
                (1, "q_proj")} <= set(adapter.weights)
    names, prompts = ["moe", None, "moe", None], [PROMPTS[0], PROMPTS[0], PROMPTS[1], PROMPTS[1]]
    llm = LLM(str(base), max_loras=1, tensor_parallel_size=tp, pipeline_parallel_size=pp, num_threads=1, **ENGINE)
    try:
        lora = LoRARequest("moe", 1, str(folder))
        outs = llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=[lora if n else None for n in names])
    finally:
        llm.shutdown()
    _check_all(outs, prompts, names, base, {"moe": (folder, tmp_path / "merged")}, arch, **HF_EXPERTS)
    assert outs[0].outputs[0].token_ids != outs[1].outputs[0].token_ids  # the adapter changes the output


def test_adapters_on_expert_weights_are_refused_naming_the_module(hf_checkpoint, tmp_path):
    """PEFT's `target_parameters` (transformers' fused experts), expert tensors of any exporter, and
    projections a sparse layer does not have: refused when the adapter loads, naming what they target."""
    from safetensors.torch import load_file, save_file

    from engine.models.config import ModelConfig

    qwen2 = hf_checkpoint("qwen2_moe")
    experts = write_peft_adapter(qwen2, tmp_path / "experts", 4, ["q_proj"], seed=1,
                                 target_parameters=["mlp.experts.gate_up_proj"])

    def edited(name: str, rename: dict[str, str], drop: str = "", **config) -> Path:
        """A copy of `experts` without target_parameters, its tensor names edited: old -> new, `drop` dropped."""
        folder = tmp_path / name
        shutil.copytree(experts, folder)
        data = json.loads((folder / "adapter_config.json").read_text())
        del data["target_parameters"]
        (folder / "adapter_config.json").write_text(json.dumps({**data, **config}))
        tensors = {}
        for key, value in load_file(folder / "adapter_model.safetensors").items():
            for old, new in rename.items():
                key = key.replace(old, new)
            if not drop or drop not in key:
                tensors[key] = value
        save_file(tensors, folder / "adapter_model.safetensors")
        return folder

    old_style = "layers.0.block_sparse_moe.experts.3.w1"  # Mixtral's expert modules before transformers 5
    mixtral = hf_checkpoint("mixtral")
    cases = [
        (qwen2, experts, r"`target_parameters` \(\['mlp.experts.gate_up_proj'\]\) is not supported"),
        (qwen2, edited("fused-pattern", {}, target_parameters=["mlp.experts.gate_up_proj"],
                       rank_pattern={r".*\.gate_up_proj": 8}, alpha_pattern={r".*\.gate_up_proj": 16}),
         r"`target_parameters` \(\['mlp.experts.gate_up_proj'\]\) is not supported"),  # as PEFT >= 0.22 writes it
        (qwen2, edited("fused", {}), r"targets the experts of a mixture-of-experts layer \(layers.0.mlp.experts\)"),
        (qwen2, edited("router", {"layers.0.self_attn.q_proj": "layers.0.mlp.gate"}, drop="experts"),
         r"targets layers.0.mlp.gate, which adapters may not target"),
        (mixtral, edited("w1", {"layers.0.mlp.experts": old_style}, target_modules=["q_proj", "w1"]),
         r"`target_modules` names \['w1'\]"),
        (mixtral, edited("old-keys", {"layers.0.mlp.experts": old_style}),
         (rf"\({old_style}\); adapters on expert weights are not supported: layer 0 of MixtralForCausalLM may be "
          r"targeted at \['k_proj', 'o_proj', 'q_proj', 'v_proj'\]")),
    ]
    for base, folder, message in cases:
        with pytest.raises(ValueError, match=r"lora_path: adapter 'x': .*" + message):
            load_peft_adapter("x", 1, folder, ModelConfig.from_pretrained(base), 16)


# case -> (arch, how its quantized base and dequantized dense oracle are made, adapter targets)
QUANTIZED_BASES = {
    # act-order GPTQ: the base permutes its input columns, the adapter's A reads them in checkpoint order
    "gptq4_actorder": ("qwen2", "gptq", ALL),
    "online_int8_moe": ("qwen3_moe", "int8", ["q_proj", "k_proj", "v_proj", "o_proj"]),
    # W8A8: the base layers take int8 activations, the adapter's delta the float ones (as vLLM's LoRA on a W8A8
    # base); the oracle is PEFT's unmerged model on the dequantized base, its base layers' inputs rounded.
    "online_w8a8": ("llama", "w8a8", ALL),
}


@pytest.mark.parametrize("case", QUANTIZED_BASES)
def test_adapters_on_quantized_bases_match_the_dequantized_merge(case, hf_checkpoint, tmp_path):
    """QLoRA-style serving: the base layers run their quantized kernels, the adapter's delta is computed in
    float and added to their output; the oracle is the dequantized base merged with the adapter (the
    quantization tests' tolerance: the kernels sum in another order)."""
    arch, scheme, targets = QUANTIZED_BASES[case]
    dense = hf_checkpoint(arch)
    if scheme == "gptq":
        model, oracle = write_gptq(dense, tmp_path / "gptq", bits=4, group_size=32, sym=False, desc_act=True, v1=False)
        quantization = None
    else:
        model, oracle, quantization = dense, _oracle_online(dense, tmp_path / "oracle", scheme), scheme
    folder = write_peft_adapter(oracle, tmp_path / "adapter", 8, targets, seed=4, merged=tmp_path / "merged")
    llm = LLM(str(model), max_loras=1, quantization=quantization, **ENGINE)
    slots = llm.llm_engine.core.executor.driver_worker.lora
    assert {getattr(w.base_layer, "compute", None) for w in slots.layers} == {"int4" if scheme == "gptq" else scheme}
    assert {w.a_stack.dtype for w in slots.layers} == {torch.float32}
    names = ["q", None, "q"]
    outs = llm.generate(PROMPTS[:3], GREEDY, use_tqdm=False,
                        lora_request=[LoRARequest("q", 1, str(folder)) if n else None for n in names])
    if scheme == "w8a8":
        _check_w8a8_adapter(outs, names, oracle, folder)
        return
    _check_all(outs, PROMPTS[:3], names, oracle, {"q": (folder, tmp_path / "merged")}, case, tol=LOGPROB_TOL, tie=TIE,
               **(HF_EXPERTS if arch.endswith("moe") else {}))


def _check_w8a8_adapter(outs, names, base, folder) -> None:
    from peft import PeftModel

    from tests.parity import greedy, hf_model, quantize_base_layer_inputs

    for prompt, out, name in zip(PROMPTS, outs, names):
        if name is None:
            tokens, logprobs = hf_greedy(str(base), prompt, NEW_TOKENS, quantize_inputs_of=LINEAR)
        else:
            model = PeftModel.from_pretrained(hf_model(str(base)), str(folder)).eval()
            hooks = quantize_base_layer_inputs(model)
            tokens, logprobs = greedy(model, tuple(prompt), NEW_TOKENS)
            for hook in hooks:
                hook.remove()
            model.unload()  # the cached base model back as it was
        tie = assert_tokens_match(out.outputs[0].token_ids, tokens, logprobs, TIE, f"w8a8 {name}")
        for i, (token, ours) in enumerate(zip(out.outputs[0].token_ids[:tie], out.outputs[0].logprobs)):
            assert ours[token].logprob == pytest.approx(logprobs[i][token].item(), abs=LOGPROB_TOL), (name, i)


def test_async_llm_takes_lora_requests(lora_setup, tmp_path):
    """AsyncLLM.generate(lora_request=...): concurrent streams of an adapter and the base model; a bad adapter
    fails its own request (ValueError) and the engine goes on."""
    import asyncio

    from engine import AsyncLLM, EngineConfig

    base, adapters = lora_setup
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "adapter_config.json").write_text(
        '{"r": 4, "lora_alpha": 8, "target_modules": ["q_proj"], "use_dora": true}')

    async def collect(llm, prompt, lora):
        tokens, logprobs = [], []
        async for out in llm.generate(prompt, GREEDY, lora_request=lora):
            tokens += out.outputs[0].token_ids
            logprobs += out.outputs[0].logprobs
        return tokens, logprobs

    async def main():
        llm = AsyncLLM(EngineConfig(model=str(base), max_loras=2, **ENGINE))
        try:
            results = await asyncio.gather(*(collect(llm, p, lora) for p, lora in
                                             zip(PROMPTS[:2], [_request(adapters, "attention"), None])))
            with pytest.raises(ValueError, match="use_dora"):
                await collect(llm, PROMPTS[0], LoRARequest("bad", 99, str(bad)))
            results.append(await collect(llm, PROMPTS[2], _request(adapters, "sparse")))
            return results
        finally:
            llm.shutdown()

    oracles = [adapters["attention"][1], base, adapters["sparse"][1]]
    for (tokens, logprobs), prompt, oracle in zip(asyncio.run(main()), PROMPTS[:3], oracles):
        _check_tokens(tokens, logprobs, prompt, oracle, "AsyncLLM")


def test_slot_manager_pins_evicts_lru_and_drains():
    from engine.lora.peft import LoRAAdapter

    loads = []
    manager = LoRAManager(None, max_loras=2, max_cpu_loras=2, max_lora_rank=8,
                          load_slot=lambda s, a: loads.append((s, a.name)))
    a, b, c = (LoRAAdapter(n, i, f"/{n}", 8, 1.0, n * 4, {}) for i, n in enumerate("abc", start=1))
    alias = LoRAAdapter("a2", 9, "/a2", 8, 1.0, a.digest, {})  # same weights, another name
    assert manager.acquire(a) == 0 and manager.acquire(b) == 1 and manager.acquire(alias) == 0
    assert manager.acquire(c) is None  # both slots pinned: c waits
    assert manager.draining_slot() == 1  # b's slot has fewer pins
    assert manager.acquire(b, draining_slot=1) is None  # no new pins on the slot being drained
    manager.release(1)
    assert manager.acquire(c) == 1 and loads == [(0, "a"), (1, "b"), (1, "c")]
    manager.release(0), manager.release(0), manager.release(1)
    assert manager.acquire(b) == 0  # slot 0 is the least recently used


def test_block_hashes_carry_the_adapter_digest():
    tokens = list(range(40))
    plain = hash_block_chain(tokens, 16)
    lora = hash_block_chain(tokens, 16, lora_digest="d1")
    assert len({plain[0], lora[0], hash_block_chain(tokens, 16, lora_digest="d2")[0]}) == 3
    assert len(set(plain) | set(lora)) == 4  # every block differs, through the chain
    salted = hash_block_chain(tokens, 16, cache_salt="s", lora_digest="d1")
    assert salted[0] not in (lora[0], hash_block_chain(tokens, 16, cache_salt="s")[0])
    assert hash_block_chain(tokens, 16, lora_digest="d1", parent_hashes=lora[:1]) == lora


def test_lora_settings_are_checked_naming_the_field():
    from engine import EngineConfig

    with pytest.raises(ValueError, match="max_cpu_loras: 1 is below max_loras=2"):
        EngineConfig(model=BASE_NAME, enable_lora=True, max_loras=2, max_cpu_loras=1)
    with pytest.raises(ValueError, match="lora_request.lora_int_id: must be an int > 0"):
        LoRARequest("a", 0, "/a")
    with pytest.raises(ValueError, match="lora_request.lora_path"):
        LoRARequest("a", 1, "")
