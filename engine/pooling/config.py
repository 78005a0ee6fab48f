"""How a checkpoint turns its hidden states into one embedding: which token(s) it pools and whether it normalizes.

Read from the sentence-transformers files where the checkpoint has them (modules.json naming a Pooling module
and its `1_Pooling/config.json`, and a Normalize module), else a decoder's default: the last token, normalized
(Qwen3-Embedding's way, and vLLM's default for a decoder run as an embedder). EngineConfig.pooler_config
overrides either."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

PoolingType = Literal["last", "mean", "cls"]
# sentence-transformers' Pooling modes we run, by their config keys.
_MODES = {"pooling_mode_lasttoken": "last", "pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls"}
_OTHER_MODES = ("pooling_mode_max_tokens", "pooling_mode_mean_sqrt_len_tokens", "pooling_mode_weightedmean_tokens")


class PoolerConfig(BaseModel):
    """A YAML-writable override (EngineConfig.pooler_config); unset fields keep the checkpoint's."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    pooling_type: PoolingType | None = Field(
        None, description="`last`: the last prompt token's hidden state; `mean`: the mean over the prompt's tokens; "
        "`cls`: the first token's. mean and cls need every token's state, so such requests skip the prefix cache.")
    normalize: bool | None = Field(None, description="Scale embeddings to unit length by default.")
    matryoshka: bool | None = Field(
        None, description="Trained so that an embedding's first values are an embedding too (Matryoshka): requests "
        "may ask for fewer `dimensions`. Default: the checkpoint's config.json `is_matryoshka` or "
        "`matryoshka_dimensions`.")
    matryoshka_dimensions: list[int] | None = Field(
        None, description="The only sizes a Matryoshka model accepts, where its config.json lists them.")

    @property
    def reads_every_position(self) -> bool:
        """Whether pooling needs the prompt's first positions computed (no prefix-cache hit may skip them)."""
        return self.pooling_type in ("mean", "cls")


def checkpoint_pooler(path: Path) -> PoolerConfig:
    """The pooling a checkpoint folder declares (sentence-transformers files), or the decoder default."""
    raw = json.loads((path / "config.json").read_text()) if (path / "config.json").is_file() else {}
    sizes = raw.get("matryoshka_dimensions")
    matryoshka = {"matryoshka": bool(raw.get("is_matryoshka") or sizes), "matryoshka_dimensions": sizes}
    modules_file = path / "modules.json"
    if not modules_file.is_file():
        return PoolerConfig(pooling_type="last", normalize=True, **matryoshka)
    modules = json.loads(modules_file.read_text())
    kinds = {m.get("type", "").rsplit(".", 1)[-1]: m for m in modules}
    unsupported = set(kinds) - {"Transformer", "Pooling", "Normalize"}
    if unsupported:
        raise ValueError(f"model: the checkpoint's sentence-transformers modules {sorted(unsupported)} are not "
                         "supported (only Transformer, Pooling and Normalize); set pooler_config to pool without them")
    pooling_type: PoolingType = "last"
    if "Pooling" in kinds:
        pooling_type = _pooling_mode(json.loads((path / kinds["Pooling"]["path"] / "config.json").read_text()))
    return PoolerConfig(pooling_type=pooling_type, normalize="Normalize" in kinds, **matryoshka)


def _pooling_mode(raw: dict[str, Any]) -> PoolingType:
    chosen = [mode for key, mode in _MODES.items() if raw.get(key)]
    other = [key for key in _OTHER_MODES if raw.get(key)]
    if other or len(chosen) != 1:
        raise ValueError(f"model: the checkpoint pools with {other or chosen or 'no mode'}; one of "
                         f"{', '.join(_MODES)} is supported (1_Pooling/config.json)")
    return chosen[0]


def resolve_pooler(path: Path, override: PoolerConfig | None) -> PoolerConfig:
    """The checkpoint's pooling with the engine config's override applied (every field set)."""
    base = checkpoint_pooler(path)
    if override is None:
        return base
    return base.model_copy(update=override.model_dump(exclude_none=True))


def check_dimensions(pooler: PoolerConfig, dimensions: int | None, hidden_size: int) -> None:
    """Refuse, naming `dimensions`, a size this model's embeddings cannot be cut to."""
    if dimensions is None:
        return
    if not pooler.matryoshka:
        raise ValueError("dimensions: this model was not trained for shorter embeddings (Matryoshka); leave it unset")
    allowed = pooler.matryoshka_dimensions
    if dimensions > hidden_size or (allowed and dimensions not in allowed):
        sizes = ", ".join(map(str, allowed)) if allowed else f"1 to {hidden_size}"
        raise ValueError(f"dimensions: {dimensions} is not a size this model embeds in; use {sizes}")
