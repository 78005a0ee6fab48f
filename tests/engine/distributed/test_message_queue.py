"""The step queue (engine/distributed/message_queue.py): a reader on the writer's node, as the launcher names
nodes, reads payloads from the shared-memory ring; one on another node reads them over its socket even where the
ring's file is visible (two Ray nodes on one machine share /dev/shm), small payloads and large ones alike."""

from __future__ import annotations

import threading

import torch.distributed as dist

from engine.distributed.message_queue import MessageQueueReader, MessageQueueWriter


def test_the_launchers_node_ids_decide_ring_or_socket():
    store, made = dist.HashStore(), {}
    thread = threading.Thread(target=lambda: made.setdefault(
        "writer", MessageQueueWriter(store, "q", 3, "127.0.0.1", slot_bytes=4096, node_id="node-a")))
    thread.start()
    readers = [MessageQueueReader(store, "q", 0, "node-a"), MessageQueueReader(store, "q", 1, "node-b"),
               MessageQueueReader(store, "q", 2)]  # None: the writer's node (a one-host launcher)
    thread.join()
    writer = made["writer"]
    try:
        assert [r.ring is not None for r in readers] == [True, False, True]
        assert [local for _, local in writer.readers] == [True, False, True]
        for message in ({"step": 1}, {"step": 2, "blob": b"x" * 10_000}, {"step": 3}):  # the blob outgrows a slot
            writer.enqueue(message)
            assert [r.dequeue() for r in readers] == [message] * 3
    finally:
        for r in readers:
            r.close()
        writer.close()
