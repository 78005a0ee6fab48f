"""The driver's side of a multi-rank engine: the driver joins the ranks' groups as the output rank,
broadcasts each step's ModelInput once through the step queue, runs its own rank's part and returns the
logits. Workers were started by a WorkerLauncher (processes or Ray actors) and wait at the rendezvous.

Any failure while a step runs is fatal: a dead rank closes its sockets and the driver's next collective
raises at once; a hung one is caught by the groups' timeout (`step_timeout_s`). The error names the
rank and its own message when the rank could leave one in the store."""

from __future__ import annotations

import logging
import threading
from typing import Any

import torch
import torch.distributed as dist

from engine.config import EngineConfig
from engine.distributed.message_queue import MessageQueueWriter
from engine.errors import WorkerFailedError
from engine.executor.base import Executor, WorkerLauncher
from engine.executor.model_input import ModelInput
from engine.executor.worker import INIT_TIMEOUT, Rendezvous, init_rank, step_queue_name
from engine.model_spec import ModelSpec

logger = logging.getLogger(__name__)


class DistributedExecutor(Executor):
    def __init__(self, config: EngineConfig, spec: ModelSpec, rendezvous: Rendezvous, device: torch.device,
                 launcher: WorkerLauncher | None = None, extra_bytes_per_block: int = 0) -> None:
        super().__init__()
        self.rendezvous, self.launcher = rendezvous, launcher  # a launcher given here is ours to stop
        self.layout = rendezvous.layout
        self.store: dist.Store | None = None
        self.queue: MessageQueueWriter | None = None
        watchdog = _InitWatchdog(launcher) if launcher is not None else None
        try:
            self.store = rendezvous.connect()
            self.driver_worker = init_rank(config, spec, rendezvous, self.layout.output_rank, device, self.store,
                                           extra_bytes_per_block)
            # Every rank passed the setup's collectives: each is up and about to connect.
            self.queue = MessageQueueWriter(self.store, step_queue_name(rendezvous), self.layout.world_size - 1,
                                            host=rendezvous.host, timeout_s=INIT_TIMEOUT.total_seconds(),
                                            node_id=rendezvous.node_id)
        except BaseException as e:  # the workers are up: whatever happened, they go too
            failure = self._failure(e) if isinstance(e, Exception) else None
            self.shutdown()
            if failure is None or isinstance(e, ValueError):  # ValueError: a config the model cannot take
                raise
            raise failure from e
        finally:
            if watchdog is not None:
                watchdog.stop()
        self.num_blocks = self.driver_worker.attn_backend.num_blocks

    def submit(self, inp: ModelInput) -> None:
        try:
            self.queue.enqueue(("execute", inp))
        except Exception as e:
            raise self._failure(e) from e
        super().submit(inp)

    def collect(self) -> torch.Tensor | None:
        try:
            return super().collect()
        except Exception as e:  # the ranks are out of step now: nothing can be retried
            raise self._failure(e) from e

    def weight_bytes_per_rank(self) -> dict[int, int]:
        return {rank: int(self.store.get(f"weight_bytes/{rank}")) for rank in range(self.layout.world_size)}

    def collective_rpc(self, method: str, *args: Any) -> Any:
        result = super().collective_rpc(method, *args)
        try:
            self.queue.enqueue(("call", (method, args)))
        except Exception as e:
            raise self._failure(e) from e
        return result

    def step_queue_tcp_readers(self) -> int:
        return self.queue.num_tcp_readers if self.queue is not None else 0

    def check_health(self) -> str | None:
        return self.launcher.failure() if self.launcher is not None else None

    def _failure(self, error: BaseException) -> WorkerFailedError:
        reasons = []
        for rank in range(self.layout.world_size if self.store is not None else 0):
            key = f"error/{rank}"
            try:
                if self.store.check([key]):
                    reasons.append(f"rank {rank}: {self.store.get(key).decode()}")
            except Exception:  # noqa: BLE001 - the store went with its host
                break
        gone = self.launcher.failure() if self.launcher is not None else None
        if gone:
            reasons.append(gone)
        reasons.append(f"the driver saw {type(error).__name__}: {error}")
        return WorkerFailedError("a rank of this engine failed; " + "; ".join(reasons))

    def shutdown(self) -> None:
        queue, self.queue = self.queue, None
        if queue is not None:
            try:
                queue.enqueue(("stop", None))
            except OSError:  # a reader is already gone
                pass
            queue.close()
        if self.launcher is not None:
            self.launcher.shutdown()


class _InitWatchdog:
    """While the driver sets up (blocked in the groups' rendezvous, waiting for every rank), watch the
    workers: when one dies, stop the launcher, whose store then closes under the waiting driver, which
    raises at once rather than wait out the rendezvous timeout."""

    def __init__(self, launcher: WorkerLauncher, period_s: float = 0.5) -> None:
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._watch, args=(launcher, period_s), name="pagedserve-init-watchdog",
                                        daemon=True)
        self._thread.start()

    def _watch(self, launcher: WorkerLauncher, period_s: float) -> None:
        while not self._stopped.wait(period_s):
            if launcher.failure() is not None:
                launcher.shutdown()
                return

    def stop(self) -> None:
        self._stopped.set()
