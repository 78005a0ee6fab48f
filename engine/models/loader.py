"""Resolve a model name to a local Hugging Face folder and load its weights into our decoder."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from engine.models.builtin import BUILTIN_MODELS, materialize_builtin
from engine.models.config import ModelConfig
from engine.models.llama import LlamaForCausalLM

# What a serving engine needs from a hub repo; skips .bin/.pth/.gguf duplicates of the weights.
_HUB_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.jinja", "*.txt", "*.tiktoken"]


def resolve_model_path(model: str, revision: str | None = None, weights: bool = True) -> Path:
    """A built-in name, a local folder, or a hub id (downloaded into the Hugging Face cache; without
    its weights when `weights` is False, for processes that only tokenize)."""
    if model in BUILTIN_MODELS:
        return materialize_builtin(model)
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(f"model: {path} has no config.json; is it a Hugging Face checkpoint folder?")
        return path
    if path.exists() or model.startswith((".", "/", "~")) or model.count("/") != 1:
        raise ValueError(
            f"model: {model!r} is neither a built-in model ({', '.join(BUILTIN_MODELS)}), "
            "a checkpoint folder, nor a hub id like 'org/name'"
        )
    from huggingface_hub import snapshot_download

    patterns = _HUB_PATTERNS if weights else [p for p in _HUB_PATTERNS if p != "*.safetensors"]
    return Path(snapshot_download(model, revision=revision, allow_patterns=patterns))


def build_model(
    cfg: ModelConfig, path: Path, load_format: str, dtype: torch.dtype, device: torch.device, seed: int
) -> LlamaForCausalLM:
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # parameters in the target dtype; rope tables stay float32
    try:
        with torch.device(device):
            model = LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(default_dtype)
    if load_format == "dummy":
        init_dummy_weights(model, cfg, seed)
    else:
        load_safetensors(model, path)
    return model.eval()


def init_dummy_weights(model: LlamaForCausalLM, cfg: ModelConfig, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            elif name.endswith(".bias"):
                param.zero_()
            else:
                param.copy_(torch.randn(param.shape, generator=gen) * cfg.initializer_range)


def iter_checkpoint(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"model: no *.safetensors weights in {path}; use load_format='dummy' for random weights")
    for file in files:
        with safe_open(str(path / file), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def load_safetensors(model: LlamaForCausalLM, path: Path) -> None:
    params = dict(model.named_parameters())
    loaded: set[tuple[str, int | None]] = set()
    with torch.no_grad():
        for name, tensor in iter_checkpoint(path):
            target = model.checkpoint_to_param(name)
            if target is None:
                continue
            ours, shard = target
            if ours not in params:
                raise ValueError(f"model: checkpoint tensor {name!r} matches no parameter of {model.config.architecture}")
            param = params[ours]
            if shard is None:
                dst = param
            else:
                sizes = model.shard_sizes(ours.split(".")[-2])
                dst = param.narrow(0, sum(sizes[:shard]), sizes[shard])
            if dst.shape != tensor.shape:
                raise ValueError(f"model: {name!r} has shape {tuple(tensor.shape)}, expected {tuple(dst.shape)}")
            dst.copy_(tensor)
            loaded.add((ours, shard))
    expected = set()
    for ours in params:
        fused = ours.split(".")[-2]
        shards = range(len(model.shard_sizes(fused))) if fused in ("qkv_proj", "gate_up_proj") else [None]
        expected.update((ours, s) for s in shards)
    missing = sorted(f"{n}[{s}]" if s is not None else n for n, s in expected - loaded)
    if missing:
        raise ValueError(f"model: checkpoint {path} lacks weights: {', '.join(missing[:8])}")
