"""LLMServer: the engine replica deployment. Each replica owns one AsyncLLM and streams its deltas back
to the ingress; it reports load for autoscaling and routing, exports engine metrics, and drains before
it stops (Serve waits for in-flight calls, up to graceful_shutdown_timeout_s)."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections import Counter
from collections.abc import AsyncGenerator
from contextlib import nullcontext
from dataclasses import dataclass

import ray
from opentelemetry import trace
from opentelemetry.trace import SpanKind
from ray import serve
from ray.serve.handle import DeploymentHandle

from engine.config import EngineConfig
from engine.core.prepared_request import PreparedRequest
from engine.frontend.async_llm import AsyncLLM
from engine.kv_transfer import KVTransferConfig
from engine.outputs import PoolingRequestOutput, RequestOutput, StepTiming
from engine.stats import EngineStats
from serve_app import replica_context, tracing
from serve_app.cpu_utilization import CpuUtilization
from serve_app.disaggregation.orchestrator import PDSettings, PrefillOrchestrator
from serve_app.disaggregation.transfer import KVFetchRequest, KVFetchResult, PrefillResult, put_staged
from serve_app.metrics import DisaggregationMetrics, EngineMetrics, RecentTTFT

logger = logging.getLogger(__name__)

_METRICS_PERIOD_S = 1.0
_UTILIZATION_PERIOD_S = 1.0  # long enough that a moment of quiet or of work does not flip streams
_ENGINE_WATCH_PERIOD_S = 0.5
_DEAD_ENGINE_ERROR_GRACE_S = 2.0  # longest wait for the streams of a dead engine to send their error


@dataclass(frozen=True)
class StreamPacing:
    """When streams coalesce tokens on purpose (AppArgs.stream_coalesce_*): while the CPU utilization is at
    or above `cpu_utilization` (None: never), each stream rests `interval_s` between messages. Every message
    costs CPU in this replica, the ingress and HAProxy; on a saturated machine that CPU comes out of the
    engine's steps, so fewer, fuller messages serve more tokens. Below it, every step's token leaves at once."""

    cpu_utilization: float | None = 0.95
    interval_s: float = 0.25


@serve.deployment(
    name="LLMServer",
    ray_actor_options={"num_cpus": 0},
    graceful_shutdown_wait_loop_s=0.5,
    health_check_period_s=5,
)
class LLMServer:
    # async: a data-parallel rank awaits its rank from the assigner deployment (a blocking call would stall the
    # replica's event loop, where the handle's own routing runs). Serve awaits an async constructor.
    async def __init__(self, engine_config: dict, served_model_name: str, tracing_config: dict | None = None,
                       pacing: StreamPacing | None = None, worker_bundle: dict[str, float] | None = None,
                       prefill: DeploymentHandle | None = None, pd_settings: dict | None = None,
                       rank_assigner: DeploymentHandle | None = None) -> None:
        """`worker_bundle`: with the ray backend, the resources of each rank's placement-group bundle; the
        engine's other ranks start as actors there (serve_app/ray_workers.py). `prefill`: this replica
        decodes for a prefill pool (disaggregated prefill/decode, serve_app/disaggregation), with
        `pd_settings` (PDSettings fields). `rank_assigner`: a data-parallel group's (serve_app/data_parallel.py)."""
        self.replica_id = replica_id = replica_context.replica_id()
        self.model_name = served_model_name
        self.tracer = tracing.setup_tracing(
            tracing.TracingConfig(**(tracing_config or {})),
            {"pagedserve.component": "engine", "gen_ai.request.model": served_model_name,
             "pagedserve.replica": replica_id},
        )
        config = EngineConfig(**engine_config)
        if config.data_parallel_size > 1:  # one rank of a data-parallel group: which, and where the group meets
            if rank_assigner is None:
                raise ValueError("engine.data_parallel_size > 1: the replica needs the app's rank assigner "
                                 "(build the app with serve_app.app:build_app)")
            rank, master = await rank_assigner.assign.remote(replica_id)
            config = config.model_copy(update={"data_parallel_rank": rank, "data_parallel_master": master})
        launcher = None
        if config.world_size > 1 and config.distributed_executor_backend == "ray":
            from serve_app.ray_workers import RayWorkerLauncher  # torch's TCPStore: only a multi-rank replica

            launcher = RayWorkerLauncher(worker_bundle or {}, name=f"pagedserve-{replica_id}")
        self.llm = AsyncLLM(config, launcher)
        try:
            self.metrics = EngineMetrics(served_model_name, replica_id)
            self.staging_dir = (config.kv_transfer_config or KVTransferConfig()).directory
            self.pd = None
            if prefill is not None:
                settings = PDSettings(**(pd_settings or {}), block_size=config.block_size, staging_dir=self.staging_dir)
                self.pd = PrefillOrchestrator(prefill, settings, DisaggregationMetrics(served_model_name, replica_id))
        except BaseException:
            self.llm.shutdown()  # Serve retries a failed replica: its engine process and ranks must not outlive it
            raise
        self.ttft = RecentTTFT()
        self._prefilled: dict[str, tuple[dict, float]] = {}  # prefill pool: request id -> (KV params, lease end)
        self.lora_request_counts: Counter[str] = Counter()  # requests per LoRA adapter since start
        self._metrics_task = asyncio.get_event_loop().create_task(self._export_metrics())
        self.pacing = pacing or StreamPacing()
        self.cpu = CpuUtilization()
        self.saturated = False  # the CPU is saturated: streams coalesce (StreamPacing)
        self._cpu_task = asyncio.get_event_loop().create_task(self._watch_cpu())
        self._engine_task = asyncio.get_event_loop().create_task(self._watch_engine())

    async def generate(self, request: PreparedRequest) -> AsyncGenerator[RequestOutput, None]:
        """Stream delta RequestOutputs, one message per engine step that advanced the request: a token
        leaves as soon as the engine made it. Tokens travel together only when this stream's consumer
        lags (AsyncLLM merges the deltas that queued up meanwhile) or the CPU is saturated (StreamPacing:
        the stream rests between messages), never by a budget. What crosses to the ingress is slimmed:
        the prompt's token ids only in the first message (the ingress tokenized them; it needs their
        count once) and no engine timings (metrics and traces are made here). Cancellation (the caller
        went away) aborts the request and frees its KV blocks."""
        request_trace = _RequestTrace(self, request) if self.tracer is not None else None
        first = True
        remote = None
        if request.lora_request is not None:
            self.lora_request_counts[request.lora_request.lora_name] += 1
            self.metrics.count_lora_request(request.lora_request.lora_name)
        try:
            if self.pd is not None:  # decode pool: prefill on the prefill pool when that pays
                with trace.use_span(request_trace.span, end_on_exit=False) if request_trace else nullcontext():
                    remote = await self.pd.remote_kv(request)
            prepared = dataclasses.replace(request, kv_transfer_params=remote.kv_transfer_params) if remote else request
            async for output in self.llm.generate(prepared):  # prepared by the ingress: not again
                if remote is not None:  # the prompt's cache hits happened on the prefill replica
                    output.num_cached_tokens = max(output.num_cached_tokens, remote.cached_tokens)
                self.metrics.observe(output)
                self.ttft.observe(output)
                if request_trace is not None:
                    request_trace.observe(output)
                yield dataclasses.replace(output, metrics=None,
                                          prompt_token_ids=output.prompt_token_ids if first else [])
                first = False
                if self.saturated and not output.finished:
                    await asyncio.sleep(self.pacing.interval_s)
        except BaseException as e:
            if request_trace is not None:
                request_trace.failed(e)
            raise
        finally:
            if remote is not None:  # loaded (the engine deleted it) or never: either way spent
                self.pd.discard(remote)
            if request_trace is not None:
                request_trace.end()

    async def prefill(self, request: PreparedRequest) -> PrefillResult:
        """Prefill pool: compute the prompt's KV (and one token, thrown away) and hold it for the decode
        replica that asked, under the engine's lease, until it fetches it."""
        final = None
        producing = dataclasses.replace(request, kv_transfer_params={"do_remote_decode": True})
        async for output in self.llm.generate(producing):
            final = output
            self.metrics.observe(output)
            self.ttft.observe(output)
        params = final.kv_transfer_params if final is not None else None
        if params is None:
            raise RuntimeError("the engine produced no KV to transfer: is this replica's engine a kv_producer?")
        now = time.monotonic()
        for rid in [rid for rid, (_, end) in self._prefilled.items() if end < now]:
            del self._prefilled[rid]  # their leases ran out in the engine too
        self._prefilled[request.request_id] = (params, now + params["lease_s"])
        return PrefillResult(params, self.replica_id, request.request_id)

    async def fetch_kv(self, fetch: KVFetchRequest) -> KVFetchResult:
        """Prefill pool (pinned here by the router): the held KV into the object store; then the engine may
        free it. Raises when nothing is held any more (fetched already, or the lease ran out)."""
        params, lease_end = self._prefilled.pop(fetch.request_id, (None, 0.0))
        if params is None or time.monotonic() > lease_end:
            self.llm.release_kv(fetch.request_id)
            raise FileNotFoundError(f"no KV is held for request {fetch.request_id}: its lease ran out")
        try:
            return await asyncio.get_running_loop().run_in_executor(None, put_staged, params, self.staging_dir)
        finally:
            self.llm.release_kv(fetch.request_id)

    def release_kv(self, fetch: KVFetchRequest) -> None:
        """Prefill pool: the decode side gave up on this KV; free it now rather than at the lease's end."""
        self._prefilled.pop(fetch.request_id, None)
        self.llm.release_kv(fetch.request_id)

    def pd_stats(self) -> dict[str, float]:
        """A decode replica's disaggregation counters: remote prefills, local ones by reason, transfers."""
        return dict(self.pd.metrics.totals) if self.pd is not None else {}

    def set_pd_faults(self, faults: dict | None) -> None:
        """Test hook of a decode replica: inject a transfer failure or a pause before the fetch
        (PDSettings.faults), or switch on_transfer_failure."""
        if self.pd is not None:
            self.pd.settings.faults = dict(faults or {})

    def stats(self) -> EngineStats:
        return self.llm.stats

    def identity(self) -> str:
        """This replica's id: tests use it to check that a bad request restarted nothing."""
        return self.replica_id

    def is_healthy(self) -> bool:
        return self.llm.is_healthy()

    def num_in_flight(self) -> int:
        return self.llm.num_in_flight

    async def check_health(self) -> None:
        """Serve calls this periodically; raising marks the replica unhealthy and Serve replaces it."""
        if not self.llm.is_healthy():
            raise RuntimeError("the engine is dead")

    def record_autoscaling_stats(self) -> dict[str, float]:
        s = self.llm.stats
        return {"kv_cache_usage": s.kv_cache_usage, "num_waiting": float(s.num_waiting),
                "num_running": float(s.num_running), "queued_prefill_tokens": float(s.queued_prefill_tokens),
                "ttft_s": self.ttft.p90()}

    def record_routing_stats(self) -> dict:
        """Load, the prefix cache's block summary (packed uint64 short hashes) and the LoRA adapters the
        engine holds (host memory or device slots), for the prefix router."""
        s = self.llm.stats
        return {"kv_cache_usage": s.kv_cache_usage, "num_waiting": s.num_waiting, "num_running": s.num_running,
                "cached_blocks": self.llm.cache_summary, "lora_adapters": list(s.loaded_loras),
                "reported_at": time.time()}

    def lora_requests(self) -> dict[str, int]:
        """Requests this replica served per LoRA adapter since it started."""
        return dict(self.lora_request_counts)

    async def _watch_cpu(self) -> None:
        threshold = self.pacing.cpu_utilization
        if threshold is None or self.cpu.source is None:
            return  # never saturated as far as streams know: they coalesce only when their consumer lags
        while True:
            await asyncio.sleep(_UTILIZATION_PERIOD_S)
            share = self.cpu.sample()
            self.saturated = share is not None and share >= threshold

    async def _watch_engine(self) -> None:
        """A dead engine (a fatal error, a rank's worker gone) never recovers. Serve would replace this replica
        only after check_health failed three times in a row (~15 s at a 5 s period); ending the actor here, once
        the streams in flight have sent their error, makes Serve replace it at its next check."""
        while self.llm.is_healthy():
            await asyncio.sleep(_ENGINE_WATCH_PERIOD_S)
        if self.llm.stopping:
            return  # shut down on purpose: Serve is stopping this replica already
        deadline = time.monotonic() + _DEAD_ENGINE_ERROR_GRACE_S
        while self.llm.num_in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        await asyncio.sleep(0.2)  # the last error events leave this process
        logger.error("the engine is dead (%s); ending replica %s so that Serve replaces it",
                     self.llm.worker_failure() or "engine loop stopped", self.replica_id)
        ray.kill(ray.get_runtime_context().current_actor, no_restart=True)

    async def _export_metrics(self) -> None:
        while True:
            try:
                self.metrics.update(self.llm.stats)
            except Exception:  # noqa: BLE001 - metrics must never take the replica down
                logger.exception("exporting engine metrics failed")
            await asyncio.sleep(_METRICS_PERIOD_S)

    def __del__(self) -> None:
        # Serve only stops a replica after its in-flight calls finished or the graceful timeout passed.
        llm = getattr(self, "llm", None)
        if llm is not None:
            llm.shutdown()
        tracing.flush()


class _RequestTrace:
    """The replica's `llm_request` span of one request (vLLM's name and gen_ai.* attributes), child of
    the ingress span carried in the PreparedRequest. Its timeline comes from the engine's own timestamps."""

    def __init__(self, server: LLMServer, request: PreparedRequest) -> None:
        params = request.sampling_params
        self.server, self.request = server, request
        lora = request.lora_request
        self.span = server.tracer.start_span(
            "llm_request", context=tracing.extract(request.trace_context), kind=SpanKind.SERVER,
            attributes={
                "gen_ai.request.model": lora.lora_name if lora is not None else server.model_name,
                "pagedserve.lora.name": lora.lora_name if lora is not None else "",
                "gen_ai.request.id": request.request_id,
                "gen_ai.response.id": request.request_id, "gen_ai.request.max_tokens": params.max_tokens or 0,
                "gen_ai.request.temperature": params.temperature, "gen_ai.request.top_p": params.top_p,
                "gen_ai.request.n": params.n, "gen_ai.usage.input_tokens": len(request.prompt_token_ids),
            },
        )
        self.last: RequestOutput | None = None
        self.finish_reasons: dict[int, str] = {}
        self.text: dict[int, str] = {}
        self.record_content = tracing.config().record_content
        self.time_in_model_execute = 0.0

    def observe(self, output: RequestOutput) -> None:
        self.last = output
        if output.metrics is not None:
            for step in output.metrics.steps:  # only with tracing.detailed (EngineConfig.collect_step_timings)
                self._step_span(step)
        if isinstance(output, PoolingRequestOutput):  # an embedding: no samples, no text
            self.finish_reasons.update(enumerate(output.finish_reasons))
            return
        for c in output.outputs:
            if c.finish_reason is not None:
                self.finish_reasons[c.index] = c.finish_reason
            if self.record_content:
                self.text[c.index] = self.text.get(c.index, "") + c.text

    def _step_span(self, step: StepTiming) -> None:
        self.time_in_model_execute += step.end_time - step.start_time
        span = self.server.tracer.start_span(
            "engine_step", context=trace.set_span_in_context(self.span), start_time=tracing.epoch_ns(step.start_time),
            attributes={"pagedserve.step.num_tokens": step.num_tokens, "pagedserve.step.batch_size": step.batch_size,
                        "pagedserve.step.batch_tokens": step.batch_tokens},
        )
        if step.encoder_seconds:  # the step began by encoding this request's images
            encoder = self.server.tracer.start_span("vision_encoder", context=trace.set_span_in_context(span),
                                                    start_time=tracing.epoch_ns(step.start_time))
            encoder.end(end_time=tracing.epoch_ns(step.start_time + step.encoder_seconds))
        span.end(end_time=tracing.epoch_ns(step.end_time))

    def failed(self, error: BaseException) -> None:
        if isinstance(error, (GeneratorExit, asyncio.CancelledError)):
            self.span.add_event("aborted")  # the caller went away; the engine aborts the request
        else:
            tracing.fail(self.span, error)

    def end(self) -> None:
        span, out = self.span, self.last
        m = out.metrics if out is not None else None
        if m is not None:
            span.add_event("queued", timestamp=tracing.epoch_ns(m.arrival_time))
            for name, t in (("scheduled", m.first_scheduled_time), ("first_token", m.first_token_time)):
                if t is not None:
                    span.add_event(name, timestamp=tracing.epoch_ns(t))
            for t in m.preempted_times:
                span.add_event("preempted", timestamp=tracing.epoch_ns(t))
            latencies = {"gen_ai.latency.time_in_queue": m.queue_time,
                         "gen_ai.latency.time_to_first_token": m.time_to_first_token,
                         "gen_ai.latency.e2e": m.e2e_latency}
            span.set_attributes({k: v for k, v in latencies.items() if v is not None})
            span.set_attribute("gen_ai.usage.output_tokens", m.num_generation_tokens)
            if self.time_in_model_execute:
                span.set_attribute("gen_ai.latency.time_in_model_execute", self.time_in_model_execute)
            if m.finished_time is not None:
                span.add_event("finished", timestamp=tracing.epoch_ns(m.finished_time))
        if out is not None:
            span.set_attribute("gen_ai.usage.cache_read_input_tokens", out.num_cached_tokens)
        span.set_attribute("gen_ai.response.finish_reasons",
                           [self.finish_reasons[i] for i in sorted(self.finish_reasons)])
        if self.record_content:
            prompt = self.server.llm.tokenizer.decode(self.request.prompt_token_ids)
            span.set_attributes({"gen_ai.prompt": prompt,
                                 "gen_ai.completion": [self.text[i] for i in sorted(self.text)]})
        span.end()
