"""DataParallelEngine: the offline `LLM`'s engine when `data_parallel_size` > 1 (MoE models; vLLM's DP attention
+ EP). It hosts the group's store and starts its DP ranks, each a whole engine (an EngineCore: scheduler, KV cache
and its tensor_parallel_size ranks) in an engine process of its own that runs the engine loop
(engine/core/engine_loop.py; the ranks' lockstep is engine/distributed/data_parallel.py). It sends each request
to the least loaded rank (fewest unfinished requests; ties to the lowest rank), makes the text of every rank's
outputs here (OutputProcessor) and has LLMEngine's interface, so that `LLM` drives it alike.

Every step needs every rank (their MoE layers hold a shard of the experts each): a rank that fails, dies or
cannot start stops the whole group, and the caller gets WorkerFailedError; nothing waits on a dead rank."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable
from multiprocessing import connection

from engine.config import EngineConfig
from engine.core.prepared_request import PreparedRequest
from engine.distributed.data_parallel import host_store
from engine.errors import WorkerFailedError
from engine.executor.multiproc import ProcessLauncher
from engine.frontend.input_processor import InputProcessor, PreparesRequests
from engine.frontend.output_processor import OutputProcessor
from engine.frontend.processes import start_engine_process
from engine.lora.request import LoRARequest
from engine.model_spec import ModelSpec
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from engine.stats import EngineStats
from engine.tokenizer import tokenizer_for

logger = logging.getLogger(__name__)

_PER_ENGINE = ("block_size", "kv_bytes_per_token")  # the same on every rank: not summed


class DataParallelEngine(PreparesRequests):
    """Not thread-safe: one thread drives it (LLM's caller), as LLMEngine."""

    def __init__(self, config: EngineConfig) -> None:
        spec = ModelSpec.resolve(config)  # the config checked against the model before anything starts
        self.config = config
        self.model_config, self.max_model_len = spec.model_config, spec.max_model_len
        self.tokenizer = tokenizer_for(config, spec.path)
        self.input_processor = InputProcessor(config, self.model_config, self.tokenizer, self.max_model_len,
                                              spec.path)
        self.output_processor = OutputProcessor(self.tokenizer)
        size = config.data_parallel_size
        self._launchers: list[ProcessLauncher] = []
        self._processes: list = []
        self._commands: list[connection.Connection] = []
        self._events: list[connection.Connection] = []
        self._stats: list[EngineStats | None] = [None] * size
        self._rank_of: dict[str, int] = {}  # unfinished request -> its DP rank
        self._load = [0] * size  # unfinished requests per rank
        self._pending: list[RequestOutput] = []  # outputs received, not yet returned by `step`
        self._failure: WorkerFailedError | None = None
        self._closed = False
        self._store, address = host_store()
        try:
            for rank in range(size):
                rank_config = config.model_copy(update={"data_parallel_rank": rank, "data_parallel_master": address,
                                                        "data_parallel_rank_local": rank})
                rendezvous = None
                if config.world_size > 1:  # a daemonic engine process cannot start its ranks: they start here
                    launcher = ProcessLauncher()
                    self._launchers.append(launcher)
                    rendezvous = launcher.launch(rank_config, config.step_timeout_s)
                process, commands_out, events_in = start_engine_process(rank_config, rendezvous, self.tokenizer,
                                                                        f"pagedserve-dp-rank-{rank}")
                self._processes.append(process)
                self._commands.append(commands_out)
                self._events.append(events_in)
            self._wait_ready()
        except BaseException:
            self.shutdown(timeout_s=1.0)
            raise

    def _wait_ready(self) -> None:
        pending = set(range(len(self._events)))
        while pending:
            for conn in connection.wait([self._events[r] for r in pending], 0.5):
                rank = self._events.index(conn)
                try:
                    kind, payload = conn.recv()
                except (EOFError, OSError):
                    self._processes[rank].join(2.0)
                    raise RuntimeError(f"data_parallel_size: the engine process of DP rank {rank} exited (code "
                                       f"{self._processes[rank].exitcode}) while loading") from None
                if kind == "dead":  # a ValueError: a config the model cannot run
                    raise payload if isinstance(payload, ValueError) else RuntimeError(f"DP rank {rank}: {payload}")
                if kind == "ready":
                    self._stats[rank] = payload
                    pending.discard(rank)
            failure = self._launcher_failure()
            if failure is not None:
                raise RuntimeError(f"data_parallel_size: a rank failed while loading: {failure}")

    # --- requests ----------------------------------------------------------------------------------------

    def add_prepared(self, prepared: PreparedRequest, data_parallel_rank: int | None = None) -> int:
        """Send a prepared request to a DP rank (by default the least loaded); returns the rank."""
        self._check_alive()
        size = len(self._commands)
        rank = min(range(size), key=self._load.__getitem__) if data_parallel_rank is None else data_parallel_rank
        if not 0 <= rank < size:
            raise ValueError(f"data_parallel_rank: {rank} is not a rank of this group of {size}")
        if prepared.request_id in self._rank_of:
            raise ValueError(f"request_id: {prepared.request_id!r} is already in flight")
        self.output_processor.add_request(prepared)
        self._rank_of[prepared.request_id] = rank
        self._load[rank] += 1
        self._send(rank, ("add", prepared))
        return rank

    def add_request(self, prompt: str | list[int], sampling_params: SamplingParams | None = None, **kwargs) -> str:
        prepared = self.prepare_request(prompt, sampling_params, **kwargs)
        self.add_prepared(prepared)
        return prepared.request_id

    def abort_request(self, request_ids: str | Iterable[str]) -> list[RequestOutput]:
        """Abort requests by id; their final outputs come from later `step`s. Unknown ids are ignored."""
        for rid in [request_ids] if isinstance(request_ids, str) else request_ids:
            if rid in self._rank_of:
                self._send(self._rank_of[rid], ("abort", rid))
        return []

    def step(self) -> list[RequestOutput]:
        """Wait for the next outputs of any rank (a rank's step, or its reply to a command); returns the
        RequestOutputs they make. Raises WorkerFailedError (the group stopped) when a rank failed or died."""
        self._check_alive()
        while not self._pending and not self._receive(1.0):
            failure = self._launcher_failure()
            if failure is not None:
                self._fail(None, failure)
        outputs, self._pending = self._pending, []
        return outputs

    def _receive(self, timeout: float) -> bool:
        """Take the events the ranks sent (waiting up to `timeout` for one); their outputs go to `_pending`."""
        ready = connection.wait(self._events, timeout)
        for conn in ready:
            rank = self._events.index(conn)
            try:
                event = conn.recv()
            except (EOFError, OSError):
                self._processes[rank].join(1.0)
                self._fail(rank, f"its engine process exited (code {self._processes[rank].exitcode})")
            self._pending.extend(self._on_event(rank, event))
        return bool(ready)

    def _on_event(self, rank: int, event: tuple) -> list[RequestOutput]:
        kind = event[0]
        if kind == "outputs":
            _, core_outputs, stats, _ = event
            self._stats[rank] = stats
            if not core_outputs:
                return []
            outputs, stopped = self.output_processor.process(core_outputs)
            if stopped:
                self._send(rank, ("stop", stopped))
            for output in outputs:
                if output.finished:
                    self._forget(output.request_id)
            return outputs
        if kind == "rejected":
            _, rid, error = event
            self.output_processor.discard(rid)
            self._forget(rid)
            raise error
        if kind == "dead":
            self._fail(rank, event[1])
        return []  # the prefix cache's summary: for routers, none here

    def _forget(self, rid: str) -> None:
        rank = self._rank_of.pop(rid, None)
        if rank is not None:
            self._load[rank] -= 1

    def has_unfinished_requests(self) -> bool:
        return bool(self._rank_of)

    @property
    def num_unfinished_requests(self) -> int:
        return len(self._rank_of)

    def add_lora(self, lora_request: LoRARequest) -> bool:
        raise ValueError("lora_request: LoRA adapters are not supported with data_parallel_size > 1 yet")

    def list_loras(self) -> set[int]:
        return set()

    # --- health, stats, shutdown -------------------------------------------------------------------------

    def _send(self, rank: int, command: tuple) -> None:
        try:
            self._commands[rank].send(command)
        except (BrokenPipeError, OSError):
            self._processes[rank].join(1.0)
            self._fail(rank, f"its engine process is gone (code {self._processes[rank].exitcode})")

    def _launcher_failure(self) -> str | None:
        for launcher in self._launchers:
            failure = launcher.failure()
            if failure is not None:
                return failure
        return None

    def _fail(self, rank: int | None, why: str) -> None:
        who = f"DP rank {rank}" if rank is not None else "a rank"
        self._failure = WorkerFailedError(
            f"{who} of the data-parallel group of {len(self._processes)} failed ({why}); every rank was stopped: each "
            "step needs every rank's experts")
        logger.error("%s", self._failure)
        self.shutdown(timeout_s=2.0)
        raise self._failure

    def _check_alive(self) -> None:
        if self._failure is not None:
            raise self._failure
        if self._closed:
            raise WorkerFailedError("the data-parallel group was shut down")

    def check_health(self) -> str | None:
        if self._failure is not None:
            return str(self._failure)
        for rank, process in enumerate(self._processes):
            if not process.is_alive():
                return f"the engine process of DP rank {rank} exited (code {process.exitcode})"
        return self._launcher_failure()

    def rank_stats(self) -> list[EngineStats]:
        """Each DP rank's latest stats (sent after a step with outputs, a command, or when it goes idle), in rank
        order."""
        self._check_alive()
        self._receive(0.0)
        return list(self._stats)

    def get_stats(self) -> EngineStats:
        """The group's: counters, loads and per-expert tokens summed over the ranks, KV usage their mean."""
        return merge_stats(self.rank_stats())

    def shutdown(self, timeout_s: float = 5.0) -> None:
        """Stop every rank's engine process and workers (idempotent)."""
        if self._closed:
            return
        self._closed = True
        for commands in self._commands:
            try:
                commands.send(("shutdown", None))
            except (BrokenPipeError, OSError):
                pass
        for process in self._processes:
            process.join(timeout_s)
            if process.is_alive():
                process.kill()
                process.join(1.0)
        for launcher in self._launchers:
            launcher.shutdown()
        for conn in self._commands + self._events:
            conn.close()
        self._store = None


def merge_stats(stats: list[EngineStats]) -> EngineStats:
    """One EngineStats for a data-parallel group's engines: numbers summed (per-engine constants kept, KV usage
    averaged), per-expert counts summed expert by expert (each rank counts the tokens it routes), names joined."""
    values = {}
    for field in dataclasses.fields(EngineStats):
        each = [getattr(s, field.name) for s in stats]
        if field.name in _PER_ENGINE:
            values[field.name] = each[0]
        elif field.name == "kv_cache_usage":
            values[field.name] = sum(each) / len(each)
        elif isinstance(each[0], (int, float)):
            values[field.name] = sum(each)
        elif each[0] and all(isinstance(v, (int, float)) for v in each[0]):
            values[field.name] = tuple(map(sum, zip(*each)))
        elif isinstance(each[0], tuple):
            values[field.name] = tuple(dict.fromkeys(v for value in each for v in value))
        else:
            values[field.name] = each[0]
    return EngineStats(**values)
