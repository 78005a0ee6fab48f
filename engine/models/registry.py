"""Which decoder class runs each supported architecture (engine/models/config.py parses their configs)."""

from __future__ import annotations

from engine.models.deepseek import DeepseekForCausalLM
from engine.models.deepseek_mtp import DeepseekMTP
from engine.models.gemma3 import Gemma3ForCausalLM
from engine.models.gpt_oss import GptOssForCausalLM
from engine.models.llama import LlamaForCausalLM
from engine.models.llava import LlavaForConditionalGeneration
from engine.models.moe import MoEForCausalLM
from engine.models.qwen2_vl import Qwen2VLForConditionalGeneration

MTP_ARCHITECTURE = "DeepseekMTP"
MODEL_REGISTRY: dict[str, type[LlamaForCausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    # Base models (no LM head), run as embedders: engine/models/llama.py loads their unprefixed tensor names.
    "LlamaModel": LlamaForCausalLM,
    "MistralModel": LlamaForCausalLM,
    "Qwen2Model": LlamaForCausalLM,
    "Qwen3Model": LlamaForCausalLM,
    "MixtralForCausalLM": MoEForCausalLM,
    "Qwen2MoeForCausalLM": MoEForCausalLM,
    "Qwen3MoeForCausalLM": MoEForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "Gemma3ForConditionalGeneration": Gemma3ForCausalLM,
    "DeepseekV2ForCausalLM": DeepseekForCausalLM,
    "DeepseekV3ForCausalLM": DeepseekForCausalLM,
    "GptOssForCausalLM": GptOssForCausalLM,
    "LlavaForConditionalGeneration": LlavaForConditionalGeneration,
    "Qwen2VLForConditionalGeneration": Qwen2VLForConditionalGeneration,
    "Qwen2_5_VLForConditionalGeneration": Qwen2VLForConditionalGeneration,
    # Draft models only: a checkpoint's multi-token prediction layer (speculative_config method "mtp").
    MTP_ARCHITECTURE: DeepseekMTP,
}


def model_class(architecture: str) -> type[LlamaForCausalLM]:
    try:
        return MODEL_REGISTRY[architecture]
    except KeyError:
        raise ValueError(f"model: no decoder for {architecture!r}; supported: {', '.join(MODEL_REGISTRY)}") from None
