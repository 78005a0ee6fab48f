"""The multiproc launcher: the ranks other than the driver's as processes on this host (engine/frontend/processes.py;
offline `LLM`, `AsyncLLM`, tests). It hosts the rendezvous store; its processes die with it (daemonic)."""

from __future__ import annotations

import datetime
import multiprocessing
import uuid

import torch.distributed as dist

from engine.config import EngineConfig
from engine.distributed import ParallelLayout
from engine.executor.base import WorkerLauncher
from engine.executor.worker import Rendezvous, rank_error, run_worker
from engine.frontend.processes import process_context

_HOST = "127.0.0.1"


class ProcessLauncher(WorkerLauncher):
    def __init__(self) -> None:
        self.store: dist.TCPStore | None = None
        self.rendezvous: Rendezvous | None = None
        self.processes: list[multiprocessing.Process] = []
        self._failure: str | None = None  # kept after shutdown

    def launch(self, config: EngineConfig, rendezvous_timeout_s: float) -> Rendezvous:
        self.store = dist.TCPStore(_HOST, 0, is_master=True, wait_for_workers=False,
                                   timeout=datetime.timedelta(seconds=rendezvous_timeout_s))
        layout = ParallelLayout(config.tensor_parallel_size, config.pipeline_parallel_size)
        first_gpu = config.first_device_index  # past the GPUs of the DP ranks before it, on this host
        rendezvous = Rendezvous(_HOST, self.store.port, f"pagedserve-{uuid.uuid4().hex[:12]}", layout,
                                rendezvous_timeout_s, driver_device_index=first_gpu + layout.output_rank)
        self.rendezvous = rendezvous
        ranks_on_host = layout.world_size * config.data_parallel_size
        ctx = process_context()
        try:
            for rank in range(layout.world_size):
                if rank == layout.output_rank:
                    continue
                # On one host, rank r runs on GPU r (rank_device); the driver on GPU output_rank.
                process = ctx.Process(target=run_worker,
                                      args=(config, rendezvous, rank, first_gpu + rank, ranks_on_host),
                                      name=f"pagedserve-rank-{rank}", daemon=True)
                process.start()
                self.processes.append(process)
        except BaseException:
            self.shutdown()
            raise
        return rendezvous

    def failure(self) -> str | None:
        if self._failure is None:
            for process in self.processes:
                if not process.is_alive():
                    rank = int(process.name.rsplit("-", 1)[1])
                    error = rank_error(self.store, self.rendezvous, rank)
                    self._failure = f"worker process of rank {rank} exited (code {process.exitcode})" + (
                        f": {error}" if error else "")
                    break
        return self._failure

    def shutdown(self) -> None:
        for process in self.processes:
            process.join(2.0)  # told to stop through the step queue; a hung one is killed
            if process.is_alive():
                process.kill()
                process.join(1.0)
        self.processes = []
        self.store = None
