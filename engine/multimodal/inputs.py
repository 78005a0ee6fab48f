"""MultiModalInput: one image of a prompt, prepared: where its placeholder tokens sit, its pixels as the
checkpoint's processor made them, and a content hash that names it everywhere else (the encoder cache, the
prefix cache's block keys, the router)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class MultiModalInput:
    content_hash: str  # over the decoded pixels and the processor's settings (engine/multimodal/images.py)
    offset: int  # its first placeholder token in the prompt
    length: int  # placeholder tokens: the embeddings the vision tower gives it
    # float32, as the processor made it: [channels, height, width] (CLIP), or the flattened patches
    # [patches, channels x temporal_patch x patch^2] of a patch grid (Qwen-VL)
    pixel_values: np.ndarray
    grid_thw: tuple[int, int, int] | None = None  # Qwen-VL: the patch grid (temporal, height, width)

    @property
    def end(self) -> int:
        return self.offset + self.length


def block_extra_keys(mm_inputs: Sequence[MultiModalInput], start: int, end: int) -> tuple | None:
    """The content hashes of the images whose tokens lie in [start, end): part of that block's hash, so a
    block of placeholder tokens is only ever shared by requests carrying the same image there."""
    keys = tuple(("image", m.content_hash, m.offset) for m in mm_inputs if m.offset < end and m.end > start)
    return keys or None
