"""The HTTP surface: FastAPI routes over the ingress's serving objects, the error handlers that turn
every failure into an OpenAI (or, on /v1/messages, Anthropic) error object, and API-key checks. Streams
go out through serve_app/sse.py."""

from __future__ import annotations

import hmac
import logging
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException

from engine.frontend.input_processor import text_chars
from serve_app.errors import APIError, from_exception, from_http_exception, from_validation_errors
from serve_app.openai_serving import tokenize_off_loop_if_large
from serve_app.protocol.openai import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorResponse,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
)
from serve_app.sse import OPENAI_DONE, sse_event, sse_response, sse_stream
from serve_app.tracing import TracingMiddleware

logger = logging.getLogger(__name__)

VERSION = "0.1.0"
_ERRORS = {status: {"model": ErrorResponse} for status in (400, 401, 404, 429, 500, 503)}


def route_path(request: Request) -> str:
    """The path below the application's route prefix."""
    return request.url.path.removeprefix(request.scope.get("root_path", "").rstrip("/"))


def _is_anthropic(request: Request) -> bool:
    return route_path(request).startswith("/v1/messages")


def error_response(request: Request, error: APIError) -> JSONResponse:
    body = error.anthropic_body() if _is_anthropic(request) else error.openai_body()
    return JSONResponse(body, status_code=error.status, headers=error.headers())


def json_response(model: BaseModel) -> Response:
    return Response(model.model_dump_json(), media_type="application/json")


async def stream_response(chunks: AsyncIterator[BaseModel]) -> StreamingResponse:
    """Start a stream only once its first chunk exists, so that errors up to then (overload, bad
    input found by the replica) still get a proper status code."""
    first = await anext(chunks, None)

    async def events():
        if first is not None:
            yield None, first
            async for chunk in chunks:
                yield None, chunk

    return sse_response(sse_stream(events(), lambda error: sse_event(error.openai_body()), last=OPENAI_DONE))


class BodySizeLimit:
    """Refuses a request body over `limit` bytes with 413 before it is parsed: by its Content-Length, or
    while a chunked body arrives (then the body read so far is replayed to the app)."""

    def __init__(self, app, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None:
            if declared.isdigit() and int(declared) > self.limit:
                return await self._reject(scope, receive, send)
            return await self.app(scope, receive, send)
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] != "http.request":  # the client left
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            more = message.get("more_body", False)
            if size > self.limit:
                return await self._reject(scope, receive, send)
        replay = [{"type": "http.request", "body": b"".join(chunks), "more_body": False}]

        async def replayed():
            return replay.pop() if replay else await receive()

        await self.app(scope, replayed, send)

    async def _reject(self, scope, receive, send) -> None:
        error = APIError(413, f"the request body exceeds {self.limit} bytes (AppArgs.max_request_body_bytes)",
                         code="request_too_large")
        await error_response(Request(scope), error)(scope, receive, send)


class APIKeyCheck:
    """/v1/* needs `Authorization: Bearer <key>` (or Anthropic's `x-api-key`) with one of `keys`. A plain
    ASGI middleware, installed only when keys are set: Starlette's @app.middleware("http") would route
    every streamed chunk of every request through a memory stream and a task of its own."""

    def __init__(self, app, keys: list[bytes]) -> None:
        self.app, self.keys = app, keys

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            request = Request(scope)
            if route_path(request).startswith("/v1"):
                auth = request.headers.get("authorization", "")
                token = (auth[7:] if auth[:7].lower() == "bearer " else request.headers.get("x-api-key", "")).encode()
                ok = False
                for key in self.keys:  # constant time per key, and every key is compared
                    ok |= hmac.compare_digest(token, key)
                if not ok:
                    error = APIError(401, "invalid or missing API key", code="invalid_api_key")
                    return await error_response(request, error)(scope, receive, send)
        await self.app(scope, receive, send)


def build_http_app(ingress) -> FastAPI:
    app = FastAPI(title="pagedserve", version=VERSION,
                  description="OpenAI- and Anthropic-compatible LLM serving on Ray Serve.")
    serving = ingress.openai
    api_keys = [k.encode() for k in ingress.args.resolve_api_keys()]  # fails the replica if api_keys_env is unset
    if api_keys:
        app.add_middleware(APIKeyCheck, keys=api_keys)
    app.add_middleware(BodySizeLimit, limit=ingress.args.max_request_body_bytes)
    app.add_middleware(TracingMiddleware)  # outermost: the request span covers auth failures too

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return error_response(request, exc)

    @app.exception_handler(HTTPException)
    async def _http_error(request: Request, exc: HTTPException):
        error = from_http_exception(exc.status_code, str(exc.detail), request.method, route_path(request))
        response = error_response(request, error)
        response.headers.update(exc.headers or {})  # 405's Allow
        return response

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        return error_response(request, from_validation_errors(exc.errors()))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        error = from_exception(exc)
        if error.status >= 500:
            logger.exception("request failed", exc_info=exc)
        return error_response(request, error)


    @app.post("/v1/completions", response_model=CompletionResponse, responses=_ERRORS,
              summary="Text completion (streamed as server-sent events when stream=true)")
    async def create_completion(body: CompletionRequest):
        result = await serving.completions(body)
        return await stream_response(result) if body.stream else json_response(result)

    @app.post("/v1/chat/completions", response_model=ChatCompletionResponse, responses=_ERRORS,
              summary="Chat completion (streamed as server-sent events when stream=true)")
    async def create_chat_completion(body: ChatCompletionRequest):
        result = await serving.chat(body)
        return await stream_response(result) if body.stream else json_response(result)

    @app.get("/v1/models", response_model=ModelList, summary="The served model and its LoRA adapters")
    async def list_models():
        return ModelList(data=serving.model_cards())

    @app.post("/tokenize", response_model=TokenizeResponse, responses=_ERRORS, summary="Tokenize a prompt or chat")
    async def tokenize(body: TokenizeRequest):
        serving.check_model(body.model)
        try:
            if body.prompt is not None:
                serving.processor.check_prompt_length("prompt", len(body.prompt))
                tokens = await tokenize_off_loop_if_large(len(body.prompt), serving.tokenizer.encode, body.prompt,
                                                          add_special_tokens=body.add_special_tokens)
            else:
                messages = [{"role": m.role, "content": m.text()} for m in body.messages]
                tokens = await tokenize_off_loop_if_large(text_chars(messages), serving.processor.apply_chat_template,
                                                          messages, body.add_generation_prompt)
        except ValueError as e:
            raise from_exception(e) from e
        return TokenizeResponse(tokens=tokens, count=len(tokens), max_model_len=serving.processor.max_model_len)

    @app.post("/detokenize", response_model=DetokenizeResponse, responses=_ERRORS, summary="Detokenize token ids")
    async def detokenize(body: DetokenizeRequest):
        serving.check_model(body.model)
        vocab = serving.processor.model_config.vocab_size
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            raise APIError(400, f"tokens: {bad[:5]} are outside the vocabulary [0, {vocab})", param="tokens",
                           code="invalid_value")
        return DetokenizeResponse(prompt=serving.tokenizer.decode(body.tokens))

    @app.get("/health", summary="200 when every engine replica answers healthy, 503 otherwise")
    async def health():
        if await ingress.engine_healthy():
            return Response(status_code=200)
        return error_response_plain(APIError(503, "the engine is unhealthy", code="engine_unhealthy"))

    @app.get("/version", summary="pagedserve version")
    async def version():
        return {"version": VERSION}

    for extra in getattr(ingress, "extra_routes", ()):
        extra(app)
    app.openapi = _without_422(app.openapi)
    return app


def _without_422(openapi):
    """FastAPI documents a 422 on every route with a body; invalid bodies get 400 here (OpenAI's status)."""

    def schema() -> dict:
        spec = openapi()  # FastAPI caches it: the edit below happens once
        for operations in spec["paths"].values():
            for operation in operations.values():
                operation.get("responses", {}).pop("422", None)
        return spec

    return schema


def error_response_plain(error: APIError) -> JSONResponse:
    return JSONResponse(error.openai_body(), status_code=error.status, headers=error.headers())
