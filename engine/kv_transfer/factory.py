"""Which KVConnector an engine runs, by `kv_transfer_config.kv_connector`: a registry of import paths, so
that a transport's module (and what it imports) loads only in engines that use it."""

from __future__ import annotations

import importlib
import uuid
from typing import Literal

import torch

from engine.config import EngineConfig
from engine.kv_transfer.base import KVConnector, kv_layout
from engine.models.config import ModelConfig
from engine.shm_files import owned_prefix

# kv_transfer_config.kv_connector -> "module:class" of a KVConnector subclass. A new transport adds a line
# here and its name to KVTransferConfig.kv_connector's Literal.
CONNECTORS = {"shared_memory": "engine.kv_transfer.shared_memory:SharedMemoryConnector"}


def create_kv_connector(config: EngineConfig, model_config: ModelConfig, dtype: torch.dtype,
                        role: Literal["scheduler", "worker"], rank: int = 0) -> KVConnector | None:
    """The connector of the engine's scheduler (one per engine) or of one rank; None without KV transfer."""
    transfer = config.kv_transfer_config
    if transfer is None:
        return None
    module, name = CONNECTORS[transfer.kv_connector].split(":")
    connector_class: type[KVConnector] = getattr(importlib.import_module(module), name)
    layout, stages = kv_layout(config, model_config, dtype)
    # The scheduler's id names the KV it stages: unique per engine, and owned by this process (engine/shm_files.py).
    engine_id = owned_prefix("kv") + uuid.uuid4().hex[:12] if role == "scheduler" else "worker"
    return connector_class(transfer, engine_id, layout, config.block_size, dtype, rank, stages)
