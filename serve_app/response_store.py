"""Stored responses (the Responses API's `store`, `previous_response_id`, retrieval and deletion).

ResponseStore is the pure core: entries by response id, each the Response as JSON and the conversation
that led to it (the chat messages a `previous_response_id` continues from), bounded by entries, bytes and
age, least recently used out first. vLLM keeps its responses in each server's memory, unbounded and
unshared; ours are bounded, and shared by every replica serving HTTP through one named, detached Ray actor
per app (`shared_store`): ingress replicas come and go (autoscaling, restarts) while the actor keeps the
store, and a request may continue a response another replica made. Ray's GCS key-value store would also
outlive replicas, but it has no eviction of its own and every read and write would be a GCS round trip
for the whole cluster; one actor holds the LRU order and the byte count in one place."""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass


@dataclass(frozen=True)
class StoreLimits:
    max_entries: int = 10_000
    max_bytes: int = 256 * 2**20
    ttl_s: float = 24 * 3600.0


class ResponseStore:
    def __init__(self, limits: StoreLimits = StoreLimits(), clock=time.monotonic) -> None:
        self.limits = limits
        self.clock = clock
        self._entries: OrderedDict[str, tuple[str, str]] = OrderedDict()  # id -> (response, messages), LRU first
        # id -> when stored, oldest first: with one age limit for all, the expired are always at its front, so
        # expiring costs only the entries that expire, not a scan of the store on every call.
        self._stored: OrderedDict[str, float] = OrderedDict()
        self._bytes = 0
        self.num_evicted = 0

    def put(self, response_id: str, response_json: str, messages_json: str) -> None:
        self.delete(response_id)
        size = len(response_json) + len(messages_json)
        if size > self.limits.max_bytes:
            return  # larger than the whole store: never kept
        self._entries[response_id] = (response_json, messages_json)
        self._stored[response_id] = self.clock()
        self._bytes += size
        self._evict()

    def get(self, response_id: str) -> tuple[str, str] | None:
        """(response JSON, conversation JSON), or None when unknown, deleted, evicted or expired."""
        self._evict()
        entry = self._entries.get(response_id)
        if entry is None:
            return None
        self._entries.move_to_end(response_id)
        return entry

    def delete(self, response_id: str) -> bool:
        entry = self._entries.pop(response_id, None)
        if entry is not None:
            del self._stored[response_id]
            self._bytes -= len(entry[0]) + len(entry[1])
        return entry is not None

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def num_bytes(self) -> int:
        return self._bytes

    def _evict(self) -> None:
        limits, oldest_kept = self.limits, self.clock() - self.limits.ttl_s
        while self._stored and next(iter(self._stored.values())) < oldest_kept:
            self.delete(next(iter(self._stored)))
            self.num_evicted += 1
        while self._entries and (len(self._entries) > limits.max_entries or self._bytes > limits.max_bytes):
            self.delete(next(iter(self._entries)))
            self.num_evicted += 1


def shared_store(app_name: str, limits: StoreLimits):
    """The app's store actor (created by the first replica that asks; detached, so it outlives every replica),
    whose methods are ResponseStore's: `await store.get.remote(id)`."""
    import ray

    actor = ray.remote(num_cpus=0, max_restarts=-1)(ResponseStore)
    return actor.options(name=f"pagedserve-responses:{app_name}", namespace="pagedserve", lifetime="detached",
                         get_if_exists=True).remote(limits)
