"""Images into a prompt: decoded (PIL), hashed by content, and processed by the checkpoint's own image
processor (Hugging Face's, loaded lazily: torch and its image code only where images are processed); each
image's placeholder token expanded to the number of embeddings the vision tower gives it."""

from __future__ import annotations

import functools
import hashlib
import json
import threading
from collections import OrderedDict
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


Processed = tuple[np.ndarray, tuple[int, int, int] | None]  # pixel values, and the patch grid (Qwen-VL)


class ProcessedImageCache:
    """Processed images by content hash (which covers the processor's settings): an image sent again skips
    its resize and normalization. Least recently used out first, within a byte budget; any thread may call."""

    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self._items: OrderedDict[str, Processed] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self.queries = self.hits = 0

    def get(self, content_hash: str) -> Processed | None:
        with self._lock:
            self.queries += 1
            item = self._items.get(content_hash)
            if item is not None:
                self._items.move_to_end(content_hash)
                self.hits += 1
            return item

    def put(self, content_hash: str, item: Processed) -> None:
        if item[0].nbytes > self.capacity_bytes:
            return
        with self._lock:
            if content_hash in self._items:
                return
            self._items[content_hash] = item
            self._bytes += item[0].nbytes
            while self._bytes > self.capacity_bytes:
                self._bytes -= self._items.popitem(last=False)[1][0].nbytes


@functools.lru_cache(maxsize=8)
def image_processor(model_path: str):
    from transformers import AutoImageProcessor

    try:
        return AutoImageProcessor.from_pretrained(model_path)
    except (OSError, ValueError) as e:
        raise ValueError(f"multi_modal_data: the checkpoint at {model_path} has no image processor: {e}") from e


def expand_images(token_ids: list[int], images: list, vision: VisionConfig | QwenVisionConfig,
                  model_path: str | Path, processor_kwargs: dict | None = None,
                  cache: ProcessedImageCache | None = None) -> tuple[list[int], list[MultiModalInput]]:
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
    hashes = [content_hash(image, kwargs) for image in images]
    processed = [cache.get(h) if cache is not None else None for h in hashes]
    missing = [i for i, item in enumerate(processed) if item is None]
    if missing:
        for i, item in zip(missing, _process([images[i] for i in missing], model_path, kwargs)):
            processed[i] = item
            if cache is not None:
                cache.put(hashes[i], item)
    counts = [vision.tokens_for(grid) for _, grid in processed]
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
    for (start, length), content, (values, grid), n in zip(spans, hashes, processed, counts):
        expanded.extend(token_ids[last:start])
        inputs.append(MultiModalInput(content, len(expanded), n, values, grid))
        expanded.extend([token] * n)
        last = start + length
    expanded.extend(token_ids[last:])
    return expanded, inputs


def _process(images: list, model_path: str | Path, kwargs: dict) -> list[Processed]:
    """Each image's float32 pixel values and patch grid (None where the processor makes one size, as CLIP's)."""
    try:
        out = image_processor(str(model_path))([im.convert("RGB") for im in images], return_tensors="np", **kwargs)
    except Exception as e:  # the processor's own complaints about an image (sizes, modes)
        raise ValueError(f"multi_modal_data: the image processor rejected an image: {e}") from e
    pixels = np.asarray(out["pixel_values"], dtype=np.float32)
    if "image_grid_thw" not in out:
        return [(np.ascontiguousarray(values), None) for values in pixels]
    grids = [tuple(int(x) for x in grid) for grid in out["image_grid_thw"]]
    ends = np.cumsum([t * h * w for t, h, w in grids])
    return [(np.ascontiguousarray(values), grid) for values, grid in zip(np.split(pixels, ends[:-1]), grids)]
