"""VisionLanguageModel: a language model that takes image embeddings in place of each image's placeholder
tokens. The workers encode a step's new images (`embed_images`) into their encoder cache and hand the
forward the placeholder rows' embeddings; each architecture (engine/models/llava.py, qwen2_vl.py) says how
its tower turns pixels into embeddings."""

from __future__ import annotations

import torch

from engine.models.llama import LlamaForCausalLM
from engine.multimodal.inputs import MultiModalInput
from ops.attention import AttentionBackend


class VisionLanguageModel(LlamaForCausalLM):
    def embed_images(self, images: list[MultiModalInput]) -> list[torch.Tensor]:
        """Each image's embeddings, [its placeholder tokens, hidden]."""
        raise NotImplementedError

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, backend: AttentionBackend,
                intermediate=None, mm_embeds: tuple[torch.Tensor, torch.Tensor] | None = None):
        """`mm_embeds`: (token rows, their embeddings) of the image placeholders this step computes."""
        embeds = None
        if mm_embeds is not None and self.model.is_first_stage:
            rows, values = mm_embeds
            embeds = self.model.embed(input_ids)
            embeds[rows] = values.to(embeds.dtype)
        return self.model(input_ids, positions, backend, intermediate, inputs_embeds=embeds)
