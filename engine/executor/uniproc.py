"""The single-rank executor: the model runs in the driver's process, with no collectives (but for a DP rank's
MoE layers: their EP and DP groups span the data-parallel group's engines)."""

from __future__ import annotations

import datetime

import torch

from engine.config import EngineConfig
from engine.distributed import ParallelLayout, init_parallel_groups
from engine.executor.base import Executor
from engine.executor.worker import INIT_TIMEOUT, Worker, data_parallel_place, start_rank
from engine.model_spec import ModelSpec


class UniProcExecutor(Executor):
    def __init__(self, config: EngineConfig, spec: ModelSpec, device: torch.device,
                 extra_bytes_per_block: int = 0) -> None:
        super().__init__()
        start_rank(device)
        groups = None
        place = data_parallel_place(config)
        if place is not None:
            groups = init_parallel_groups(ParallelLayout(), 0, None, device, INIT_TIMEOUT, place)
            groups.set_timeout(datetime.timedelta(seconds=config.step_timeout_s))
        self.driver_worker = Worker(config, spec, device, groups)
        self.num_blocks = self.driver_worker.num_kv_blocks(extra_bytes_per_block)
        if self.num_blocks < 2:
            raise ValueError("kv_cache_memory_gb: the budget holds less than 2 KV blocks; raise it")
        self.driver_worker.init_kv_cache(self.num_blocks)
