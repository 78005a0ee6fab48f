"""EngineIngress: an engine replica that serves clients itself (AppArgs.direct_streaming), Ray Serve
LLM's direct streaming. Behind HAProxy a request goes HAProxy -> engine replica -> engine process and
each stream message comes straight back, instead of crossing the ingress replica and two Ray calls each
way: on 2 cores that was ~8 ms of a lone request's TTFT and, with 64 streams at once, half or more of
the app's CPU per request outside the engine (benchmarks/results/peers.md, run 10)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator

from ray import serve

from engine.core.prepared_request import PreparedRequest
from engine.outputs import RequestOutput
from serve_app.app_args import AppArgs
from serve_app.ingress import ClientFrontend
from serve_app.llm_server import LLMServer


class _LocalStream:
    """One `generate` call in this process, with the two things OpenAIServing uses of a handle's
    streaming response: iteration, and cancel()."""

    def __init__(self, outputs: AsyncGenerator[RequestOutput, None]) -> None:
        self._outputs = outputs

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        return self._outputs

    def cancel(self) -> None:
        # Closing the generator runs generate's cleanup, which aborts the request and frees its KV blocks.
        asyncio.ensure_future(self._outputs.aclose())


class _LocalEngine:
    """This replica's LLMServer.generate, called the way OpenAIServing calls a handle's:
    `engine.options(...).generate.remote(request)`. Options only tag handle calls (an adapter's
    multiplexed_model_id); the adapter itself travels in the request."""

    def __init__(self, server: LLMServer) -> None:
        self._server = server
        self.generate = self

    def options(self, **_) -> _LocalEngine:
        return self

    def remote(self, request: PreparedRequest) -> _LocalStream:
        return _LocalStream(self._server.generate(request))


# Registered under the engine deployment's name, LLMServer: users' handles, dashboards and the manifests name the
# engine replicas so whether or not they serve clients themselves.
@serve.deployment(name="LLMServer", ray_actor_options={"num_cpus": 0}, graceful_shutdown_wait_loop_s=0.5,
                  health_check_period_s=5)
@serve.ingress()
class EngineIngress(ClientFrontend, LLMServer.func_or_class):
    async def __init__(self, engine_config: dict, served_model_name: str, tracing_config: dict | None, pacing,
                       worker_bundle: dict[str, float] | None, args: dict) -> None:
        await super().__init__(engine_config, served_model_name, tracing_config, pacing, worker_bundle)
        self.serve_clients(AppArgs.model_validate(args), _LocalEngine(self))

    async def engine_healthy(self) -> bool:
        return self.is_healthy()
