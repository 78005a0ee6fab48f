"""Moving staged KV between the pools through Ray's object store (the CPU transport of P/D).

The engine processes are no Ray processes, so bytes reach Ray through the host's shared memory: the
prefill engine's ranks save the prompt's KV into /dev/shm files (engine/kv_transfer/shared_memory.py; one
copy, out of the blocks); on the decode side's fetch, the prefill replica maps those files and `ray.put`s
them (one copy, into its node's object store) and lets the engine free the blocks; the decode replica
awaits the references (Ray moves the objects between nodes), writes each rank's bytes into a /dev/shm
file of its own host (one copy) and hands the engine their name; the engine's ranks load them (one copy,
into the blocks). On one host the object store copy is a memcpy; across hosts add the network.

The fetch is a pull, as NIXL's is: the prefill side holds the KV (blocks and staged files) under its
engine's lease until the decode side fetches it or the lease runs out; a fetch after that finds nothing
and the decode side recomputes. Pushing the object at prefill time would leave the lease without teeth:
an object a borrower holds cannot be freed from its owner in Ray 2.60."""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import ray

from engine.shm_files import staged_path


@dataclass
class PrefillResult:
    """A prefill replica's answer: the producer engine's kv_transfer_params (its staged KV's name,
    tokens, layout, prefix-cache hits) and which replica holds it."""

    kv_transfer_params: dict
    replica_id: str
    request_id: str  # the prefill engine's id of the request (what its lease is keyed by)


@dataclass
class KVFetchRequest:
    """A call that must reach one prefill replica: the prefix router pins it (serve_app/routing)."""

    replica_id: str
    request_id: str


@dataclass
class KVFetchResult:
    refs: list  # one ObjectRef per rank: that rank's staged KV bytes
    num_bytes: int
    put_s: float  # the prefill replica's copy into the object store


def put_staged(params: dict, directory: str) -> KVFetchResult:
    """Every rank's staged KV into the object store; raises FileNotFoundError when the lease has ended."""
    start = time.monotonic()
    refs, total = [], 0
    for rank in range(params["num_ranks"]):
        data = np.memmap(staged_path(directory, params["name"], rank), dtype=np.uint8, mode="r")
        total += data.nbytes
        refs.append(ray.put(data))  # Ray copies the mapped file straight into the object store
        del data
    return KVFetchResult(refs, total, time.monotonic() - start)


def write_staged(arrays: list[np.ndarray], name: str, directory: str) -> None:
    """The fetched ranks' bytes as staged files here, for the decode engine's ranks to load; a write that
    fails leaves nothing behind (neither the ranks written nor the half-written one)."""
    try:
        for rank, data in enumerate(arrays):
            path = staged_path(directory, name, rank)
            tmp = path.with_suffix(".tmp")
            data.tofile(tmp)
            tmp.rename(path)  # the engine checks sizes: it never sees a half-written file
    except BaseException:
        discard_staged(name, len(arrays), directory)
        raise


def discard_staged(name: str, num_ranks: int, directory: str) -> None:
    """Delete a staged KV's files, written or half-written."""
    for rank in range(num_ranks):
        path = staged_path(directory, name, rank)
        path.unlink(missing_ok=True)
        path.with_suffix(".tmp").unlink(missing_ok=True)
