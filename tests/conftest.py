"""Shared fixtures: random-weight checkpoints in Hugging Face format, written by transformers itself so
that our loader is tested against the real on-disk format."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch

from engine.models.builtin import materialize_builtin
from serve_app.serve_env import HAPROXY_INGRESS_ENV

# Ray Serve reads its flags once, when a process imports it. A session serving through HAProxy (as `make run`
# does; tests/serve_app/conftest.py) builds its apps in this process, which must know HAProxy is in front (an
# app whose ingress request router HAProxy consults is refused otherwise): set before any test imports Ray.
if os.environ.get("PAGEDSERVE_TEST_INGRESS", "haproxy") == "haproxy":
    os.environ.update(HAPROXY_INGRESS_ENV)
# A test's Ray is started by the test. Without this, a callback of Serve's driver-side client that fires after a
# fixture's ray.shutdown() starts a Ray of its own (Ray's auto-init), and the cluster's teardown then refuses
# to remove the head node "connected to this Ray client" (a CI-like run's test_multinode teardown did).
os.environ["RAY_ENABLE_AUTO_CONNECT"] = "0"

if TYPE_CHECKING:
    from engine import LLM


def pytest_configure(config):
    config.addinivalue_line("markers", "ray: runs on a Ray instance (set on every test that starts or joins one)")


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by it
def pytest_collection_modifyitems(items):
    # `make test` runs the tests without Ray on two workers, then the Ray tests alone (the Makefile says why).
    for item in items:
        if "ray_session" in getattr(item, "fixturenames", ()) or item.get_closest_marker("own_ray"):
            item.add_marker(pytest.mark.ray)


TINY = "pagedserve-tiny"

_SMALL = dict(
    vocab_size=32000,
    hidden_size=64,
    intermediate_size=160,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    bos_token_id=1,
    eos_token_id=2,
)


def _arch_configs():
    from transformers import (
        DeepseekV2Config,
        DeepseekV3Config,
        Gemma3TextConfig,
        GptOssConfig,
        LlamaConfig,
        MistralConfig,
        MixtralConfig,
        Qwen2Config,
        Qwen2MoeConfig,
        Qwen3Config,
        Qwen3MoeConfig,
    )

    return {
        # Llama 3 rope scaling and tied embeddings
        "llama": LlamaConfig(
            **_SMALL,
            rope_theta=500000.0,
            tie_word_embeddings=True,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 256,
            },
        ),
        "mistral": MistralConfig(**_SMALL, sliding_window=None, tie_word_embeddings=False),
        "qwen2": Qwen2Config(**_SMALL, tie_word_embeddings=False),  # qkv bias
        "qwen3": Qwen3Config(**_SMALL, head_dim=32, tie_word_embeddings=False),  # q/k norm, head_dim != hidden/heads
        # Mixtures of experts (tests/engine/models/test_moe.py): Mixtral renormalizes and keeps float32 routing weights;
        # Qwen2-MoE does not renormalize, adds a gated shared expert and keeps layer 1 dense; Qwen3-MoE
        # renormalizes top-4 of 8 (transformers writes its expert count as num_local_experts).
        "mixtral": MixtralConfig(**{**_SMALL, "intermediate_size": 48}, num_local_experts=8, num_experts_per_tok=2,
                                 sliding_window=None),
        "qwen2_moe": Qwen2MoeConfig(**_SMALL, moe_intermediate_size=48, shared_expert_intermediate_size=96,
                                    num_experts=8, num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[1]),
        "qwen3_moe": Qwen3MoeConfig(**_SMALL, head_dim=32, moe_intermediate_size=32, num_experts=8,
                                    num_experts_per_tok=4, norm_topk_prob=True),
        # 6 layers, 5 sliding (a window of 32, shorter than most prompts) to 1 global; the global layers' rotary
        # base and linear scaling differ from the local ones'; scores scaled by a query_pre_attn_scalar that is
        # not head_dim; final logits soft-capped.
        "gemma3": Gemma3TextConfig(**{**_SMALL, "num_hidden_layers": 6}, head_dim=32, sliding_window=32,
                                   query_pre_attn_scalar=24, final_logit_softcapping=30.0, pad_token_id=0,
                                   rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0,
                                                                      "rope_theta": 1_000_000.0},
                                                    "sliding_attention": {"rope_type": "default",
                                                                          "rope_theta": 10_000.0}}),
        # Multi-head latent attention (engine/models/deepseek.py). V2: group-limited softmax routing over 8 experts
        # in 4 groups, no q_lora, YaRN; V3: sigmoid routing with its bias, q_lora, a dense first layer.
        "deepseek_v2": DeepseekV2Config(**_DEEPSEEK, q_lora_rank=None, topk_method="group_limited_greedy", n_group=4,
                                        topk_group=2, routed_scaling_factor=1.5, first_k_dense_replace=0,
                                        rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                                      "original_max_position_embeddings": 256, "mscale": 0.707,
                                                      "mscale_all_dim": 0.707, "beta_fast": 32, "beta_slow": 1}),
        # Attention sinks, 2 of 4 layers over a 16-token window, YaRN, clamped SwiGLU experts (a limit the random
        # activations reach) with biases.
        "gpt_oss": GptOssConfig(**{**_SMALL, "num_hidden_layers": 4, "intermediate_size": 32}, head_dim=16,
                                num_local_experts=8, num_experts_per_tok=2, sliding_window=16, swiglu_limit=0.5,
                                tie_word_embeddings=False,
                                rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32, "beta_slow": 1,
                                                 "truncate": False, "original_max_position_embeddings": 256,
                                                 "rope_theta": 150000.0}),
        "deepseek_v3": DeepseekV3Config(**_DEEPSEEK, q_lora_rank=48, n_group=2, topk_group=1, first_k_dense_replace=1,
                                        norm_topk_prob=True, routed_scaling_factor=2.5),
    }


_DEEPSEEK = dict(vocab_size=32000, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
                 num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2,
                 n_shared_experts=1, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                 max_position_embeddings=1024, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)

ARCHS = ["llama", "mistral", "qwen2", "qwen3", "gemma3"]
MOE_ARCHS = ["mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v2", "deepseek_v3", "gpt_oss"]


def write_hf_checkpoint(arch: str, path: Path, max_shard_size: str | None = None) -> Path:
    """A random-weight checkpoint of `arch` saved by transformers, with the built-in tokenizer."""
    from transformers import AutoModelForCausalLM

    config = _arch_configs()[arch]
    torch.manual_seed(1234)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # perturb everything, norms and biases included, so loading each is tested
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.1 * torch.randn_like(p))
            else:
                p.copy_(0.05 * torch.randn_like(p))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # DeepSeek-V3's router bias: learned, not zero
                b.copy_(0.05 * torch.randn_like(b))
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, **kwargs)
    copy_builtin_tokenizer(path)
    return path


def copy_builtin_tokenizer(path: Path) -> None:
    """The built-in models' tokenizer (and chat template) into a checkpoint folder a test wrote."""
    tiny = materialize_builtin(TINY)
    for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "chat_template.jinja"):
        if (tiny / f).exists():
            shutil.copy(tiny / f, path / f)


@pytest.fixture(scope="session")
def tiny_model_path() -> Path:
    return materialize_builtin(TINY)


@pytest.fixture(scope="session")
def hf_checkpoint(tmp_path_factory):
    """arch -> checkpoint folder, written once per session."""
    cache: dict[str, Path] = {}

    def get(arch: str) -> Path:
        if arch not in cache:
            cache[arch] = write_hf_checkpoint(arch, tmp_path_factory.mktemp(arch))
        return cache[arch]

    return get


def engines_by_arch(hf_checkpoint, build: Callable[[str], LLM]) -> Iterator[Callable[[str], tuple[str, LLM]]]:
    """The body of a module fixture: arch -> (checkpoint path, engine `build(path)`), each engine built on
    first use and shut down when the module is done (several processes each: build once, share)."""
    engines: dict[str, tuple[str, LLM]] = {}

    def get(arch: str) -> tuple[str, LLM]:
        if arch not in engines:
            path = str(hf_checkpoint(arch))
            engines[arch] = path, build(path)
        return engines[arch]

    yield get
    for _, llm in engines.values():
        llm.shutdown()


# LLaVA's template in the shape of the released llava-1.5's: USER / ASSISTANT turns, <image> for each image part.
LLAVA_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ 'USER: ' if message['role'] == 'user' else 'ASSISTANT: ' }}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for part in message['content'] %}"
    "{{ '<image>' if part['type'] == 'image' else part['text'] }}{% endfor %}{% endif %}\n{% endfor %}"
    "{% if add_generation_prompt %}ASSISTANT:{% endif %}"
)


def write_llava_checkpoint(path: Path, tower: str = "clip") -> Path:
    """A random-weight LLaVA saved by transformers, with its processor: the tower's image processor, the
    built-in tokenizer with <image> added and LLAVA_CHAT_TEMPLATE, 4 x 4 patches of 8 pixels, a two-layer
    Llama behind it. CLIP: 16 embeddings an image (its class position dropped, the "default" strategy, from
    the second-to-last layer); SigLIP: 16 (all positions, "full", from the last layer, before its pooling head)."""
    from transformers import (
        AutoTokenizer,
        CLIPImageProcessor,
        CLIPVisionConfig,
        LlamaConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
        LlavaProcessor,
        SiglipVisionConfig,
    )

    tokenizer = AutoTokenizer.from_pretrained(materialize_builtin(TINY))
    tokenizer.add_special_tokens({"additional_special_tokens": ["<image>"]})
    tokenizer.chat_template = LLAVA_CHAT_TEMPLATE
    shape = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4, image_size=32,
                 patch_size=8)
    clip = tower == "clip"
    vision = CLIPVisionConfig(**shape) if clip else SiglipVisionConfig(**shape)
    text = LlamaConfig(vocab_size=32064, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024, bos_token_id=1,
                       eos_token_id=2)
    strategy = "default" if clip else "full"
    config = LlavaConfig(vision_config=vision, text_config=text, vision_feature_layer=-2 if clip else -1,
                         image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
                         vision_feature_select_strategy=strategy, projector_hidden_act="gelu")
    torch.manual_seed(0)
    model = LlavaForConditionalGeneration(config)
    with torch.no_grad():  # perturb everything, norms and biases included, so loading each is tested
        for name, p in model.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else 0.05 * torch.randn_like(p))
    model.save_pretrained(path)
    if clip:
        images = CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    else:
        from transformers.models.siglip.image_processing_pil_siglip import SiglipImageProcessorPil

        images = SiglipImageProcessorPil(size={"height": 32, "width": 32})
    LlavaProcessor(image_processor=images, tokenizer=tokenizer, patch_size=8, num_additional_image_tokens=int(clip),
                   vision_feature_select_strategy=strategy, chat_template=LLAVA_CHAT_TEMPLATE).save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def llava_checkpoint(tmp_path_factory) -> Path:
    return write_llava_checkpoint(tmp_path_factory.mktemp("llava"))


def write_qwen_vl_checkpoint(path: Path, generation: str = "2.5") -> Path:
    """A random-weight Qwen2.5-VL (or Qwen2-VL) saved by transformers, with the built-in tokenizer plus
    ChatML's and the vision tokens, QWEN_VL_TEMPLATE, and Qwen2-VL's image processor over 8-pixel patches
    merged 2 x 2 (images of 16^2 to 96^2 pixels); Qwen2.5-VL's windows are 2 x 2 merge squares, its second
    of three blocks full attention. transformers' whole Qwen processor needs torchvision (its video
    processor), which this host cannot install: only its parts are saved."""
    from transformers import (
        AutoTokenizer,
        Qwen2_5_VLConfig,
        Qwen2_5_VLForConditionalGeneration,
        Qwen2VLConfig,
        Qwen2VLForConditionalGeneration,
    )
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from engine.models.builtin import QWEN_VL_TEMPLATE, QWEN_VL_TOKENS

    tokenizer = AutoTokenizer.from_pretrained(materialize_builtin(TINY))
    tokenizer.add_special_tokens({"additional_special_tokens": list(QWEN_VL_TOKENS)})
    tokenizer.chat_template = QWEN_VL_TEMPLATE
    ids = dict(zip(QWEN_VL_TOKENS, tokenizer.convert_tokens_to_ids(list(QWEN_VL_TOKENS))))
    text = dict(_SMALL, vocab_size=32064, eos_token_id=ids["<|im_end|>"],
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]})
    tokens = dict(image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
                  vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"])
    if generation == "2.5":
        vision = dict(depth=3, hidden_size=32, intermediate_size=48, num_heads=4, out_hidden_size=64, patch_size=8,
                      spatial_merge_size=2, temporal_patch_size=2, window_size=32, fullatt_block_indexes=[1])
        config = Qwen2_5_VLConfig(text_config=text, vision_config=vision, **tokens)
        model_cls = Qwen2_5_VLForConditionalGeneration
    else:
        vision = dict(depth=2, embed_dim=32, mlp_ratio=2, num_heads=4, hidden_size=64, patch_size=8,
                      spatial_merge_size=2, temporal_patch_size=2)
        config = Qwen2VLConfig(text_config=text, vision_config=vision, **tokens)
        model_cls = Qwen2VLForConditionalGeneration
    torch.manual_seed(0)
    model = model_cls(config)
    with torch.no_grad():  # perturb everything, norms and biases included, so loading each is tested
        for name, p in model.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name or "ln_q" in name else 0.05 * torch.randn_like(p))
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    Qwen2VLImageProcessorPil(patch_size=8, merge_size=2, temporal_patch_size=2,
                             size={"shortest_edge": 16 * 16, "longest_edge": 96 * 96}).save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def qwen2_5_vl_checkpoint(tmp_path_factory) -> Path:
    return write_qwen_vl_checkpoint(tmp_path_factory.mktemp("qwen2_5_vl"))
