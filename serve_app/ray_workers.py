"""The Ray launcher of a multi-rank engine's workers: Ray actors in the Serve replica's placement group.

Process topology of a replica with N = tensor_parallel_size x pipeline_parallel_size ranks:
- The replica actor sits in bundle 0 (Serve puts it there). It spawns the engine process (AsyncLLM's
  `multiprocess`), which holds the scheduler and is the driver: the output rank, TP rank 0 of the last
  stage. The engine process is no Ray process and, being daemonic, can start nothing; so
- the replica, before spawning it, starts the other N - 1 ranks as actors of this module, one per
  bundle 1..N-1 (`PlacementGroupSchedulingStrategy`), and hosts the TCPStore where all ranks meet.
- From then on the engine process drives the actors directly: each step's input goes once through the
  shared-memory step queue (a socket to actors on other hosts), tensors through gloo or NCCL. No step
  crosses a Ray call; Ray only places, watches and kills the workers.
A worker actor's `run` call returns only when the engine stops; its ObjectRef resolving early means the
actor died or failed, which makes the replica unhealthy (Serve replaces it). Killing the replica kills
the actors it owns."""

from __future__ import annotations

import datetime
import uuid

import ray
import torch.distributed as dist
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from engine.config import EngineConfig
from engine.distributed import ParallelLayout
from engine.executor import Rendezvous, WorkerLauncher
from engine.executor.worker import rank_error, run_worker


@ray.remote
class EngineRankWorker:
    """One rank of a replica's engine (its model shard and KV cache), for the life of the engine."""

    def run(self, config: EngineConfig, rendezvous: Rendezvous, rank: int, ranks_on_host: int) -> None:
        # Ray shows an actor only its own GPU (CUDA_VISIBLE_DEVICES), as device 0 (rank_device); likewise
        # the replica's, where the driver runs (Rendezvous.driver_device_index 0).
        # The node id Ray placed this actor on decides how it reads the step queue (shared memory on the driver's).
        run_worker(config, rendezvous, rank, 0, ranks_on_host, ray.get_runtime_context().get_node_id())


class RayWorkerLauncher(WorkerLauncher):
    def __init__(self, bundle: dict[str, float], name: str) -> None:
        """`bundle`: each worker's resources (its placement-group bundle's); `name` prefixes its actors."""
        self.bundle, self.name = bundle, name
        self.store: dist.TCPStore | None = None
        self.actors: list = []
        self.runs: list[ray.ObjectRef] = []
        self.ranks: list[int] = []
        self.rendezvous: Rendezvous | None = None
        self._failure: str | None = None  # kept after shutdown

    def launch(self, config: EngineConfig, rendezvous_timeout_s: float) -> Rendezvous:
        placement_group = ray.util.get_current_placement_group()
        if placement_group is None:
            raise RuntimeError("the ray backend starts a replica's workers in its placement group; this replica has "
                               "none")
        host = ray.util.get_node_ip_address()
        self.store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False,
                                   timeout=datetime.timedelta(seconds=rendezvous_timeout_s))
        layout = ParallelLayout(config.tensor_parallel_size, config.pipeline_parallel_size)
        rendezvous = Rendezvous(host, self.store.port, f"pagedserve-{uuid.uuid4().hex[:12]}", layout,
                                rendezvous_timeout_s, node_id=ray.get_runtime_context().get_node_id())
        self.rendezvous = rendezvous
        workers = [rank for rank in range(layout.world_size) if rank != layout.output_rank]
        try:
            for bundle_index, rank in enumerate(workers, start=1):  # bundle 0 holds the replica and the driver
                actor = EngineRankWorker.options(
                    name=f"{self.name}-rank{rank}",
                    num_cpus=self.bundle.get("CPU", 0),
                    num_gpus=self.bundle.get("GPU", 0),
                    scheduling_strategy=PlacementGroupSchedulingStrategy(placement_group,
                                                                         placement_group_bundle_index=bundle_index),
                ).remote()
                self.actors.append(actor)
                self.ranks.append(rank)
                self.runs.append(actor.run.remote(config, rendezvous, rank, layout.world_size))
        except BaseException:
            self.shutdown()
            raise
        return rendezvous

    def failure(self) -> str | None:
        if self._failure is None and self.runs:
            done, _ = ray.wait(self.runs, num_returns=len(self.runs), timeout=0)
            for ref in done:
                rank = self.ranks[self.runs.index(ref)]
                why = rank_error(self.store, self.rendezvous, rank)
                if why is None:
                    try:
                        ray.get(ref, timeout=0)
                        why = "it stopped"
                    except Exception as e:  # noqa: BLE001 - the actor died
                        why = f"{type(e).__name__}: {str(e).splitlines()[0]}"
                self._failure = f"the worker actor of rank {rank} is gone: {why}"
                break
        return self._failure

    def shutdown(self) -> None:
        for actor in self.actors:
            ray.kill(actor)
        self.actors, self.runs, self.ranks = [], [], []
        self.store = None
