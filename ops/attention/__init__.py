"""Paged attention backends behind one interface; `get_attention_backend` picks one by name."""

from ops.attention.backend import AttentionBackend, AttentionMetadata


def get_attention_backend(name: str, device: str) -> type[AttentionBackend]:
    """Resolve `auto|torch|flashinfer` to a backend class; flashinfer needs CUDA and the `gpu` extra."""
    if name == "auto":
        name = "flashinfer" if device == "cuda" and _flashinfer_available() else "torch"
    if name == "torch":
        from ops.attention.torch_backend import TorchAttentionBackend

        return TorchAttentionBackend
    if name == "flashinfer":
        if device != "cuda":
            raise ValueError("attention_backend: flashinfer needs device=cuda; use torch on CPU")
        if not _flashinfer_available():
            raise ValueError("attention_backend: flashinfer is not installed; pip install 'pagedserve[gpu]'")
        from ops.attention.flashinfer_backend import FlashInferAttentionBackend

        return FlashInferAttentionBackend
    raise ValueError(f"attention_backend: unknown backend {name!r} (auto, torch, flashinfer)")


def _flashinfer_available() -> bool:
    try:
        import flashinfer  # noqa: F401
    except ImportError:
        return False
    return True


__all__ = ["AttentionBackend", "AttentionMetadata", "get_attention_backend"]
