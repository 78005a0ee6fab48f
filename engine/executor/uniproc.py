"""The single-rank executor: the model runs in the driver's process, with no collectives."""

from __future__ import annotations

import torch

from engine.config import EngineConfig
from engine.executor.base import Executor
from engine.executor.worker import Worker, start_rank
from engine.model_spec import ModelSpec


class UniProcExecutor(Executor):
    def __init__(self, config: EngineConfig, spec: ModelSpec, device: torch.device,
                 extra_bytes_per_block: int = 0) -> None:
        super().__init__()
        start_rank(device)
        self.driver_worker = Worker(config, spec, device)
        self.num_blocks = self.driver_worker.num_kv_blocks(extra_bytes_per_block)
        if self.num_blocks < 2:
            raise ValueError("kv_cache_memory_gb: the budget holds less than 2 KV blocks; raise it")
        self.driver_worker.init_kv_cache(self.num_blocks)
