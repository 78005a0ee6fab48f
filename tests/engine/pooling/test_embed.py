"""Embedding models offline (EngineConfig.task 'embed', engine/pooling): vectors equal to Hugging Face's (the base
model's last hidden state, pooled and normalized as the checkpoint's sentence-transformers files say) within 1e-5,
for last-token, mean and CLS pooling, whole or chunked, batched or alone (and sums that restart on preemption);
the prefix cache serves last-token pooling only; no KV is held once a prompt is pooled; bad requests and configs
are refused by name."""

from __future__ import annotations

import shutil
from functools import cache
from pathlib import Path

import numpy as np
import pytest
import torch

from engine import LLM, PoolingParams, SamplingParams
from engine.models.builtin import materialize_builtin, write_sentence_transformers
from engine.pooling import PoolerConfig
from engine.pooling.pooler import Pooler, segment_sums

EMBED = "pagedserve-tiny-embed"
PROMPTS = ["Hello world", "A longer prompt that spans a few blocks of sixteen tokens, " * 3, [5, 6, 7, 8, 9],
           "Short one"]


@cache
def _hf_base(path: str):
    from transformers import AutoModel

    return AutoModel.from_pretrained(path, dtype=torch.float32).eval()


@torch.inference_mode()
def hf_embedding(path: Path, token_ids: list[int], pooling: str, normalize: bool = True) -> np.ndarray:
    hidden = _hf_base(str(path))(torch.tensor([token_ids])).last_hidden_state[0]
    vector = {"last": hidden[-1], "mean": hidden.mean(0), "cls": hidden[0]}[pooling]
    return (torch.nn.functional.normalize(vector, dim=-1) if normalize else vector).numpy()


def _assert_oracle(path: Path, outputs, pooling: str, normalize: bool = True) -> None:
    for out in outputs:
        ours = out.outputs.data
        assert ours.dtype == np.float32
        np.testing.assert_allclose(ours, hf_embedding(path, out.prompt_token_ids, pooling, normalize), atol=1e-5)


@pytest.fixture(scope="module")
def embed_path() -> Path:
    return materialize_builtin(EMBED)


@pytest.fixture(scope="module")
def base_checkpoint(tmp_path_factory, embed_path) -> Path:
    """A Qwen3 base model saved by transformers itself (no LM head, unprefixed names), without pooling files."""
    from transformers import AutoModel, Qwen3Config

    path = tmp_path_factory.mktemp("qwen3-base")
    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=32000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024)
    AutoModel.from_config(config).save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model"):
        shutil.copyfile(embed_path / name, path / name)
    return path


def _with_pooling(src: Path, dst: Path, mode: str, normalize: bool) -> Path:
    shutil.copytree(src, dst)
    write_sentence_transformers(dst, mode, 64, normalize)
    return dst


def test_builtin_last_token_equals_hugging_face_whole_chunked_and_one_at_a_time(embed_path):
    whole = LLM(EMBED, task="embed", max_model_len=512, num_kv_blocks=64)
    batched = whole.embed(PROMPTS, use_tqdm=False)
    _assert_oracle(embed_path, batched, "last")
    alone = [whole.embed(p, use_tqdm=False)[0] for p in PROMPTS]
    for a, b in zip(alone, batched):
        np.testing.assert_allclose(a.outputs.data, b.outputs.data, atol=1e-6)
    # Embedding the same prompt again starts from the prefix cache: last-token pooling reads only the end.
    again = whole.embed(PROMPTS[1], use_tqdm=False)[0]
    assert again.num_cached_tokens > 0
    np.testing.assert_allclose(again.outputs.data, batched[1].outputs.data, atol=1e-5)
    stats = whole.llm_engine.get_stats()
    assert stats.kv_cache_usage == 0 and stats.num_running == 0  # nothing held once pooled
    chunked = LLM(EMBED, task="embed", max_model_len=512, num_kv_blocks=64, max_num_batched_tokens=16)
    _assert_oracle(embed_path, chunked.embed(PROMPTS, use_tqdm=False), "last")


@pytest.mark.parametrize("mode, pooling, normalize", [("pooling_mode_mean_tokens", "mean", False),
                                                      ("pooling_mode_cls_token", "cls", True)])
def test_checkpoint_pooling_files_mean_and_cls(tmp_path, base_checkpoint, mode, pooling, normalize):
    path = _with_pooling(base_checkpoint, tmp_path / pooling, mode, normalize)
    # Chunks of 16 tokens: the mean adds up over steps, CLS is read from the first.
    llm = LLM(str(path), task="embed", max_model_len=512, num_kv_blocks=64, max_num_batched_tokens=16)
    outputs = llm.embed(PROMPTS, use_tqdm=False)
    _assert_oracle(path, outputs, pooling, normalize)
    again = llm.embed(PROMPTS[1], use_tqdm=False)[0]
    assert again.num_cached_tokens == 0  # every position is read: no prefix-cache hit may skip them
    np.testing.assert_allclose(again.outputs.data, outputs[1].outputs.data, atol=1e-5)


def test_pooler_sums_restart_from_position_zero():
    """A preempted request recomputes its prompt from position 0 (mean and CLS never read the prefix cache): its
    running sum starts again there instead of counting the first chunks twice."""
    pooler = Pooler(PoolerConfig(pooling_type="mean", normalize=False))
    hidden = torch.arange(12, dtype=torch.float32).reshape(6, 2)
    assert pooler.rows(0, 4, 6) == (0, 4) and pooler.rows(4, 2, 6) == (0, 2)
    first, rest = segment_sums(hidden, np.array([[0, 4]])), segment_sums(hidden, np.array([[4, 2]]))
    running = pooler.accumulate(None, 0, first[0])
    running = pooler.accumulate(running, 0, first[0])  # recomputed after a preemption
    running = pooler.accumulate(running, 4, rest[0])
    np.testing.assert_allclose(pooler.finish(running, 6, PoolingParams()), hidden.mean(0).numpy())
    last = Pooler(PoolerConfig(pooling_type="last", normalize=True))
    assert last.rows(0, 4, 6) is None and last.rows(4, 2, 6) == (1, 1)
    cls = Pooler(PoolerConfig(pooling_type="cls", normalize=True))
    assert cls.rows(0, 4, 6) == (0, 1) and cls.rows(4, 2, 6) is None


def test_causal_lm_checkpoint_embeds_without_its_head_and_pooler_config_overrides(base_checkpoint):
    tiny = materialize_builtin("pagedserve-tiny")
    llm = LLM("pagedserve-tiny", task="embed", max_model_len=256, num_kv_blocks=32)  # no pooling files: last
    _assert_oracle(tiny, llm.embed(PROMPTS, use_tqdm=False), "last")
    assert llm.llm_engine.core.executor.driver_worker.model.lm_head is None
    mean = LLM(str(base_checkpoint), task="embed", max_model_len=256, num_kv_blocks=32,
               pooler_config={"pooling_type": "mean", "normalize": False})
    _assert_oracle(base_checkpoint, mean.embed(PROMPTS, use_tqdm=False), "mean", normalize=False)


def test_dimensions_and_normalize_per_request(embed_path):
    llm = LLM(EMBED, task="embed", max_model_len=256, num_kv_blocks=32)
    full = llm.embed("Matryoshka", PoolingParams(normalize=False), use_tqdm=False)[0].outputs.data
    cut = llm.embed("Matryoshka", PoolingParams(dimensions=16), use_tqdm=False)[0].outputs.data
    np.testing.assert_allclose(cut, full[:16] / np.linalg.norm(full[:16]), atol=1e-6)
    with pytest.raises(ValueError, match="dimensions: 65 is not a size this model embeds in; use 1 to 64"):
        llm.embed("x", PoolingParams(dimensions=65), use_tqdm=False)
    with pytest.raises(ValueError, match="dimensions"):
        PoolingParams(dimensions=0)


def test_wrong_task_requests_and_configs_are_refused_by_name(base_checkpoint):
    embedder = LLM(EMBED, task="embed", max_model_len=256, num_kv_blocks=32)
    with pytest.raises(ValueError, match="sampling_params: pagedserve-tiny-embed is served with task='embed'"):
        embedder.generate("x", SamplingParams(max_tokens=2), use_tqdm=False)
    # A prompt may fill the whole context: nothing is generated after it.
    assert len(embedder.embed([7] * 256, use_tqdm=False)[0].prompt_token_ids) == 256
    with pytest.raises(ValueError, match="prompt: 257 tokens exceed max_model_len=256"):
        embedder.embed([7] * 257, use_tqdm=False)
    with pytest.raises(ValueError, match="dimensions: this model was not trained for shorter embeddings"):
        LLM(str(base_checkpoint), task="embed", max_model_len=256, num_kv_blocks=32).embed(
            "x", PoolingParams(dimensions=8), use_tqdm=False)
    with pytest.raises(ValueError, match="task: Qwen3Model is a base model without an LM head"):
        LLM(EMBED, max_model_len=256, num_kv_blocks=32)
    with pytest.raises(ValueError, match="speculative_config: not supported with task='embed'"):
        LLM(EMBED, task="embed", speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="pooler_config: set only with task='embed'"):
        LLM("pagedserve-tiny", pooler_config={"pooling_type": "mean"})
    generator = LLM("pagedserve-tiny", max_model_len=256, num_kv_blocks=32)
    with pytest.raises(ValueError, match="pooling_params: pagedserve-tiny is served with task='generate'"):
        generator.embed("x", use_tqdm=False)


def test_unsupported_sentence_transformers_modules_are_refused(tmp_path, base_checkpoint):
    path = _with_pooling(base_checkpoint, tmp_path / "max", "pooling_mode_max_tokens", True)
    with pytest.raises(ValueError, match="pooling_mode_max_tokens"):
        LLM(str(path), task="embed", max_model_len=256, num_kv_blocks=32)


def test_tensor_parallel_quantized_and_moe_embedders(embed_path, hf_checkpoint):
    """The pairs README's "Embeddings" supports: two tensor-parallel ranks give TP=1's vectors; a Qwen3-MoE
    causal LM embeds as its Hugging Face base model does; int8 at load stays close to float32."""
    one = LLM(EMBED, task="embed", max_model_len=256, num_kv_blocks=32).embed(PROMPTS, use_tqdm=False)
    two = LLM(EMBED, task="embed", max_model_len=256, num_kv_blocks=32, tensor_parallel_size=2)
    for a, b in zip(one, two.embed(PROMPTS, use_tqdm=False)):
        np.testing.assert_allclose(a.outputs.data, b.outputs.data, atol=1e-5)
    moe = hf_checkpoint("qwen3_moe")
    dense = LLM(str(moe), task="embed", dtype="float32", max_model_len=256, num_kv_blocks=32)
    full = dense.embed(PROMPTS, use_tqdm=False)
    _assert_oracle(moe, full, "last")
    int8 = LLM(str(moe), task="embed", dtype="float32", max_model_len=256, num_kv_blocks=32, quantization="int8")
    for a, b in zip(full, int8.embed(PROMPTS, use_tqdm=False)):
        assert float(np.dot(a.outputs.data, b.outputs.data)) > 0.99  # unit vectors: cosine similarity
