"""Images into a prompt: decoded (PIL), hashed by content, and processed by the checkpoint's own image
processor (Hugging Face's, loaded lazily: torch and its image code only where images are processed); each
image's placeholder token expanded to the number of embeddings the vision tower gives it."""

from __future__ import annotations

import functools
import hashlib
import json
from pathlib import Path

import numpy as np

from engine.models.config import QwenVisionConfig, VisionConfig
from engine.multimodal.inputs import MultiModalInput


def content_hash(image, processor_kwargs: dict | None = None) -> str:
    """Over the decoded pixels (mode, size, bytes) and the processor's settings: the same image sent as a URL
    and as base64, or twice, is one entry everywhere."""
    h = hashlib.blake2b(digest_size=16)
    h.update(f"{image.mode}:{image.size}:".encode())
    h.update(image.tobytes())
    h.update(json.dumps(processor_kwargs or {}, sort_keys=True).encode())
    return h.hexdigest()


@functools.lru_cache(maxsize=8)
def image_processor(model_path: str):
    from transformers import AutoImageProcessor

    try:
        return AutoImageProcessor.from_pretrained(model_path)
    except (OSError, ValueError) as e:
        raise ValueError(f"multi_modal_data: the checkpoint at {model_path} has no image processor: {e}") from e


def expand_images(token_ids: list[int], images: list, vision: VisionConfig | QwenVisionConfig,
                  model_path: str | Path, processor_kwargs: dict | None = None
                  ) -> tuple[list[int], list[MultiModalInput]]:
    """The prompt with each image's placeholder token expanded to its embeddings' count (a prompt already
    holding every image's whole run is kept), and the images as MultiModalInputs at their offsets. Raises
    ValueError naming the field."""
    from PIL import Image

    for i, image in enumerate(images):
        if not isinstance(image, Image.Image):
            raise ValueError(f"multi_modal_data: image {i} is a {type(image).__name__}, not a PIL image")
    token = vision.image_token_id
    positions = [i for i, t in enumerate(token_ids) if t == token]
    if not images:
        if positions:
            raise ValueError(f"multi_modal_data: 0 images for {len(positions)} image placeholder tokens (id {token}) "
                             "in the prompt; give one image per placeholder")
        return token_ids, []
    kwargs = dict(processor_kwargs or {})
    pixels, grids = _process(images, model_path, kwargs)
    counts = [vision.tokens_for(grid) for grid in grids]
    if len(positions) == len(images):
        spans = [(p, 1) for p in positions]  # one placeholder an image, as a chat template writes them
    elif len(positions) == sum(counts) and max(counts) > 1:  # already expanded: each image's run kept
        firsts = np.cumsum([0, *counts[:-1]])
        spans = [(positions[k], n) for k, n in zip(firsts, counts)]
        if any(positions[k + n - 1] != positions[k] + n - 1 for k, n in zip(firsts, counts)):
            raise ValueError(f"prompt: an expanded image placeholder must be its image's {counts} tokens "
                             f"(id {token}) in a row")
    else:
        raise ValueError(f"multi_modal_data: {len(images)} images for {len(positions)} image placeholder tokens "
                         f"(id {token}) in the prompt; give one image per placeholder")
    expanded, inputs, last = [], [], 0
    for (start, length), image, values, grid, n in zip(spans, images, pixels, grids, counts):
        expanded.extend(token_ids[last:start])
        inputs.append(MultiModalInput(content_hash(image, kwargs), len(expanded), n,
                                      np.ascontiguousarray(values, dtype=np.float32), grid))
        expanded.extend([token] * n)
        last = start + length
    expanded.extend(token_ids[last:])
    return expanded, inputs


def _process(images: list, model_path: str | Path, kwargs: dict) -> tuple[list[np.ndarray], list]:
    """Each image's pixel values and patch grid (None where the processor makes one size, as CLIP's)."""
    try:
        out = image_processor(str(model_path))([im.convert("RGB") for im in images], return_tensors="np", **kwargs)
    except Exception as e:  # the processor's own complaints about an image (sizes, modes)
        raise ValueError(f"multi_modal_data: the image processor rejected an image: {e}") from e
    if "image_grid_thw" not in out:
        return list(out["pixel_values"]), [None] * len(images)
    grids = [tuple(int(x) for x in grid) for grid in out["image_grid_thw"]]
    ends = np.cumsum([t * h * w for t, h, w in grids])
    return np.split(out["pixel_values"], ends[:-1]), grids
