"""Checkpoint loading: sharded safetensors, dummy weights, dtypes, missing weights."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine import LLM, SamplingParams
from tests.conftest import write_hf_checkpoint

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
PROMPT = [[1, 415, 2936, 9060, 285, 1142]]


def _tokens(path, **kw):
    return LLM(str(path), **kw).generate(PROMPT, GREEDY, use_tqdm=False)[0].outputs[0].token_ids


def test_sharded_checkpoint_loads_like_a_single_file(hf_checkpoint, tmp_path):
    sharded = write_hf_checkpoint("qwen2", tmp_path / "sharded", max_shard_size="2MB")
    assert (sharded / "model.safetensors.index.json").is_file()
    assert len(list(sharded.glob("*.safetensors"))) > 1
    assert _tokens(sharded) == _tokens(hf_checkpoint("qwen2"))


def test_dummy_weights_need_no_safetensors(hf_checkpoint, tmp_path):
    folder = tmp_path / "config-only"
    folder.mkdir()
    for f in hf_checkpoint("mistral").iterdir():
        if f.suffix != ".safetensors":
            (folder / f.name).write_bytes(f.read_bytes())
    with pytest.raises(ValueError, match="load_format='dummy'"):
        LLM(str(folder))
    a, b = _tokens(folder, load_format="dummy", seed=1), _tokens(folder, load_format="dummy", seed=1)
    assert a == b and len(a) == 16
    assert _tokens(folder, load_format="dummy", seed=2) != a

    def embedding(seed):
        return (LLM(str(folder), load_format="dummy", seed=seed)
                .llm_engine.core.executor.driver_worker.model.model.embed_tokens.weight)

    assert not torch.equal(embedding(1), embedding(2))


def test_missing_weight_is_named(hf_checkpoint, tmp_path):
    folder = tmp_path / "broken"
    folder.mkdir()
    src = hf_checkpoint("mistral")
    for f in src.iterdir():
        (folder / f.name).write_bytes(f.read_bytes())
    tensors = load_file(str(folder / "model.safetensors"))
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"model.layers.1.self_attn.qkv_proj.weight\[1\]"):
        LLM(str(folder))


def test_bfloat16_checkpoint_runs_in_bfloat16_by_default(hf_checkpoint, tmp_path):
    folder = tmp_path / "bf16"
    folder.mkdir()
    src = hf_checkpoint("qwen3")
    for f in src.iterdir():
        (folder / f.name).write_bytes(f.read_bytes())
    tensors = {k: v.to(torch.bfloat16) for k, v in load_file(str(folder / "model.safetensors")).items()}
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "dtype": "bfloat16"}))
    llm = LLM(str(folder))
    assert llm.llm_engine.core.executor.driver_worker.spec.dtype is torch.bfloat16
    assert next(llm.llm_engine.core.executor.driver_worker.model.parameters()).dtype is torch.bfloat16
    assert len(llm.generate(PROMPT, GREEDY, use_tqdm=False)[0].outputs[0].token_ids) == 16
    assert LLM(str(folder), dtype="float32").llm_engine.core.executor.driver_worker.spec.dtype is torch.float32
