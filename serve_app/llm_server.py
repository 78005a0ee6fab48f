"""LLMServer: the engine replica deployment. Each replica owns one AsyncLLM and streams its deltas back
to the ingress; it reports load for autoscaling and routing, exports engine metrics, and drains before
it stops (Serve waits for in-flight calls, up to graceful_shutdown_timeout_s)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator

from ray import serve

from engine.async_llm import AsyncLLM
from engine.config import EngineConfig
from engine.outputs import RequestOutput
from engine.stats import EngineStats
from serve_app.engine_request import EngineRequest
from serve_app.metrics import EngineMetrics

logger = logging.getLogger(__name__)

_METRICS_PERIOD_S = 1.0
_MAX_STREAM_REST_S = 0.25


@serve.deployment(
    name="LLMServer",
    ray_actor_options={"num_cpus": 0},
    graceful_shutdown_wait_loop_s=0.5,
    health_check_period_s=5,
)
class LLMServer:
    def __init__(self, engine_config: dict, served_model_name: str, stream_messages_per_s: float = 0.0) -> None:
        self.llm = AsyncLLM(EngineConfig(**engine_config))
        self.stream_messages_per_s = stream_messages_per_s
        try:
            replica_id = serve.get_replica_context().replica_id.unique_id
        except Exception:  # noqa: BLE001 - outside a Serve replica (local testing)
            replica_id = "local"
        self.replica_id = replica_id
        self.metrics = EngineMetrics(served_model_name, replica_id)
        self._metrics_task = asyncio.get_event_loop().create_task(self._export_metrics())

    async def generate(self, request: EngineRequest) -> AsyncGenerator[RequestOutput, None]:
        """Stream delta RequestOutputs. The first one leaves at once; after each later one the stream
        rests for (streams in flight / stream_messages_per_s), and the deltas the engine made meanwhile
        leave merged as one message. Every message crosses three processes at some CPU cost each, so
        this caps the replica's message rate whatever the load: a lone stream still gets every step's
        tokens, many streams get theirs a few steps at a time. Cancellation (the caller went away)
        aborts the request and frees its KV blocks."""
        async for output in self.llm.generate(
            request.prompt_token_ids,
            request.sampling_params,
            request_id=request.request_id,
            priority=request.priority,
            cache_salt=request.cache_salt,
        ):
            self.metrics.observe(output)
            yield output
            if self.stream_messages_per_s and not output.finished:
                await asyncio.sleep(min(_MAX_STREAM_REST_S, self.llm.num_in_flight / self.stream_messages_per_s))

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
        return {"kv_cache_usage": s.kv_cache_usage, "num_waiting": float(s.num_waiting), "num_running": float(s.num_running)}

    def record_routing_stats(self) -> dict:
        """Load, and the prefix cache's block summary (packed uint64 short hashes) for the prefix router."""
        s = self.llm.stats
        return {"kv_cache_usage": s.kv_cache_usage, "num_waiting": s.num_waiting, "num_running": s.num_running,
                "cached_blocks": self.llm.cache_summary, "reported_at": time.time()}

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
