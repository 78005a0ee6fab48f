"""Tokenizer loading: the Hugging Face fast tokenizer of the checkpoint (or of `tokenizer`)."""

from __future__ import annotations

from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerBase


def load_tokenizer(name_or_path: str | Path, revision: str | None = None) -> PreTrainedTokenizerBase:
    try:
        return AutoTokenizer.from_pretrained(str(name_or_path), revision=revision)
    except (OSError, ValueError) as e:
        raise ValueError(f"tokenizer: cannot load a tokenizer from {name_or_path!s}: {e}") from e
