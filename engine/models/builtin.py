"""Built-in models: deterministic random-weight Llama-family checkpoints written in Hugging Face format
(config.json, model.safetensors, tokenizer, chat template) into a cache folder, then loaded through
the same loader as any checkpoint. The tokenizer is the real 32k SentencePiece one that ships inside
`mistral_common`; the weights are random, so the text is gibberish but every code path is real.

    pagedserve-tiny   ~4M parameters (hidden 64, 2 layers): tests and the default serving config
    pagedserve-56m    ~56M parameters (hidden 512, 8 layers, 8/4 heads): benchmarks; the same shape
                      as the model behind DESIGN.md's "Numbers to beat"
    pagedserve-600m   ~600M parameters (hidden 1536, 20 layers, 12/4 heads): benchmarks where the decoder's
                      weights, not the LM head, make most of the bytes a decode step reads (quantization)
    pagedserve-tiny-moe      Mixtral-style mixture of experts with pagedserve-tiny's attention: 8 experts
                             of intermediate size 96, top-2 (tests, configs)
    pagedserve-tiny-embed    pagedserve-tiny's shape as a Qwen3-Embedding-style embedder: a base model (no LM
                             head) with sentence-transformers files pooling the last token, normalized (tests)
    pagedserve-56m-embed     the same at pagedserve-56m's shape (benchmarks/embeddings.py)
    pagedserve-56m-moe       ~108M parameters, ~56M active per token: pagedserve-56m's attention, 8 experts
                             of intermediate size 704, top-2, so that a token's two experts cost about what
                             the dense model's MLP (1376) costs (benchmarks/moe.py)

The cache folder is $PAGEDSERVE_CACHE (default ~/.cache/pagedserve); a folder's name carries a hash of
its spec, so a changed spec materializes afresh."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from engine.models.config import ModelConfig

_ARCH = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu"}
_COMMON = {
    "vocab_size": 32000,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "tie_word_embeddings": False,
    "initializer_range": 0.02,
    "torch_dtype": "float32",
}
_MOE_ARCH = {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "hidden_act": "silu",
             "num_local_experts": 8, "num_experts_per_tok": 2, "router_jitter_noise": 0.0}
# Gemma 3's shape at toy size: 6 layers, 5 of them over a 64-token window, to 1 global.
_GEMMA3_ARCH = {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
                "hidden_activation": "gelu_pytorch_tanh", "sliding_window": 64, "rope_local_base_freq": 10000.0,
                "layer_types": ["sliding_attention"] * 5 + ["full_attention"]}
# DeepSeek-V3's shape at toy size: latent attention (a 40-value latent per token and layer), a dense first
# layer, then 8 routed experts in 2 groups (top-2, sigmoid scores with their bias) and a shared one; one
# multi-token prediction layer after them (speculative_config method "mtp").
_DEEPSEEK_V3_ARCH = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_act": "silu",
                     "kv_lora_rank": 32, "q_lora_rank": 48, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8,
                     "v_head_dim": 16, "n_routed_experts": 8, "num_experts_per_tok": 2, "n_shared_experts": 1,
                     "moe_intermediate_size": 32, "n_group": 2, "topk_group": 1, "first_k_dense_replace": 1,
                     "norm_topk_prob": True, "routed_scaling_factor": 2.5, "rope_interleave": True,
                     "num_nextn_predict_layers": 1}
# What the LLaVA built-ins share: <image> is id 32000, features from the CLIP tower's second-to-last layer.
_LLAVA_ARCH = {"architectures": ["LlavaForConditionalGeneration"], "model_type": "llava", "image_token_index": 32000,
               "vision_feature_layer": -2, "vision_feature_select_strategy": "default",
               "projector_hidden_act": "gelu", "multimodal_projector_bias": True, "bos_token_id": 1,
               "eos_token_id": 2, "initializer_range": 0.02, "tie_word_embeddings": False, "torch_dtype": "float32"}
_CLIP_TOWER = {"model_type": "clip_vision_model", "hidden_act": "quick_gelu", "layer_norm_eps": 1e-5}
# What the Qwen2.5-VL built-ins share: ChatML's and the vision tokens at ids 32000-32005 (<|im_end|> ends a
# turn), 14-pixel patches merged 2 x 2.
_QWEN2_5_VL_ARCH = {"architectures": ["Qwen2_5_VLForConditionalGeneration"], "model_type": "qwen2_5_vl",
                    "hidden_act": "silu", "vocab_size": 32064, "torch_dtype": "float32", "eos_token_id": [32001, 2],
                    "vision_start_token_id": 32002, "vision_end_token_id": 32003, "image_token_id": 32004,
                    "video_token_id": 32005}
_QWEN2_5_VL_TOWER = {"in_channels": 3, "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2,
                     "hidden_act": "silu", "tokens_per_second": 2}
# gpt-oss's shape at toy size: 4 layers alternating a 128-token window and full attention, attention sinks,
# YaRN, 8 clamped-SwiGLU experts of 32 with biases, top-2.
_GPT_OSS_ARCH = {"architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "attention_bias": True,
                 "num_local_experts": 8, "num_experts_per_tok": 2, "sliding_window": 128, "swiglu_alpha": 1.702,
                 "swiglu_limit": 7.0, "layer_types": ["sliding_attention", "full_attention"] * 2,
                 "rope_parameters": {"rope_type": "yarn", "factor": 8.0, "beta_fast": 32, "beta_slow": 1,
                                     "truncate": False, "original_max_position_embeddings": 512,
                                     "rope_theta": 150000.0}}
# Qwen3-Embedding's layout: a Qwen3 base model (QK norms, no LM head), trained Matryoshka-style.
_EMBED_ARCH = {"architectures": ["Qwen3Model"], "model_type": "qwen3", "hidden_act": "silu", "is_matryoshka": True}
BUILTIN_MODELS: dict[str, dict] = {
    "pagedserve-tiny": {
        **_ARCH, **_COMMON, "hidden_size": 64, "intermediate_size": 192, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    },
    "pagedserve-56m": {
        **_ARCH, **_COMMON, "hidden_size": 512, "intermediate_size": 1376, "num_hidden_layers": 8,
        "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 64,
    },
    "pagedserve-600m": {
        **_ARCH, **_COMMON, "hidden_size": 1536, "intermediate_size": 4096, "num_hidden_layers": 20,
        "num_attention_heads": 12, "num_key_value_heads": 4, "head_dim": 128,
    },
    "pagedserve-tiny-embed": {
        **_COMMON, **_EMBED_ARCH, "hidden_size": 64, "intermediate_size": 192, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    },
    "pagedserve-56m-embed": {
        **_COMMON, **_EMBED_ARCH, "hidden_size": 512, "intermediate_size": 1376, "num_hidden_layers": 8,
        "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 64,
    },
    # Mixtral's intermediate_size is one expert's.
    "pagedserve-tiny-moe": {
        **_MOE_ARCH, **_COMMON, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    },
    "pagedserve-56m-moe": {
        **_MOE_ARCH, **_COMMON, "hidden_size": 512, "intermediate_size": 704, "num_hidden_layers": 8,
        "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 64,
    },
    "pagedserve-tiny-gemma3": {
        **_COMMON, **_GEMMA3_ARCH, "hidden_size": 64, "intermediate_size": 192, "num_hidden_layers": 6,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "query_pre_attn_scalar": 16,
        "rope_theta": 1_000_000.0, "tie_word_embeddings": True,
    },
    # Harmony's special tokens follow the 32k vocabulary (HARMONY_TOKENS); its turns end at <|return|> or
    # <|call|>. The vocabulary is padded to a multiple of 16, as real checkpoints pad theirs.
    "pagedserve-tiny-gpt-oss": {
        **_COMMON, **_GPT_OSS_ARCH, "hidden_size": 64, "intermediate_size": 32, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 32016,
        "eos_token_id": [32005, 32006, 2],
    },
    # LLaVA: a 3-layer CLIP tower over 32-pixel images (4 x 4 patches: 16 embeddings an image) in front of
    # pagedserve-tiny's shape; <image> is id 32000, the vocabulary padded to 32064 as llava-1.5's is.
    "pagedserve-tiny-llava": {
        **_LLAVA_ARCH,
        "vision_config": {**_CLIP_TOWER, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 3,
                          "num_attention_heads": 4, "image_size": 32, "patch_size": 8},
        "text_config": {**_ARCH, **_COMMON, "model_type": "llama", "vocab_size": 32064, "hidden_size": 64,
                        "intermediate_size": 192, "num_hidden_layers": 2, "num_attention_heads": 4,
                        "num_key_value_heads": 2, "head_dim": 16},
    },
    # Qwen2.5-VL: a 4-layer windowed vision transformer (14-pixel patches merged 2 x 2: an image of up to
    # 224 x 224 pixels makes up to 64 embeddings) in front of pagedserve-tiny's shape as a Qwen2 language
    # model with M-RoPE; ChatML and the vision tokens are ids 32000-32005.
    "pagedserve-tiny-qwen2.5-vl": {
        **_COMMON, **_QWEN2_5_VL_ARCH, "hidden_size": 64, "intermediate_size": 192, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2,
        "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]},
        "vision_config": {**_QWEN2_5_VL_TOWER, "depth": 4, "hidden_size": 32, "intermediate_size": 64,
                          "num_heads": 4, "out_hidden_size": 64, "window_size": 56, "fullatt_block_indexes": [1, 3]},
    },
    # Benchmarks (benchmarks/multimodal.py): realistic proportions at CPU size. pagedserve-56m behind a ViT-S
    # (hidden 384, 12 layers, 6 heads) in each family's layout: LLaVA's CLIP over 224-pixel images in 14-pixel
    # patches (256 embeddings an image, from the second-to-last layer), and Qwen2.5-VL's windowed tower over
    # images of up to 448 x 448 pixels (up to 256 embeddings, a full-attention block every fourth).
    "pagedserve-56m-llava": {
        **_LLAVA_ARCH,
        "vision_config": {**_CLIP_TOWER, "hidden_size": 384, "intermediate_size": 1536, "num_hidden_layers": 12,
                          "num_attention_heads": 6, "image_size": 224, "patch_size": 14},
        "text_config": {**_ARCH, **_COMMON, "model_type": "llama", "vocab_size": 32064, "hidden_size": 512,
                        "intermediate_size": 1376, "num_hidden_layers": 8, "num_attention_heads": 8,
                        "num_key_value_heads": 4, "head_dim": 64},
    },
    "pagedserve-56m-qwen2.5-vl": {
        **_COMMON, **_QWEN2_5_VL_ARCH, "hidden_size": 512, "intermediate_size": 1376, "num_hidden_layers": 8,
        "num_attention_heads": 8, "num_key_value_heads": 4,
        "rope_scaling": {"type": "mrope", "mrope_section": [8, 12, 12]},
        "vision_config": {**_QWEN2_5_VL_TOWER, "depth": 12, "hidden_size": 384, "intermediate_size": 1024,
                          "num_heads": 6, "out_hidden_size": 512, "window_size": 112,
                          "fullatt_block_indexes": [3, 7, 11]},
    },
    "pagedserve-tiny-deepseek-v3": {
        **_COMMON, **_DEEPSEEK_V3_ARCH, "hidden_size": 64, "intermediate_size": 192, "num_hidden_layers": 3,
        "num_attention_heads": 4, "num_key_value_heads": 4,
    },
}

# Mistral's [INST] format, with its v3 tool calling: the tools' definitions before the last user message,
# an assistant's calls as `[TOOL_CALLS] [{"name": ..., "arguments": {...}}]`, and each tool's result as
# `[TOOL_RESULTS] {"call_id": ..., "content": ...}[/TOOL_RESULTS]` (what serve_app's `mistral` tool
# parser reads back). Arguments may come as an object or as OpenAI's JSON string.
CHAT_TEMPLATE = (
    "{{- bos_token }}"
    "{%- if messages and messages[0]['role'] == 'system' %}"
    "{%- set system = messages[0]['content'] %}{%- set loop_messages = messages[1:] %}"
    "{%- else %}{%- set system = none %}{%- set loop_messages = messages %}{%- endif %}"
    "{%- set ns = namespace(last_user=-1) %}"
    "{%- for message in loop_messages %}{%- if message['role'] == 'user' %}{%- set ns.last_user = loop.index0 %}"
    "{%- endif %}{%- endfor %}"
    "{%- for message in loop_messages %}"
    "{%- if message['role'] == 'user' %}"
    "{%- if tools and loop.index0 == ns.last_user %}"
    "{{ '[AVAILABLE_TOOLS] ' + (tools | tojson) + '[/AVAILABLE_TOOLS]' }}"
    "{%- endif %}"
    "{%- if loop.first and system %}{{ '[INST] ' + system + '\\n\\n' + message['content'] + ' [/INST]' }}"
    "{%- else %}{{ '[INST] ' + message['content'] + ' [/INST]' }}{%- endif %}"
    "{%- elif message['role'] == 'assistant' and message.get('tool_calls') %}{{ '[TOOL_CALLS] [' }}"
    "{%- for call in message['tool_calls'] %}{%- set args = call['function']['arguments'] %}"
    "{{ '{\"name\": ' + (call['function']['name'] | tojson) + ', \"arguments\": ' }}"
    "{{- (args if args is string else (args | tojson)) + '}' }}{{ ', ' if not loop.last }}"
    "{%- endfor %}{{ ']' + eos_token }}"
    "{%- elif message['role'] == 'assistant' %}{{ (message['content'] or '') + eos_token }}"
    "{%- elif message['role'] == 'tool' %}"
    "{{ '[TOOL_RESULTS] ' + ({'call_id': message.get('tool_call_id'), 'content': message['content']} | tojson) }}"
    "{{- '[/TOOL_RESULTS]' }}"
    "{%- endif %}"
    "{%- endfor %}"
)
# Harmony (gpt-oss's chat format, serve_app/harmony.py), written as gpt-oss's own template writes it: a
# system message with the valid channels, the developer message (a system message's instructions and the
# tools, declared as a TypeScript namespace), then each message with its header; an assistant's tool call is
# a commentary message addressed to `functions.NAME`, a tool's result a message from it to the assistant.
# `reasoning_effort` (chat_template_kwargs) goes into the system message, as the model was trained.
HARMONY_TEMPLATE = (
    "{%- set ns = namespace(call='') %}"
    "{{- '<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\\n' }}"
    "{{- 'Knowledge cutoff: 2024-06\\n\\nReasoning: ' + (reasoning_effort or 'medium') + '\\n\\n' }}"
    "{{- '# Valid channels: analysis, commentary, final. Channel must be included for every message.' }}"
    "{%- if tools %}{{ '\\nCalls to these tools must go to the commentary channel: \\'functions\\'.' }}{%- endif %}"
    "{{- '<|end|>' }}"
    "{%- if messages and messages[0]['role'] in ('system', 'developer') %}"
    "{%- set instructions = messages[0]['content'] %}{%- set loop_messages = messages[1:] %}"
    "{%- else %}{%- set instructions = none %}{%- set loop_messages = messages %}{%- endif %}"
    "{%- if instructions or tools %}{{ '<|start|>developer<|message|>' }}"
    "{%- if instructions %}{{ '# Instructions\\n\\n' + instructions }}{%- endif %}"
    "{%- if tools %}{{ ('\\n\\n' if instructions else '') + '# Tools\\n\\n## functions\\n\\n' }}"
    "{{- 'namespace functions {\\n' }}"
    "{%- for tool in tools %}{%- set f = tool['function'] if 'function' in tool else tool %}"
    "{{ '\\n// ' + (f.get('description') or '') + '\\ntype ' + f['name'] + ' = (_: ' }}"
    "{{- (f.get('parameters') or {}) | tojson }}{{ ') => any;\\n' }}"
    "{%- endfor %}{{ '\\n} // namespace functions' }}{%- endif %}{{ '<|end|>' }}{%- endif %}"
    "{%- for message in loop_messages %}"
    "{%- if message['role'] == 'assistant' and message.get('tool_calls') %}"
    "{%- for call in message['tool_calls'] %}{%- set f = call['function'] %}{%- set ns.call = f['name'] %}"
    "{{ '<|start|>assistant to=functions.' + f['name'] + '<|channel|>commentary <|constrain|>json<|message|>' }}"
    "{{- (f['arguments'] if f['arguments'] is string else (f['arguments'] | tojson)) + '<|call|>' }}"
    "{%- endfor %}"
    "{%- elif message['role'] == 'assistant' %}"
    "{{ '<|start|>assistant<|channel|>final<|message|>' + (message['content'] or '') + '<|end|>' }}"
    "{%- elif message['role'] == 'tool' %}"
    "{{ '<|start|>functions.' + (message.get('name') or ns.call) + ' to=assistant<|channel|>commentary<|message|>' }}"
    "{{- message['content'] + '<|end|>' }}"
    "{%- else %}{{ '<|start|>' + message['role'] + '<|message|>' + message['content'] + '<|end|>' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|start|>assistant' }}{%- endif %}"
)
HARMONY_TOKENS = ("<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>", "<|call|>")
# LLaVA-1.5's turns, with <image> where each image part goes.
LLAVA_TEMPLATE = (
    "{%- for message in messages %}{{ 'USER: ' if message['role'] == 'user' else 'ASSISTANT: ' }}"
    "{%- if message['content'] is string %}{{ message['content'] }}{%- else %}{%- for part in message['content'] %}"
    "{{ '<image>' if part['type'] == 'image' else part['text'] }}{%- endfor %}{%- endif %}{{ '\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{ 'ASSISTANT:' }}{%- endif %}"
)
# ChatML, as Qwen's chat templates write it, with each image part as <|vision_start|><|image_pad|><|vision_end|>.
QWEN_VL_TEMPLATE = (
    "{%- for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string %}{{ message['content'] }}{%- else %}{%- for part in message['content'] %}"
    "{{ '<|vision_start|><|image_pad|><|vision_end|>' if part['type'] == 'image' else part['text'] }}"
    "{%- endfor %}{%- endif %}{{ '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
)
QWEN_VL_TOKENS = ("<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
# Qwen2-VL's preprocessing: resized to multiples of 28 pixels within [56^2, 224^2] pixels, cut into 14-pixel
# patches (each twice in time, as a still image is), normalized.
_QWEN_VL_IMAGE_PROCESSOR = {
    "image_processor_type": "Qwen2VLImageProcessor", "patch_size": 14, "merge_size": 2, "temporal_patch_size": 2,
    "size": {"shortest_edge": 56 * 56, "longest_edge": 224 * 224}, "do_resize": True, "do_rescale": True,
    "rescale_factor": 1 / 255, "do_normalize": True, "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_std": [0.26862954, 0.26130258, 0.27577711], "resample": 3, "do_convert_rgb": True,
}
# The benchmark model's: up to 448 x 448.
_QWEN_VL_448_IMAGE_PROCESSOR = {**_QWEN_VL_IMAGE_PROCESSOR,
                                "size": {"shortest_edge": 56 * 56, "longest_edge": 448 * 448}}


def _llava_processor(patch_size: int) -> dict:
    """processor_config.json: what LlavaProcessor (vLLM's LLaVA path) needs to expand <image> itself."""
    return {"processor_class": "LlavaProcessor", "patch_size": patch_size, "image_token": "<image>",
            "vision_feature_select_strategy": "default", "num_additional_image_tokens": 1}
# CLIP's preprocessing at the tiny tower's 32-pixel input (resized, centre-cropped, normalized).
_LLAVA_IMAGE_PROCESSOR = {
    "image_processor_type": "CLIPImageProcessor", "size": {"shortest_edge": 32},
    "crop_size": {"height": 32, "width": 32},
    "do_resize": True, "do_center_crop": True, "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True,
    "image_mean": [0.48145466, 0.4578275, 0.40821073], "image_std": [0.26862954, 0.26130258, 0.27577711],
    "resample": 3, "do_convert_rgb": True,
}
_LLAVA_224_IMAGE_PROCESSOR = {**_LLAVA_IMAGE_PROCESSOR, "size": {"shortest_edge": 224},
                              "crop_size": {"height": 224, "width": 224}}


@dataclass(frozen=True)
class _Flavor:
    """What a built-in's files say besides its weights: its chat template, the special tokens added after the
    32k vocabulary (ids 32000 on, in order), and an image processor's config for vision-language models."""

    chat_template: str = CHAT_TEMPLATE
    added_tokens: tuple[str, ...] = ()
    image_processor: dict | None = None
    processor: dict | None = None  # processor_config.json
    pooling: str | None = None  # an embedder's sentence-transformers Pooling mode (then Normalize)


_FLAVORS = {"pagedserve-tiny-gpt-oss": _Flavor(HARMONY_TEMPLATE, HARMONY_TOKENS),
            "pagedserve-tiny-llava": _Flavor(LLAVA_TEMPLATE, ("<image>",), _LLAVA_IMAGE_PROCESSOR, _llava_processor(8)),
            "pagedserve-tiny-qwen2.5-vl": _Flavor(QWEN_VL_TEMPLATE, QWEN_VL_TOKENS, _QWEN_VL_IMAGE_PROCESSOR),
            "pagedserve-56m-llava": _Flavor(LLAVA_TEMPLATE, ("<image>",), _LLAVA_224_IMAGE_PROCESSOR,
                                            _llava_processor(14)),
            "pagedserve-56m-qwen2.5-vl": _Flavor(QWEN_VL_TEMPLATE, QWEN_VL_TOKENS, _QWEN_VL_448_IMAGE_PROCESSOR),
            "pagedserve-tiny-embed": _Flavor(pooling="pooling_mode_lasttoken"),
            "pagedserve-56m-embed": _Flavor(pooling="pooling_mode_lasttoken")}
_TOKENIZER_CONFIG = {
    "tokenizer_class": "LlamaTokenizer",
    "bos_token": "<s>",
    "eos_token": "</s>",
    "unk_token": "<unk>",
    "add_bos_token": True,
    "add_eos_token": False,
    "legacy": False,
    "model_max_length": 4096,
    "chat_template": CHAT_TEMPLATE,
}
_FORMAT_VERSION = 1  # bump when the files written below change
# Seeds of the random weights, fixed per model so that the files around them (the chat template, the
# tokenizer's config) can change without changing the weights. A model not listed seeds from its spec.
_WEIGHT_SEEDS = {"pagedserve-tiny": 0x24A9A3D7, "pagedserve-56m": 0x7BED96D1, "pagedserve-600m": 0x600D5EED,
                 "pagedserve-tiny-moe": 0x5E1F0C2B, "pagedserve-56m-moe": 0x3A7C94E5,
                 "pagedserve-tiny-gemma3": 0x6E3A3001, "pagedserve-tiny-deepseek-v3": 0xD5EE3003,
                 "pagedserve-tiny-gpt-oss": 0x6F550004, "pagedserve-tiny-llava": 0x11A7A005,
                 "pagedserve-tiny-qwen2.5-vl": 0x9E2A5006, "pagedserve-56m-llava": 0x56A11A07,
                 "pagedserve-56m-qwen2.5-vl": 0x56E2A508, "pagedserve-tiny-embed": 0xE3BED009,
                 "pagedserve-56m-embed": 0xE3BED00A}


def cache_root() -> Path:
    return Path(os.environ.get("PAGEDSERVE_CACHE", Path.home() / ".cache" / "pagedserve"))


def materialize_builtin(name: str) -> Path:
    spec = BUILTIN_MODELS[name]
    flavor = _FLAVORS.get(name, _Flavor())
    extra = [list(flavor.added_tokens), flavor.image_processor, flavor.processor] if name in _FLAVORS else []
    if flavor.pooling is not None:
        extra.append(flavor.pooling)
    digest = hashlib.sha256(json.dumps([spec, flavor.chat_template, _FORMAT_VERSION, *extra], sort_keys=True).encode())
    path = cache_root() / "models" / f"{name}-{digest.hexdigest()[:12]}"
    if (path / "model.safetensors").is_file():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=path.parent))
    try:
        seed = _WEIGHT_SEEDS.get(name) or int(
            hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:8], 16)
        write_checkpoint(tmp, spec, seed=seed, flavor=flavor)
        try:
            os.rename(tmp, path)  # atomic: concurrent replicas either win or find it done
        except OSError:
            if not (path / "model.safetensors").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path


def write_checkpoint(path: Path, spec: dict, seed: int, flavor: _Flavor = _Flavor()) -> None:
    # Here, not at the top: processes that only tokenize (the ingress) read this module without torch.
    import torch
    from safetensors.torch import save_file

    from engine.models.registry import model_class

    (path / "config.json").write_text(json.dumps(spec, indent=2))
    (path / "generation_config.json").write_text(
        json.dumps({"bos_token_id": spec["bos_token_id"], "eos_token_id": spec["eos_token_id"]})
    )
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    cfg = ModelConfig.from_dict(spec)
    for name, shape in model_class(cfg.architecture).checkpoint_shapes(cfg).items():
        if cfg.headless:  # a base model's files: no LM head, no `model.` prefix
            if name.startswith("lm_head."):
                continue
            name = name.removeprefix("model.")
        if name.endswith("norm.weight"):
            tensors[name] = torch.ones(shape)
        else:
            tensors[name] = torch.randn(shape, generator=gen) * spec["initializer_range"]
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    write_tokenizer(path, flavor)
    if flavor.image_processor is not None:
        (path / "preprocessor_config.json").write_text(json.dumps(flavor.image_processor, indent=2))
    if flavor.processor is not None:
        (path / "processor_config.json").write_text(json.dumps(flavor.processor, indent=2))
    if flavor.pooling is not None:
        write_sentence_transformers(path, flavor.pooling, spec["hidden_size"])


def write_sentence_transformers(path: Path, pooling_mode: str, dimension: int, normalize: bool = True) -> None:
    """sentence-transformers' files: the modules (the model, its Pooling and perhaps Normalize) and the pooling
    mode, as an embedder's checkpoint ships them (engine/pooling/config.py reads them)."""
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    (path / "modules.json").write_text(json.dumps(modules, indent=2))
    (path / "1_Pooling").mkdir(exist_ok=True)
    modes = ("pooling_mode_cls_token", "pooling_mode_mean_tokens", "pooling_mode_max_tokens",
             "pooling_mode_mean_sqrt_len_tokens", "pooling_mode_weightedmean_tokens", "pooling_mode_lasttoken")
    config = {"word_embedding_dimension": dimension, **{m: m == pooling_mode for m in modes}, "include_prompt": True}
    (path / "1_Pooling" / "config.json").write_text(json.dumps(config, indent=2))


def write_tokenizer(path: Path, flavor: _Flavor = _Flavor()) -> None:
    """The 32k SentencePiece tokenizer, with the flavor's chat template and added special tokens."""
    import mistral_common
    from transformers import AutoTokenizer

    sentencepiece = Path(mistral_common.__file__).parent / "data" / "tokenizer.model.v1"
    shutil.copyfile(sentencepiece, path / "tokenizer.model")
    config = dict(_TOKENIZER_CONFIG, chat_template=flavor.chat_template)
    if flavor.added_tokens:
        config["added_tokens_decoder"] = {
            str(32000 + i): {"content": t, "special": True, "lstrip": False, "rstrip": False, "normalized": False,
                             "single_word": False}
            for i, t in enumerate(flavor.added_tokens)
        }
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    # Converting the SentencePiece model takes seconds; save the fast tokenizer.json once.
    AutoTokenizer.from_pretrained(path).save_pretrained(path)
