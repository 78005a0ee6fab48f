"""EncoderCache: which images' embeddings the workers hold, decided here on the driver and carried out by
every worker from the step's ModelInput (encode these, drop those), so that all ranks hold the same.

An image's embeddings are computed once, the first step that schedules any of its placeholder tokens, and
shared by every request carrying the same image (by content hash) and by the later chunks of a prompt that
chunked prefill split inside an image. Within a byte budget, the least recently used images go first; never
one the current step reads."""

from __future__ import annotations

from collections import OrderedDict

from engine.multimodal.inputs import MultiModalInput


class EncoderCache:
    def __init__(self, capacity_bytes: int, bytes_per_embedding: int) -> None:
        self.capacity_bytes = capacity_bytes
        self.bytes_per_embedding = bytes_per_embedding
        self._held: OrderedDict[str, int] = OrderedDict()  # content hash -> bytes, least recently used first
        self.num_encoded = 0  # images encoded since start
        self.num_hits = 0  # images a step read from the cache instead

    def holds(self, content_hash: str) -> bool:
        return content_hash in self._held

    @property
    def used_bytes(self) -> int:
        return sum(self._held.values())

    def plan(self, needed: list[MultiModalInput]) -> tuple[list[MultiModalInput], list[str]]:
        """For a step that reads `needed`: the images to encode and the hashes to drop first."""
        encode: dict[str, MultiModalInput] = {}
        for image in needed:
            if image.content_hash in encode:
                continue
            if image.content_hash in self._held:
                self._held.move_to_end(image.content_hash)
                self.num_hits += 1
                continue
            encode[image.content_hash] = image
            self._held[image.content_hash] = image.length * self.bytes_per_embedding
            self.num_encoded += 1
        evict, read = [], {image.content_hash for image in needed}
        used = self.used_bytes
        for content_hash in list(self._held):
            if used <= self.capacity_bytes:
                break
            if content_hash not in read:
                used -= self._held.pop(content_hash)
                evict.append(content_hash)
        return list(encode.values()), evict
