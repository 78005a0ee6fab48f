"""`POST /v1/embeddings`, for an app whose engine runs task 'embed' (engine/pooling): each input becomes one
prefill-only engine request, prepared here like any other (so the prefix router places it by its blocks), and
the vectors come back as floats or, as the openai SDK asks by default, base64 of little-endian float32."""

from __future__ import annotations

import base64

import numpy as np
from fastapi import FastAPI

from engine.outputs import PoolingRequestOutput
from engine.pooling.params import PoolingParams
from serve_app import tracing
from serve_app.errors import APIError, from_exception
from serve_app.http_api import _ERRORS, json_response
from serve_app.openai_serving import OpenAIServing
from serve_app.protocol.embeddings import Embedding, EmbeddingRequest, EmbeddingResponse, EmbeddingUsage
from serve_app.protocol.openai import new_id


class EmbeddingsServing:
    def __init__(self, openai: OpenAIServing) -> None:
        self.openai = openai

    async def create(self, req: EmbeddingRequest) -> EmbeddingResponse:
        openai = self.openai
        openai.check_task("embed", "/v1/embeddings")
        openai.check_model(req.model)
        prompts = await openai.tokenize_prompts(req.inputs, "input")
        request_id = new_id("embd")
        try:
            params = PoolingParams(dimensions=req.dimensions, normalize=req.normalize)
            requests = [openai.processor.prepare_request(
                p.token_ids, request_id=f"{request_id}-{i}", priority=req.priority, pooling_params=params,
                trace_context=tracing.inject()) for i, p in enumerate(prompts)]
        except ValueError as e:
            raise from_exception(e) from e
        vectors: dict[int, np.ndarray] = {}
        async for i, output in openai._stream(requests):
            vectors[i] = _vector(output)
        data = [Embedding(embedding=_encode(vectors[i], req.encoding_format), index=i) for i in range(len(requests))]
        num_tokens = sum(len(p.token_ids) for p in prompts)
        return EmbeddingResponse(id=request_id, model=openai.response_model(req), data=data,
                                 usage=EmbeddingUsage(prompt_tokens=num_tokens, total_tokens=num_tokens))


def _vector(output: PoolingRequestOutput) -> np.ndarray:
    if output.outputs is None:  # aborted: the engine is shutting down under it
        raise APIError(503, "the engine stopped before this embedding was done; retry", code="engine_unavailable")
    return output.outputs.data


def _encode(vector: np.ndarray, encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":
        return base64.b64encode(vector.astype("<f4").tobytes()).decode()
    return vector.tolist()


def add_routes(app: FastAPI, serving: EmbeddingsServing) -> None:
    @app.post("/v1/embeddings", response_model=EmbeddingResponse, responses=_ERRORS,
              summary="Embeddings of texts or token ids (an app whose engine runs task 'embed')")
    async def create_embeddings(body: EmbeddingRequest):
        return json_response(await serving.create(body))
