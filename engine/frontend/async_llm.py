"""AsyncLLM: the engine behind an asyncio API, for servers.

The engine core's step loop (engine/core/engine_loop.py) runs off the event loop: on a thread of this
process, or, with `EngineConfig.multiprocess`, in a process of its own (what servers want: it keeps its own
GIL). Callers never touch engine state: `generate` validates and tokenizes on the caller's thread, then
hands the request to the loop as a command; token ids come back once per step, and the text is made here
(OutputProcessor, as in vLLM V1: off the loop every request waits on), on the thread that receives them,
which also tells the core which samples a stop string ended. Outputs reach each event loop with one
`call_soon_threadsafe`; a stream whose consumer lags gets its deltas merged, never one message per token.

Failure model: a request that fails on its own (while sampling it, say) ends with RequestFailedError and
the engine goes on; an error the engine cannot pin on requests is fatal: every in-flight stream fails
with EngineDeadError at once, `is_healthy()` turns False, and new requests are refused."""

from __future__ import annotations

import asyncio
import gc
import logging
import queue
import threading
import time
import uuid
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from engine.config import EngineConfig
from engine.core.engine_loop import run_engine_loop
from engine.core.prepared_request import PreparedRequest
from engine.errors import EngineDeadError, EngineOverloadedError, RequestFailedError
from engine.frontend.input_processor import InputProcessor
from engine.frontend.output_processor import OutputProcessor
from engine.frontend.processes import start_engine_process
from engine.lora.request import LoRARequest
from engine.outputs import PoolingRequestOutput, RequestOutput, merge_deltas
from engine.pooling.params import PoolingParams
from engine.sampling_params import RequestOutputKind, SamplingParams

if TYPE_CHECKING:  # the engine (and torch) is imported where it runs: this process only with multiprocess off
    from engine.executor import Rendezvous, WorkerLauncher

logger = logging.getLogger(__name__)


@dataclass
class _Stream:
    """Outputs of one request on its consumer's event loop (touched only from that loop)."""

    loop: asyncio.AbstractEventLoop
    deltas: bool  # merge queued outputs (delta kind), or keep the latest (cumulative views)
    items: list = field(default_factory=list)
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    finished: bool = False

    def put(self, item: RequestOutput | BaseException) -> None:
        self.items.append(item)
        self.ready.set()

    async def get(self) -> RequestOutput:
        while not self.items:
            self.ready.clear()
            await self.ready.wait()
        items, self.items = self.items, []
        error = next((i for i in items if isinstance(i, BaseException)), None)
        if error is not None:
            raise error
        return merge_deltas(items) if self.deltas else items[-1]


class AsyncLLM:
    """`AsyncLLM(EngineConfig(model="pagedserve-tiny"))`, then `async for out in llm.generate(...)`."""

    def __init__(self, config: EngineConfig, launcher: WorkerLauncher | None = None) -> None:
        """`launcher`: who starts the ranks of a multi-rank engine (the serving app passes its Ray launcher);
        by default worker processes on this host. With `multiprocess` the launcher runs here and the engine
        process attaches to the workers: a daemonic engine process could not start processes itself."""
        if config.data_parallel_size > 1 and (not config.multiprocess or config.data_parallel_master is None):
            # A DP rank's loop sleeps on its command pipe and its wave connection at once: a process of its own.
            raise ValueError("data_parallel_size: AsyncLLM runs one DP rank of a group whose store someone hosts "
                             "(data_parallel_master, set by the serving app), with multiprocess=True; offline, "
                             "use LLM, which starts every rank")
        self.config = config
        self._launcher = launcher
        self._streams: dict[str, _Stream] = {}
        self._lock = threading.Lock()  # guards _streams and _num_pending_adds
        self._num_pending_adds = 0
        self._dead: EngineDeadError | None = None
        self._stopping = False
        self.cache_summary = b""  # packed uint64 short hashes of the cached blocks (for routers)
        self.processor = InputProcessor.from_config(config)
        # Touched only by the thread that receives the core's outputs (_on_event); requests reach it through
        # _added, which that thread drains before each step's outputs (an add is queued before it is sent).
        self.output_processor = OutputProcessor(self.processor.tokenizer)
        self._added: queue.SimpleQueue[PreparedRequest] = queue.SimpleQueue()
        rendezvous = None
        if config.world_size > 1 and (config.multiprocess or launcher is not None):
            from engine.model_spec import check_config

            check_config(config, self.processor.model_config)  # before any worker starts for it
            if self._launcher is None:
                from engine.executor.multiproc import ProcessLauncher

                self._launcher = ProcessLauncher()
            rendezvous = self._launcher.launch(config, config.step_timeout_s)
        try:  # the workers are up: a failure from here on stops them
            if config.multiprocess:
                self.core = None  # lives in the engine process
                self._start_process(rendezvous)
            else:
                from engine.core.engine_core import EngineCore
                from engine.model_spec import ModelSpec

                self.core = EngineCore(config, ModelSpec.resolve(config), self.processor.tokenizer, rendezvous)
        except BaseException:
            if self._launcher is not None:
                self._launcher.shutdown()
            raise
        if self.core is not None:
            self.stats = self.core.get_stats()
            self._commands: queue.SimpleQueue = queue.SimpleQueue()
            self._thread = threading.Thread(target=self._run_thread, name="pagedserve-engine", daemon=True)
        # A full garbage collection walks every object, holding the GIL for as long; after loading a
        # model that is >100 ms of a frozen event loop. Exempt everything that exists by now.
        gc.collect()
        gc.freeze()
        self._thread.start()

    def _start_process(self, rendezvous: Rendezvous | None) -> None:
        self._process, self._commands_out, self._events = start_engine_process(
            self.config, rendezvous, self.processor.tokenizer, "pagedserve-engine-core")
        self._send_lock = threading.Lock()
        try:
            while not self._events.poll(0.5):  # ("ready", stats) comes, or ("dead", why) if loading failed
                if self._launcher is not None and self._launcher.failure() is not None:
                    self._launcher.shutdown()  # closes the store under the engine process, which then gives up
            kind, payload = self._events.recv()
        except EOFError:  # it died without a word (killed, or crashed in native code)
            self._process.join(5)
            kind, payload = "dead", f"the engine process exited (code {self._process.exitcode}) while loading"
        except BaseException:
            self._process.kill()
            raise
        if kind != "ready":
            self._process.join(5)
            raise payload if isinstance(payload, ValueError) else RuntimeError(payload)
        self.stats = payload
        self._thread = threading.Thread(target=self._read_process_events, name="pagedserve-engine-events", daemon=True)

    def _send(self, command: tuple) -> None:
        if self.core is not None:
            self._commands.put(command)
            return
        try:
            with self._send_lock:
                self._commands_out.send(command)
        except (BrokenPipeError, OSError):  # the engine process is gone; the reader reports it
            pass

    @property
    def tokenizer(self):
        return self.processor.tokenizer

    def is_healthy(self) -> bool:
        return self._dead is None and self._thread.is_alive() and self.worker_failure() is None

    @property
    def stopping(self) -> bool:
        """stop_admitting() or shutdown() was called: the engine is on its way out on purpose."""
        return self._stopping

    def worker_failure(self) -> str | None:
        """Why a rank of a multi-rank engine is gone (the engine itself notices at its next step), or None."""
        if self._launcher is not None:
            return self._launcher.failure()
        return self.core.check_health() if self.core is not None else None

    @property
    def num_in_flight(self) -> int:
        with self._lock:
            return len(self._streams)

    async def generate(
        self,
        prompt: str | list[int] | PreparedRequest,
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        kv_transfer_params: dict | None = None,
        lora_request: LoRARequest | None = None,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Stream a request's outputs: deltas (new token ids, new text, new logprobs) unless
        `sampling_params.output_kind` says otherwise; the last one has `finished` set. Raises ValueError
        for bad input, EngineOverloadedError when the waiting queue is full, EngineDeadError after a
        fatal error, RequestFailedError if this request fails. Cancelling the consumer aborts it.
        `lora_request`: the adapter to run with (a bad adapter raises ValueError, the engine goes on).
        `prompt` may be a PreparedRequest (an ingress validated, tokenized and hashed it): it is taken as it
        is, with none of the other arguments."""
        if self._dead is not None:
            raise self._dead
        if isinstance(prompt, PreparedRequest):
            given = (sampling_params, request_id, priority, cache_salt, kv_transfer_params, lora_request)
            if given != (None, None, 0, None, None, None):
                raise ValueError("prompt: a PreparedRequest carries its own parameters; pass it alone")
        else:
            rid = request_id if request_id is not None else uuid.uuid4().hex
            prompt = self.processor.prepare_request(prompt, sampling_params, rid, priority=priority,
                                                    cache_salt=cache_salt, kv_transfer_params=kv_transfer_params,
                                                    lora_request=lora_request)
        params = _deltas_by_default(prompt.sampling_params)
        request_id = prompt.request_id
        # arrival_time is a monotonic clock's reading, meaningless in another process or on another host.
        prepared = replace(prompt, sampling_params=params, arrival_time=time.monotonic())
        stream = _Stream(asyncio.get_running_loop(), params.output_kind is RequestOutputKind.DELTA)
        self._register(prepared, stream)
        try:
            while True:
                output = await stream.get()
                if output.error is not None:
                    stream.finished = True
                    raise RequestFailedError(f"request {request_id} failed: {output.error}")
                if output.finished:
                    stream.finished = True
                yield output
                if output.finished:
                    return
        finally:
            with self._lock:
                self._streams.pop(request_id, None)
            if not stream.finished:  # cancelled, closed early, or failed: free its KV blocks
                self._send(("abort", request_id))

    async def encode(self, prompt: str | list[int], pooling_params: PoolingParams | None = None,
                     request_id: str | None = None, priority: int = 0) -> AsyncGenerator[PoolingRequestOutput, None]:
        """An embedding request's one output (an engine started with task='embed'); vLLM's AsyncLLM.encode.
        Raises as `generate` does."""
        rid = request_id if request_id is not None else uuid.uuid4().hex
        prepared = self.processor.prepare_request(prompt, request_id=rid, priority=priority,
                                                  pooling_params=pooling_params or PoolingParams())
        async for output in self.generate(prepared):
            yield output

    def _register(self, prepared: PreparedRequest, stream: _Stream) -> None:
        limit = self.config.max_waiting_requests
        with self._lock:
            if self._stopping:
                raise EngineOverloadedError("the engine is shutting down and admits no new requests")
            if prepared.request_id in self._streams:
                raise ValueError(f"request_id: {prepared.request_id!r} is already in flight")
            if limit is not None and self.stats.num_waiting + self._num_pending_adds >= limit:
                raise EngineOverloadedError(
                    f"{self.stats.num_waiting + self._num_pending_adds} requests are already waiting "
                    f"(max_waiting_requests={limit}); retry later"
                )
            self._streams[prepared.request_id] = stream
            self._num_pending_adds += 1
        self._added.put(prepared)
        self._send(("add", prepared))

    async def abort(self, request_id: str) -> None:
        """Abort a request; its stream ends with an `abort` finish reason. Unknown ids are ignored."""
        self._send(("abort", request_id))

    def release_kv(self, request_id: str) -> None:
        """Disaggregated prefill: the consumer has this request's KV; free the blocks held for it."""
        self._send(("release_kv", request_id))

    def stop_admitting(self) -> None:
        """Refuse new requests (EngineOverloadedError) while in-flight ones finish: the first half of a
        graceful drain."""
        with self._lock:
            self._stopping = True

    def shutdown(self, timeout_s: float = 5.0) -> None:
        """Stop the engine loop; in-flight streams fail with EngineDeadError."""
        self.stop_admitting()
        self._send(("shutdown", None))
        if self.core is None:
            self._process.join(timeout_s)
            if self._process.is_alive():
                self._process.kill()
        self._thread.join(timeout_s)
        if self.core is not None:
            self.core.shutdown()
        if self._launcher is not None:
            self._launcher.shutdown()

    # --- the engine loop's side ----------------------------------------------------------------------

    def _run_thread(self) -> None:
        def next_command(timeout: float):
            try:
                return self._commands.get(timeout=timeout) if timeout > 0 else self._commands.get_nowait()
            except queue.Empty:
                return None

        try:
            run_engine_loop(self.core, next_command, self._on_event)
        except BaseException:  # noqa: BLE001 - already reported through a "dead" event
            return
        self._fail_all(EngineDeadError("the engine was shut down"))

    def _read_process_events(self) -> None:
        while True:
            try:
                event = self._events.recv()
            except (EOFError, OSError):
                code = self._process.exitcode
                self._fail_all(EngineDeadError(f"the engine process exited (code {code})"))
                return
            self._on_event(event)
            if event[0] == "dead":
                return

    def _on_event(self, event: tuple) -> None:
        kind = event[0]
        if kind in ("outputs", "rejected"):
            while not self._added.empty():
                self.output_processor.add_request(self._added.get_nowait())
        if kind == "outputs":
            _, core_outputs, stats, num_adds = event
            self.stats = stats
            if num_adds:
                with self._lock:
                    self._num_pending_adds -= num_adds
            if core_outputs:
                outputs, stopped = self.output_processor.process(core_outputs)
                if stopped:
                    self._send(("stop", stopped))
                self._publish(outputs)
        elif kind == "rejected":
            self.output_processor.discard(event[1])
            self._deliver_error(event[1], event[2])
        elif kind == "cache_summary":
            self.cache_summary = event[1]
        elif kind == "dead":
            self._fail_all(EngineDeadError(event[1]))

    def _publish(self, outputs: list[RequestOutput]) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[_Stream, RequestOutput]]] = {}
        with self._lock:
            for output in outputs:
                stream = self._streams.get(output.request_id)
                if stream is not None:
                    by_loop.setdefault(stream.loop, []).append((stream, output))
        for loop, items in by_loop.items():
            _call_soon(loop, _deliver, items)

    def _deliver_error(self, request_id: str, error: BaseException) -> None:
        with self._lock:
            stream = self._streams.get(request_id)
        if stream is not None:
            _call_soon(stream.loop, stream.put, error)

    def _fail_all(self, error: EngineDeadError) -> None:
        self._dead = error
        with self._lock:
            streams = list(self._streams.values())
        for stream in streams:
            _call_soon(stream.loop, stream.put, error)


def _deliver(items: list[tuple[_Stream, RequestOutput]]) -> None:
    for stream, output in items:
        stream.put(output)


def _call_soon(loop: asyncio.AbstractEventLoop, fn, *args) -> None:
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:  # the consumer's loop is closed: nobody is listening any more
        pass


def _deltas_by_default(params: SamplingParams) -> SamplingParams:
    """A stream sends deltas unless its caller chose another output_kind."""
    if "output_kind" in params.model_fields_set:
        return params
    return params.model_copy(update={"output_kind": RequestOutputKind.DELTA})
