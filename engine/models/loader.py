"""Build our decoder for a checkpoint folder and load its weights."""

from __future__ import annotations

from pathlib import Path

import torch

from engine.models.checkpoint import iter_checkpoint
from engine.models.config import ModelConfig
from engine.models.layers.quantization import QuantizationConfig
from engine.models.llama import LlamaForCausalLM, dummy_checkpoint
from engine.models.registry import model_class


def build_model(
    cfg: ModelConfig,
    path: Path,
    load_format: str,
    dtype: torch.dtype,
    device: torch.device,
    seed: int,
    batch_size_hint: int,
    quant_config: QuantizationConfig | None = None,
    with_lm_head: bool = True,
) -> LlamaForCausalLM:
    """This rank's part of the model, loaded and in compute form (dense weights prepacked on CPU for
    batches of about `batch_size_hint` rows). Without `with_lm_head` (an embedder) the LM head is dropped before
    loading: its tensors are skipped, and a base model's checkpoint has none."""
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # parameters in the target dtype; rope tables stay float32
    try:
        with torch.device(device):
            model = model_class(cfg.architecture)(cfg, quant_config)
            if not with_lm_head:
                model.lm_head = None
    finally:
        torch.set_default_dtype(default_dtype)
    with torch.no_grad():
        model.load_weights(dummy_checkpoint(model, seed) if load_format == "dummy" else iter_checkpoint(path))
        for module in model.modules():
            method = getattr(module, "quant_method", None)
            if method is not None:
                method.process_weights_after_loading(module, batch_size_hint)
    return model.eval()


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the weights this rank holds: parameters and persistent buffers (packed weights), not the
    rope tables or the KV cache."""
    tensors = {id(p): p for p in model.parameters()}
    for module in model.modules():
        for name, buffer in module._buffers.items():
            if buffer is not None and name not in module._non_persistent_buffers_set:
                tensors[id(buffer)] = buffer
    return sum(t.numel() * t.element_size() for t in tensors.values())
