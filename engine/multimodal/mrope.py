"""M-RoPE positions (Qwen-VL): each token's (temporal, height, width) rotary positions, as Hugging Face's
get_rope_index computes them. A text token's three are equal; an image's tokens sit on its merged patch
grid from the position where the image starts; the text after an image goes on from that start plus the
grid's longer side, so a request's positions run behind (or ahead of) its token indices by a fixed delta
once past its last image, which decode continues from. A pure function of the request's images and the
token indices asked for: the driver computes a step's positions without keeping any per-request state."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from engine.multimodal.inputs import MultiModalInput


def mrope_positions(images: Sequence[MultiModalInput], merge: int, start: int, count: int) -> np.ndarray:
    """int64 [3, count]: the positions of tokens start .. start + count - 1 of a request with `images`
    (by offset), whose patch grids merge by `merge` along each side."""
    index = np.arange(start, start + count, dtype=np.int64)
    out = np.broadcast_to(index, (3, count)).copy()
    shift = 0  # what the images before a token moved its position by
    for image in images:
        t, h, w = image.grid_thw
        h, w = h // merge, w // merge
        first, last = max(start, image.offset), min(start + count, image.end)
        if first < last:
            k = np.arange(first - image.offset, last - image.offset)
            base = image.offset + shift
            out[:, first - start : last - start] = base + np.stack([k // (h * w), k // w % h, k % w])
        shift += max(h, w) - image.length
        if image.end < start + count:
            out[:, max(image.end, start) - start :] += max(h, w) - image.length
    return out
