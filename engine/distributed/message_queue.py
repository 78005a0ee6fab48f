"""Broadcast of each step's input from the driver to the other ranks: pickled once, written once.

The shape of vLLM's and nano-vllm's MessageQueue. Readers on the driver's node read the payload from a
shared-memory ring (a file in /dev/shm, one slot per message, `num_slots` deep); readers elsewhere, and
payloads larger than a slot, get it over their socket. Which readers share the driver's node is the launcher's
word (the node ids it gives the writer and each reader), not whether the ring's file happens to be visible:
two Ray nodes on one machine see one /dev/shm yet are different nodes. Every reader has a TCP connection to the writer
on which it blocks for the next message's 16-byte header: readers sleep in the kernel between steps,
never spinning, which two cores cannot afford. The socket is also the liveness link: a reader sees EOF
when the writer's process dies, and the writer a broken pipe when a reader's does.

A reader publishes how far it has read in the ring's header; the writer reuses a slot only once every
local reader is past it (readers lag by a step or two at most: each step ends in collectives that need
every rank).

The ring's file is named as engine/shm_files.py names every file we put in /dev/shm (its owner's pid in
it) and lives only while the readers connect: once each has mapped it, the writer unlinks it (the mappings
stay), so an engine killed later leaves nothing there; one killed while its ranks connect leaves a file
the next engine's sweep removes."""

from __future__ import annotations

import json
import logging
import mmap
import pickle
import socket
import struct
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch.distributed as dist

from engine.shm_files import SHM_DIR, owned_prefix, sweep

logger = logging.getLogger(__name__)
_HEADER = struct.Struct("<qqq")  # sequence number, payload bytes, 1 if the payload is in the ring


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            raise EOFError("the message queue's peer closed the connection")
        got += k
    return bytes(buf)


class MessageQueueWriter:
    def __init__(self, store: dist.Store, name: str, num_readers: int, host: str,
                 num_slots: int = 4, slot_bytes: int = 1 << 20, timeout_s: float = 600.0, node_id: str = "") -> None:
        """`node_id`: the writer's node, as its launcher names nodes; readers given another one use the socket."""
        self.name, self.num_readers, self.node_id = name, num_readers, node_id
        self.num_slots, self.slot_bytes = num_slots, slot_bytes
        self.seq = 0
        sweep(SHM_DIR)  # rings (and staged KV) of engines killed before they could remove them
        self.path = Path(SHM_DIR) / f"{owned_prefix('mq')}{name}"
        self._header_bytes = 8 * max(num_readers, 1)
        size = self._header_bytes + num_slots * slot_bytes
        self.readers: list[tuple[socket.socket, bool] | None] = [None] * num_readers  # (socket, reads the ring)
        self.ring, self.read_seq = None, None
        try:
            with open(self.path, "w+b") as f:
                f.truncate(size)
                self.ring = mmap.mmap(f.fileno(), size)
            self.read_seq = np.frombuffer(self.ring, dtype=np.int64, count=max(num_readers, 1))
            self.read_seq[:] = 0
            self._accept_readers(store, host, timeout_s)
        except BaseException:
            self.close()
            raise
        self.path.unlink()  # every local reader has mapped the ring: the name has served its purpose

    def _accept_readers(self, store: dist.Store, host: str, timeout_s: float) -> None:
        with socket.create_server((host, 0)) as listener:
            store.set(f"{self.name}/mq", json.dumps({
                "host": host, "port": listener.getsockname()[1], "path": str(self.path), "num_slots": self.num_slots,
                "slot_bytes": self.slot_bytes, "num_readers": self.num_readers, "node_id": self.node_id}))
            deadline = time.monotonic() + timeout_s
            for connected in range(self.num_readers):
                try:
                    listener.settimeout(max(deadline - time.monotonic(), 0.001))
                    sock, _ = listener.accept()
                    try:
                        sock.settimeout(max(deadline - time.monotonic(), 0.001))  # its hello, then blocking reads
                        index, local = struct.unpack("<qq", _recv_exactly(sock, 16))
                        sock.settimeout(None)
                        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                    except BaseException:
                        sock.close()
                        raise
                except TimeoutError:
                    raise TimeoutError(f"message queue {self.name}: {connected} of {self.num_readers} readers "
                                       f"connected within {timeout_s:g} s") from None
                self.readers[index] = (sock, bool(local))

    @property
    def num_tcp_readers(self) -> int:
        return sum(not local for _, local in self.readers)

    def enqueue(self, obj: Any) -> None:
        """Broadcast `obj`; raises BrokenPipeError/ConnectionError if a reader is gone."""
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        self.seq += 1
        in_ring = len(data) <= self.slot_bytes and any(local for _, local in self.readers)
        if in_ring:
            self._wait_for_slot()
            offset = self._header_bytes + (self.seq % self.num_slots) * self.slot_bytes
            self.ring[offset : offset + len(data)] = data
        for sock, local in self.readers:
            shared = in_ring and local
            sock.sendall(_HEADER.pack(self.seq, len(data), int(shared)) + (b"" if shared else data))

    def _wait_for_slot(self) -> None:
        # The slot last held message seq - num_slots; every local reader must have read it.
        oldest = self.seq - self.num_slots
        local = [i for i, (_, is_local) in enumerate(self.readers) if is_local]
        while any(self.read_seq[i] < oldest for i in local):
            time.sleep(0.0002)  # rare: only when a reader lags num_slots messages

    def close(self) -> None:
        for reader in self.readers:
            if reader is not None:
                reader[0].close()
        self.read_seq = None
        if self.ring is not None:
            self.ring.close()
        self.path.unlink(missing_ok=True)


class MessageQueueReader:
    def __init__(self, store: dist.Store, name: str, index: int, node_id: str | None = None) -> None:
        """`node_id`: this reader's node as the launcher names it; None: the writer's (one host's launcher)."""
        info = json.loads(store.get(f"{name}/mq"))
        self.index = index
        self.num_slots, self.slot_bytes = info["num_slots"], info["slot_bytes"]
        self.ring = None
        if node_id is None or node_id == info["node_id"]:
            try:
                with open(info["path"], "r+b") as f:
                    self.ring = mmap.mmap(f.fileno(), 0)
            except FileNotFoundError:  # a container of its own on the node: the socket serves as well
                logger.warning("step queue %s: reader %d is on the writer's node but cannot open its ring %s; "
                               "reading every payload over the socket", name, index, info["path"])
        self._header_bytes = 8 * max(info["num_readers"], 1)
        self.read_seq = (None if self.ring is None
                         else np.frombuffer(self.ring, dtype=np.int64, count=max(info["num_readers"], 1)))
        self.sock = socket.create_connection((info["host"], info["port"]))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock.sendall(struct.pack("<qq", index, int(self.ring is not None)))

    def dequeue(self) -> Any:
        """The next message; blocks until it comes. Raises EOFError when the writer is gone."""
        seq, size, in_ring = _HEADER.unpack(_recv_exactly(self.sock, _HEADER.size))
        if in_ring:
            offset = self._header_bytes + (seq % self.num_slots) * self.slot_bytes
            data = self.ring[offset : offset + size]
            self.read_seq[self.index] = seq
        else:
            data = _recv_exactly(self.sock, size)
        return pickle.loads(data)

    def close(self) -> None:
        self.sock.close()
        self.read_seq = None
        if self.ring is not None:
            self.ring.close()
