"""The app's front: HTTP routes for clients, and the same operations as methods for Python callers
holding a DeploymentHandle to the app (they take and return the same pydantic models as HTTP).

    handle = serve.get_app_handle("pagedserve").options(stream=True)
    async for response in handle.chat.remote(ChatCompletionRequest(messages=[...])):
        ...  # one ChatCompletionResponse, or ChatCompletionChunks when stream=True

The methods are async generators (Ray Serve streams them), so callers always use `stream=True`. A caller
tracing with OpenTelemetry passes its context as a W3C carrier, `trace_context=` (e.g. from
opentelemetry.propagate.inject); the call's spans then join the caller's trace."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator

from ray import serve
from ray.serve.handle import DeploymentHandle

from engine.frontend.input_processor import InputProcessor
from engine.multimodal.media import MediaSettings
from serve_app import embeddings_serving, lora_routes, replica_context, responses_serving, tracing
from serve_app.anthropic_serving import AnthropicServing, add_routes
from serve_app.app_args import AppArgs
from serve_app.embeddings_serving import EmbeddingsServing
from serve_app.http_api import build_http_app
from serve_app.lora_registry import LoRARegistry
from serve_app.openai_serving import OpenAIServing
from serve_app.protocol.anthropic import MessagesRequest
from serve_app.protocol.embeddings import EmbeddingRequest
from serve_app.protocol.openai import ChatCompletionRequest, CompletionRequest
from serve_app.protocol.responses import ResponsesRequest
from serve_app.response_store import StoreLimits, shared_store
from serve_app.responses_serving import ResponsesServing

logger = logging.getLogger(__name__)

_HEALTH_TIMEOUT_S = 5.0


class ClientFrontend:
    """What serves clients: the HTTP routes of every protocol (OpenAI, Anthropic, LoRA management: http_api.py,
    anthropic_serving.py, lora_routes.py) and the same operations as methods for
    DeploymentHandle callers, over an engine with LLMServer's `generate` (a handle, or this process's
    engine); a subclass answers `engine_healthy()` for /health. OpenAIIngress is one in front of the engine
    replicas; with AppArgs.direct_streaming every engine replica is one itself (serve_app/engine_ingress.py)."""

    def serve_clients(self, args: AppArgs, engine) -> None:
        self.args = args
        # Requests go to the decode pool when prefill and decode are disaggregated: validate for its engines.
        engine_config = args.engine_config("decode" if args.disaggregation else None)
        self.processor = InputProcessor.from_config(engine_config)
        self.lora = None
        if args.serves_lora:  # the adapters' registry: lora_modules, and runtime loads under lora_root
            self.lora = LoRARegistry(args.name, self.processor.model_config, engine_config.max_lora_rank,
                                     args.lora_modules, args.lora_root)
        media = MediaSettings(tuple(args.allowed_media_domains), args.allowed_local_media_path,
                              args.media_fetch_timeout_s, args.max_media_bytes, args.mm_preprocess_workers)
        self.openai = OpenAIServing(self.processor, args.name, engine, args.tool_call_parser, self.lora, media,
                                    args.reasoning_parser)
        self.anthropic = AnthropicServing(self.openai)
        limits = StoreLimits(args.responses_store_max_entries, args.responses_store_max_bytes,
                             args.responses_store_ttl_s)
        self.responses_api = ResponsesServing(self.openai, lambda: shared_store(_app_name(args), limits))
        self.embeddings_api = EmbeddingsServing(self.openai)
        self.extra_routes = [lambda app: add_routes(app, self.anthropic),
                             lambda app: responses_serving.add_routes(app, self.responses_api),
                             lambda app: embeddings_serving.add_routes(app, self.embeddings_api)]
        if args.allow_runtime_lora_updating:
            self.extra_routes.append(lambda app: lora_routes.add_routes(app, self.lora))

    def __serve_build_asgi_app__(self):
        return build_http_app(self)

    # --- Python API (DeploymentHandle) ----------------------------------------------------------------

    async def completions(self, request: CompletionRequest | dict, trace_context: dict | None = None) -> AsyncGenerator:
        with tracing.handle_span("completions", trace_context):
            request = CompletionRequest.model_validate(request)
            result = await self.openai.completions(request)
            async for item in _as_stream(result, request.stream):
                yield item

    async def chat(self, request: ChatCompletionRequest | dict, trace_context: dict | None = None) -> AsyncGenerator:
        with tracing.handle_span("chat", trace_context):
            request = ChatCompletionRequest.model_validate(request)
            result = await self.openai.chat(request)
            async for item in _as_stream(result, request.stream):
                yield item

    async def responses(self, request: ResponsesRequest | dict, trace_context: dict | None = None) -> AsyncGenerator:
        """OpenAI Responses: one Response, or (event name, data) pairs when stream=True."""
        with tracing.handle_span("responses", trace_context):
            request = ResponsesRequest.model_validate(request)
            result = await self.responses_api.create(request)
            async for item in _as_stream(result, request.stream):
                yield item

    async def embeddings(self, request: EmbeddingRequest | dict, trace_context: dict | None = None) -> AsyncGenerator:
        """Embeddings (an app whose engine runs task 'embed'): one EmbeddingResponse."""
        with tracing.handle_span("embeddings", trace_context):
            yield await self.embeddings_api.create(EmbeddingRequest.model_validate(request))

    async def messages(self, request: MessagesRequest | dict, trace_context: dict | None = None) -> AsyncGenerator:
        """Anthropic Messages: one MessagesResponse, or (event name, data) pairs when stream=True."""
        with tracing.handle_span("messages", trace_context):
            request = MessagesRequest.model_validate(request)
            result = await self.anthropic.messages(request)
            async for item in _as_stream(result, request.stream):
                yield item


@serve.deployment(name="OpenAIIngress", ray_actor_options={"num_cpus": 0}, max_ongoing_requests=1024,
                  graceful_shutdown_wait_loop_s=0.5)  # a drain ends within 0.5 s of its last stream
@serve.ingress()
class OpenAIIngress(ClientFrontend):
    def __init__(self, engine: DeploymentHandle, args: dict) -> None:
        args = AppArgs.model_validate(args)
        tracing.setup_tracing(args.tracing, {"pagedserve.component": "ingress", "gen_ai.request.model": args.name,
                                             "pagedserve.replica": replica_context.replica_id()})
        self.engine = engine
        self.serve_clients(args, engine.options(stream=True))

    def __del__(self) -> None:
        tracing.flush()  # Serve calls this once the replica's requests are done

    async def engine_healthy(self) -> bool:
        """Every engine replica answers healthy in time (Serve replaces one that does not)."""
        try:
            results = await asyncio.wait_for(self.engine.broadcast("is_healthy").results_async(), _HEALTH_TIMEOUT_S)
        except Exception:  # noqa: BLE001 - any failure to answer is unhealthy
            return False
        return bool(results) and all(results)


def _app_name(args: AppArgs) -> str:
    """The Serve application this replica belongs to (its store is the app's), else the served model's name."""
    try:
        return serve.get_replica_context().app_name
    except Exception:  # noqa: BLE001 - not in a replica (a test's frontend)
        return args.name


async def _as_stream(result, stream: bool):
    if not stream:
        yield result
        return
    async for chunk in result:
        yield chunk
