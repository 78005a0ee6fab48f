"""Where a model's checkpoint folder is: a built-in model's (written once into the cache), a local
folder, or a hub repo's snapshot. Torch-free: processes that only tokenize resolve paths too."""

from __future__ import annotations

from pathlib import Path

from engine.models.builtin import BUILTIN_MODELS, materialize_builtin

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
