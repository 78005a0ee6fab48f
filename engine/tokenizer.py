"""Tokenizer loading (the Hugging Face fast tokenizer of the checkpoint, or of `tokenizer`), the tokens that
end a generation, and what the tokenizer lets us know about a text's length in tokens before paying to tokenize it."""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

import transformers
from transformers import PreTrainedTokenizerBase

from engine.models.builtin import cache_root

if TYPE_CHECKING:
    from engine.config import EngineConfig
    from engine.models.config import ModelConfig

# Normalizers by the most they can shrink a text (NFC/NFKC compose at most four code points into one:
# U+1FAF is Omega and three combining marks; the others map or expand). One not listed (Strip,
# StripAccents, Bert's clean_text) may delete characters: no bound then.
_NORMALIZER_SHRINK = {"NFC": 4, "NFKC": 4, "NFD": 1, "NFKD": 1, "Lowercase": 1, "Prepend": 1}
# Pre-tokenizers that keep every character; Whitespace, WhitespaceSplit and Bert's drop the spaces.
_KEEPING_PRE_TOKENIZERS = {"ByteLevel", "Metaspace", "Digits", "UnicodeScripts", "Split", "Punctuation"}


# Files whose content AutoTokenizer's choice of class depends on.
_CLASS_INPUTS = ("tokenizer_config.json", "config.json", "tokenizer.json")


def load_tokenizer(name_or_path: str | Path, revision: str | None = None) -> PreTrainedTokenizerBase:
    """AutoTokenizer's tokenizer for a checkpoint. The class AutoTokenizer chooses for a local folder is
    remembered (in the cache folder, per transformers version and the files it reads to choose): choosing
    reads the model's config through transformers' config classes, which import torch (2-3 s and ~200 MiB
    in a process that only tokenizes: the ingress, an engine replica's front-end); the class itself loads
    without it."""
    path = Path(name_or_path).expanduser()
    record = _class_record(path) if path.is_dir() else None
    try:
        tokenizer_class = _remembered_class(record) if record else None
        if tokenizer_class is not None:
            return tokenizer_class.from_pretrained(str(path))
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(name_or_path), revision=revision)
    except (OSError, ValueError) as e:
        raise ValueError(f"tokenizer: cannot load a tokenizer from {name_or_path!s}: {e}") from e
    if record is not None and getattr(transformers, type(tokenizer).__name__, None) is type(tokenizer):
        _remember_class(record, type(tokenizer).__name__)
    return tokenizer


def _class_record(path: Path) -> Path:
    key = [transformers.__version__, str(path.resolve())]
    for name in _CLASS_INPUTS:
        stat = (path / name).stat() if (path / name).is_file() else None
        key.append(f"{name}:{stat.st_size}:{stat.st_mtime_ns}" if stat else f"{name}:-")
    return cache_root() / "tokenizer-classes" / hashlib.sha256("\n".join(key).encode()).hexdigest()[:24]


def _remembered_class(record: Path) -> type[PreTrainedTokenizerBase] | None:
    try:
        name = record.read_text().strip()
    except OSError:
        return None
    tokenizer_class = getattr(transformers, name, None)
    is_tokenizer = isinstance(tokenizer_class, type) and issubclass(tokenizer_class, PreTrainedTokenizerBase)
    return tokenizer_class if is_tokenizer else None


def _remember_class(record: Path, name: str) -> None:
    try:  # atomically, as replicas start together; a read-only cache only costs the next load its seconds
        record.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=record.parent, prefix=".")
    except OSError:
        return
    try:
        with os.fdopen(fd, "w") as f:
            f.write(name)
        os.replace(tmp, record)
    except OSError:
        Path(tmp).unlink(missing_ok=True)  # a half-written record never stays behind


def tokenizer_for(config: EngineConfig, model_path: str | Path) -> PreTrainedTokenizerBase:
    """The tokenizer an engine config names (`tokenizer`, at `revision`), else the checkpoint's own."""
    if config.tokenizer:
        return load_tokenizer(config.tokenizer, config.revision)
    return load_tokenizer(model_path)


def resolve_eos_token_ids(model_config: ModelConfig, tokenizer: PreTrainedTokenizerBase) -> frozenset[int]:
    """The tokens that end a generation: the model's generation config, else the tokenizer's EOS."""
    if model_config.eos_token_ids:
        return frozenset(model_config.eos_token_ids)
    return frozenset([tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else [])


def max_chars_per_token(tokenizer: PreTrainedTokenizerBase) -> int | None:
    """The most characters of input text one token can stand for, so that a text of more than
    `max_model_len x this` characters is known too long without tokenizing it; None when the tokenizer
    gives no such bound (a normalizer or pre-tokenizer that deletes characters, unknown characters
    fused into one token, an added token that swallows the whitespace around it, a tokenizer that is
    not a Rust `tokenizers` one).

    A token's string in the vocabulary is at least as long as the text it covers: byte-level BPE
    writes one character per byte, SentencePiece one per character ("▁" for a space), byte fallback
    six per byte ("<0xE2>"), WordPiece adds "##"; added tokens match their own content."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    spec = json.loads(backend.to_str())
    shrink = _normalizer_shrink(spec.get("normalizer"))
    model = spec.get("model", {})
    if (shrink is None or not _keeps_characters(spec.get("pre_tokenizer"))
            or any(t.get("lstrip") or t.get("rstrip") for t in spec.get("added_tokens", ()))
            or (model.get("type") == "Unigram" or model.get("fuse_unk")) and not model.get("byte_fallback")):
        return None
    longest = max(len(token) for token in tokenizer.get_vocab())
    if model.get("type") == "WordPiece":  # an unknown word of up to this many characters is one [UNK]
        longest = max(longest, model.get("max_input_chars_per_word", 100))
    return shrink * longest


def _normalizer_shrink(normalizer: dict | None) -> int | None:
    if normalizer is None:
        return 1
    kind = normalizer.get("type")
    if kind == "Sequence":
        factor = 1
        for inner in normalizer.get("normalizers", ()):
            inner_factor = _normalizer_shrink(inner)
            if inner_factor is None:
                return None
            factor *= inner_factor
        return factor
    if kind == "Replace":  # SentencePiece's " " -> "▁": a plain string for a non-empty one
        pattern, content = normalizer.get("pattern", {}).get("String"), normalizer.get("content", "")
        return -(-len(pattern) // len(content)) if pattern and content else None
    return _NORMALIZER_SHRINK.get(kind)


def _keeps_characters(pre_tokenizer: dict | None) -> bool:
    if pre_tokenizer is None:
        return True
    if pre_tokenizer.get("type") == "Sequence":
        return all(_keeps_characters(p) for p in pre_tokenizer.get("pretokenizers", ()))
    return pre_tokenizer.get("type") in _KEEPING_PRE_TOKENIZERS and pre_tokenizer.get("behavior") != "Removed"
