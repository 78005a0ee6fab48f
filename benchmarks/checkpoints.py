"""Checkpoints written by other projects' own tools, for comparisons on the same weights: compressed-tensors
(the `compressed-tensors` package, llm-compressor's path) from a dense Hugging Face checkpoint."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch


def write_compressed_tensors(dense: Path, out: Path, bits: int, strategy: str, symmetric: bool,
                             group_size: int | None = None, activations: bool = False):
    """Schemes applied to the HF model of `dense` (every Linear but lm_head), min-max scales (the package's
    calculate_qparams), compressed and saved to `out` with the tokenizer. `activations`: W8A8's int8 activations
    per token, dynamic (the package then writes the int-quantized format). Returns (the compressed model, its
    ModelCompressor), for callers that decompress it again."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationConfig,
        QuantizationScheme,
        apply_quantization_config,
    )
    from compressed_tensors.quantization.utils import calculate_qparams
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(dense, dtype=torch.float32)
    args = QuantizationArgs(num_bits=bits, type="int", strategy=strategy, group_size=group_size, symmetric=symmetric)
    acts = (QuantizationArgs(num_bits=8, type="int", strategy="token", symmetric=True, dynamic=True)
            if activations else None)
    scheme = QuantizationScheme(targets=["Linear"], weights=args, input_activations=acts)
    config = QuantizationConfig(config_groups={"group_0": scheme}, ignore=["lm_head"])
    apply_quantization_config(model, config, show_progress=False)
    with torch.no_grad():
        for module in model.modules():
            if hasattr(module, "weight_scale"):
                w = module.weight
                rows = {"group": (w.shape[0], -1, group_size), "channel": (w.shape[0], 1, -1), "tensor": (1, 1, -1)}
                view = w.view(*rows[strategy])
                scale, zero = calculate_qparams(view.amin(-1), view.amax(-1), module.quantization_scheme.weights)
                module.weight_scale.copy_(scale.reshape(module.weight_scale.shape))
                module.weight_zero_point.copy_(zero.reshape(module.weight_zero_point.shape))
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    model.save_pretrained(out)
    compressor.update_config(out)
    for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "chat_template.jinja"):
        if (dense / f).exists():
            shutil.copy(dense / f, out / f)
    return model, compressor
