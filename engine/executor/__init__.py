"""Who runs the model: the executor interface, the single-rank executor and the distributed driver, and
the multiproc launcher of worker processes (engine/executor/base.py explains the topology)."""

from __future__ import annotations

from engine.config import EngineConfig
from engine.executor.base import Executor, WorkerLauncher
from engine.executor.model_input import ModelInput
from engine.executor.worker import Rendezvous, Worker, rank_device
from engine.model_spec import ModelSpec


def create_executor(config: EngineConfig, spec: ModelSpec, rendezvous: Rendezvous | None = None,
                    extra_bytes_per_block: int = 0) -> Executor:
    """The executor of an engine: `uni` for one rank; otherwise the distributed driver, attached to
    workers a launcher already started (`rendezvous`), or to worker processes it spawns itself (`mp`). The
    driver rank's device is the executor's `driver_worker.device`."""
    if config.world_size == 1:
        from engine.executor.uniproc import UniProcExecutor

        return UniProcExecutor(config, spec, rank_device(spec.device_type, config.first_device_index),
                               extra_bytes_per_block)
    from engine.executor.distributed import DistributedExecutor

    launcher = None
    if rendezvous is None:
        if config.distributed_executor_backend == "ray":
            raise ValueError(
                "distributed_executor_backend: 'ray' workers are Ray actors that the serving app starts in its "
                "replica's placement group; offline, use 'mp'"
            )
        from engine.executor.multiproc import ProcessLauncher

        launcher = ProcessLauncher()
        rendezvous = launcher.launch(config, config.step_timeout_s)
    device = rank_device(spec.device_type, rendezvous.driver_device_index)
    return DistributedExecutor(config, spec, rendezvous, device, launcher, extra_bytes_per_block)


__all__ = ["Executor", "WorkerLauncher", "ModelInput", "Rendezvous", "Worker", "create_executor"]
