"""Moving a request's KV cache between engines (disaggregated prefill and decode): the connector
interface (vLLM V1's scheduler-side / worker-side split) and the shared-memory connector that stages KV
in files, which a transport (serve_app/disaggregation/transfer.py: Ray's object store) carries between
hosts."""

from engine.kv_transfer.config import KVTransferConfig

__all__ = ["KVTransferConfig"]  # the connectors: engine.kv_transfer.base / .factory (they import torch)
