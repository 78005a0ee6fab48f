"""DeepSeek-V3's multi-token prediction layer as the speculative proposer (speculative_config method "mtp").
Hugging Face has no MTP layer, so the tests write one into a DeepSeek-V3 checkpoint by the format's
definition (model.layers.{num_hidden_layers}: enorm, hnorm, eh_proj, a decoder layer, shared_head) and check:
the first draft is what that definition predicts, computed with HF's own decoder layer on HF's hidden
states; drafts line up with the target's positions (a layer built to say what the target will say is always
accepted); greedy output equals decoding without it in every scheduling mode, and what MTP cannot run with is
refused by name."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine import LLM, SamplingParams

LAYERS = 3  # the test config's decoder layers; the MTP layer is the next index
MTP = f"model.layers.{LAYERS}."
PROMPTS = [[1] + list(range(200, 230)), [1, 523, 9812, 311, 4411, 77, 92] * 4, [1] + list(range(900, 1020))]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def _write(src: Path, dst: Path, weights: dict[str, torch.Tensor]) -> Path:
    dst.mkdir()
    for f in src.iterdir():
        if f.name != "model.safetensors":
            shutil.copy(f, dst / f.name)
    config = json.loads((src / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps(config | {"num_nextn_predict_layers": 1}))
    tensors = {k: v.contiguous() for k, v in weights.items()}
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


@pytest.fixture(scope="module")
def checkpoints(hf_checkpoint, tmp_path_factory) -> dict[str, Path]:
    """"random": an MTP layer with its own embedding and head (DeepSeek stores copies there), the decoder
    layer copied from the last one, the rest random. "aligned": every attention and feed-forward output
    zeroed, in the decoder and the MTP layer alike, so the target says f(token) (its head on the token's
    normed embedding) and the MTP layer, given token p + 1, says f(token p + 1) too: exactly what the target
    will say after it. This one stores no embedding and head under the layer: the main model's serve."""
    src = hf_checkpoint("deepseek_v3")
    weights = load_file(str(src / "model.safetensors"))
    vocab, h = weights["model.embed_tokens.weight"].shape
    gen = torch.Generator().manual_seed(7)
    last = f"model.layers.{LAYERS - 1}."
    layer = {MTP + k.removeprefix(last): v.clone() for k, v in weights.items() if k.startswith(last)}
    random_mtp = layer | {
        MTP + "enorm.weight": 1 + 0.1 * torch.randn(h, generator=gen),
        MTP + "hnorm.weight": 1 + 0.1 * torch.randn(h, generator=gen),
        MTP + "eh_proj.weight": 0.1 * torch.randn(h, 2 * h, generator=gen),
        MTP + "embed_tokens.weight": 0.05 * torch.randn(vocab, h, generator=gen),
        MTP + "shared_head.norm.weight": 1 + 0.1 * torch.randn(h, generator=gen),
        MTP + "shared_head.head.weight": 0.05 * torch.randn(vocab, h, generator=gen),
    }
    aligned = {k: torch.zeros_like(v) if k.endswith(("o_proj.weight", "down_proj.weight")) else v
               for k, v in (weights | layer).items()}
    aligned |= {MTP + "enorm.weight": torch.ones(h), MTP + "hnorm.weight": torch.ones(h),
                MTP + "eh_proj.weight": torch.cat([torch.eye(h), torch.zeros(h, h)], dim=1),
                MTP + "shared_head.norm.weight": weights["model.norm.weight"].clone()}
    root = tmp_path_factory.mktemp("mtp")
    return {"random": _write(src, root / "random", weights | random_mtp),
            "aligned": _write(src, root / "aligned", aligned)}


def _llm(path: Path, k: int | None = 3, **engine) -> LLM:
    spec = {"speculative_config": {"method": "mtp", "num_speculative_tokens": k}} if k else {}
    return LLM(str(path), **({"dtype": "float32", "max_model_len": 512, "num_kv_blocks": 128} | engine), **spec)


def _tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def _reference_drafts(path: Path, tokens: list[int], k: int) -> list[torch.Tensor]:
    """The MTP layer's logits for k chained drafts, by the format's definition: at each prompt position p,
    h_p from Hugging Face's model with token p + 1's embedding, enorm / hnorm, eh_proj over their
    concatenation, HF's own DeepSeek-V3 decoder layer (causal, positions 0..p), shared_head; each further
    draft at the next position from the layer's own last output and the draft before it. The decoder layer's
    tensors are the last decoder layer's (the fixture copied them), so HF's loaded layer stands in for it."""
    from transformers import AutoModelForCausalLM
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RMSNorm

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    weights = load_file(str(path / "model.safetensors"))
    mtp = {k[len(MTP):]: v for k, v in weights.items() if k.startswith(MTP)}
    norms = {}
    for name in ("enorm", "hnorm", "shared_head.norm"):
        norms[name] = DeepseekV3RMSNorm(hf.config.hidden_size, hf.config.rms_norm_eps)
        norms[name].weight.data.copy_(mtp[f"{name}.weight"])

    def layer_input(next_tokens: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        e = torch.nn.functional.embedding(next_tokens, mtp["embed_tokens.weight"])
        return torch.cat([norms["enorm"](e), norms["hnorm"](hidden)], dim=-1) @ mtp["eh_proj.weight"].T

    ids = torch.tensor([tokens])
    logits = []
    with torch.no_grad():
        x = layer_input(ids[:, 1:], hf.model(input_ids=ids[:, :-1]).last_hidden_state)
        for _ in range(k):
            n = x.shape[1]
            positions = torch.arange(n)[None]
            mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
            out = hf.model.layers[LAYERS - 1](x, attention_mask=mask, position_ids=positions, past_key_values=None,
                                              position_embeddings=hf.model.rotary_emb(x, positions))
            last = (out[0] if isinstance(out, tuple) else out)[:, -1:]
            logits.append((norms["shared_head.norm"](last) @ mtp["shared_head.head.weight"].T)[0, 0])
            x = torch.cat([x, layer_input(logits[-1].argmax()[None, None], last)], dim=1)
    return logits


def test_drafts_are_the_layers_predictions_by_its_definition(checkpoints):
    path = checkpoints["random"]
    llm = _llm(path, k=2)
    engine = llm.llm_engine
    engine.add_request(PROMPTS[0], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    engine.step()  # the prefill samples the first token; the MTP layer has seen nothing yet
    [request] = engine.core.scheduler.running
    so = engine.core.scheduler.schedule()  # a decode with two draft slots
    engine.core.batch_builder.drafter.propose(so, engine.core.scheduler.kv_cache_manager)
    expected = []
    for logits in _reference_drafts(path, request.all_token_ids, k=2):
        top2 = logits.topk(2)
        assert top2.values[0] - top2.values[1] > 1e-4, "a near tie: pick another prompt"
        expected.append(int(top2.indices[0]))
    assert request.spec_token_ids == expected


def test_drafts_line_up_with_the_targets_positions(checkpoints):
    path = checkpoints["aligned"]
    expected = _tokens(_llm(path, k=None).generate(PROMPTS, GREEDY, use_tqdm=False))
    llm = _llm(path, k=3)
    assert _tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == expected
    stats = llm.llm_engine.get_stats()
    assert stats.spec_decode_num_draft_tokens > 0
    assert stats.spec_decode_acceptance_rate == 1.0
    assert stats.num_steps < 24  # 24 tokens a request, up to 4 a step


@pytest.mark.parametrize("mode", [
    {},  # prefix caching, one prefill step each
    {"enable_prefix_caching": False},
    {"max_num_batched_tokens": 32, "block_size": 8},  # chunked prefill over several steps
    {"num_kv_blocks": 24, "block_size": 8, "max_model_len": 176},  # preemption
])
def test_greedy_output_equals_decoding_without_mtp(checkpoints, mode):
    path = checkpoints["random"]
    prompts = PROMPTS + [PROMPTS[0] + [5, 6, 7]]  # a prefix-cache hit on the first prompt
    expected = _tokens(_llm(path, k=None, **mode).generate(prompts, GREEDY, use_tqdm=False))
    llm = _llm(path, k=2, **mode)
    assert _tokens(llm.generate(prompts, GREEDY, use_tqdm=False)) == expected
    stats = llm.llm_engine.get_stats()
    assert stats.spec_decode_num_draft_tokens > 0
    if "num_kv_blocks" in mode:
        assert llm.llm_engine.core.scheduler.num_preemptions > 0


def test_what_mtp_cannot_run_with_is_refused_by_name(checkpoints, hf_checkpoint):
    with pytest.raises(ValueError, match="speculative_config: method='mtp' needs a checkpoint with multi-token"):
        LLM(str(hf_checkpoint("llama")), speculative_config={"method": "mtp"})
    with pytest.raises(ValueError, match="speculative_config.*pipeline_parallel_size"):
        LLM(str(checkpoints["random"]), speculative_config={"method": "mtp"}, pipeline_parallel_size=2)
    with pytest.raises(ValueError, match="model"):
        LLM(str(checkpoints["random"]), speculative_config={"method": "mtp", "model": "pagedserve-tiny"})


def test_a_tensor_parallel_target_drafts_the_same(checkpoints):
    """Under TP the MTP layer runs whole beside the driver rank, which holds the full hidden states."""
    path = checkpoints["aligned"]
    expected = _tokens(_llm(path, k=None).generate(PROMPTS, GREEDY, use_tqdm=False))
    llm = _llm(path, k=3, tensor_parallel_size=2)
    assert _tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == expected
    assert llm.llm_engine.get_stats().spec_decode_acceptance_rate == 1.0
