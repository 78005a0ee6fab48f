"""Executors: who runs the model of an engine. The driver (the engine's process) holds the scheduler and
the sampler and one rank of the model; an executor runs a step's forward on every rank and hands the
driver the logits.

- `uni`: one rank, in the driver's process.
- distributed (`mp`, `ray`): the driver's rank plus workers started by a WorkerLauncher: the
  multiproc launcher spawns processes (engine/executor/multiproc.py); the serving app's Ray launcher
  starts actors in the replica's placement group (serve_app/ray_workers.py). Either way the driver
  drives them the same way (engine/executor/distributed.py), so `engine/` knows nothing of Ray."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import deque
from typing import Any

import torch

from engine.config import EngineConfig
from engine.executor.model_input import ModelInput
from engine.executor.worker import Rendezvous, Worker


class Executor(ABC):
    """Steps go in with `submit` and come out, in order, with `collect`: with pipeline parallelism the
    driver submits the next batch before collecting the last one, so that earlier stages work on it
    while the driver (the last stage) finishes the one before."""

    # The driver's own rank: its model part (the last stage's, with the LM head) and KV cache.
    driver_worker: Worker
    num_blocks: int

    def __init__(self) -> None:
        self._submitted: deque[ModelInput] = deque()

    def submit(self, inp: ModelInput) -> None:
        """Start a step on the other ranks (they run it as soon as they are free)."""
        self._submitted.append(inp)

    def collect(self) -> torch.Tensor | None:
        """Run the driver's part of the oldest submitted step: the logits of its `logit_rows` (None if
        it has none). Raises WorkerFailedError when a rank failed, died or hung: the engine cannot go on."""
        return self.driver_worker.execute_model(self._submitted.popleft())

    def execute_model(self, inp: ModelInput) -> torch.Tensor | None:
        self.submit(inp)
        return self.collect()

    def collective_rpc(self, method: str, *args: Any) -> Any:
        """Run `Worker.<method>(*args)` on every rank (e.g. loading an adapter into a slot); returns the
        driver's result. The driver runs it first, so a call it refuses reaches no other rank; the others
        run it in step order, before any step submitted after it."""
        return getattr(self.driver_worker, method)(*args)

    @property
    def device(self) -> torch.device:
        """The driver rank's device: where the step's logits are, and every tensor the driver makes."""
        return self.driver_worker.device

    def weight_bytes_per_rank(self) -> dict[int, int]:
        """Bytes of weights each rank holds, as measured on its loaded model."""
        return {0: self.driver_worker.weight_bytes}

    def expert_load(self) -> list[int] | None:
        """Tokens routed to each expert so far (MoE models, the driver's layers), or None."""
        load = getattr(self.driver_worker.model, "expert_load", None)
        return load.tolist() if load is not None else None

    def step_queue_tcp_readers(self) -> int:
        """Ranks that read each step's input over TCP (on other nodes than the driver)."""
        return 0

    def check_health(self) -> str | None:
        """Why the executor cannot serve (a worker died), or None."""
        return None

    def shutdown(self) -> None:  # noqa: B027 - optional hook: an executor with no workers has nothing to stop
        """Stop every worker (idempotent)."""


class WorkerLauncher(ABC):
    """Starts the ranks of an engine other than the driver's, and hosts the store they meet at."""

    @abstractmethod
    def launch(self, config: EngineConfig, rendezvous_timeout_s: float) -> Rendezvous:
        """Start the store and the workers; they wait at the store for the driver."""

    @abstractmethod
    def failure(self) -> str | None:
        """Why a worker is gone (it died or exited), or None while all live."""

    @abstractmethod
    def shutdown(self) -> None:
        """Stop every worker and the store (idempotent)."""
