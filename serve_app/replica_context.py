"""Who this process is within the Serve app: the replica id names a replica in metrics, trace
resources and routing decisions."""

from __future__ import annotations

from ray import serve


def replica_id() -> str:
    """This Serve replica's unique id; "local" outside a replica (e.g. tests constructing a class)."""
    try:
        return serve.get_replica_context().replica_id.unique_id
    except Exception:  # noqa: BLE001 - Serve raises a RayServeException outside a replica
        return "local"
