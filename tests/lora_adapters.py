"""PEFT adapters for the LoRA tests, written by the `peft` package itself (so that our loader meets the real
file format), and their Hugging Face oracle: the base model with each targeted weight merged,
W + scale * B @ A (peft's merge_and_unload)."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch


def write_peft_adapter(base: Path, out: Path, r: int, targets: list[str], seed: int, alpha: float | None = None,
                       use_rslora: bool = False, std: float = 0.1, merged: Path | None = None, **config) -> Path:
    """A random-weight PEFT adapter of the checkpoint at `base` saved in `out`; with `merged`, also the merged
    model there (with the base's tokenizer files), the oracle for hf_greedy."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    lora = LoraConfig(r=r, lora_alpha=alpha if alpha is not None else 2 * r, target_modules=targets,
                      use_rslora=use_rslora, lora_dropout=0.0, task_type="CAUSAL_LM", **config)
    peft_model = get_peft_model(model, lora)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.copy_(std * torch.randn(p.shape, generator=gen))
    peft_model.save_pretrained(out)
    if merged is not None:
        peft_model.merge_and_unload().save_pretrained(merged)
        for f in base.iterdir():
            if f.name.startswith(("tokenizer", "chat_template", "generation_config")):
                shutil.copy(f, merged / f.name)
    return out
