"""IngressRouter: the prefix router for an app whose engine replicas serve clients themselves
(AppArgs.direct_streaming). Ray Serve 2.60's ingress request router: for each request HAProxy posts the
body to /internal/route here and forwards the request to the replica whose host and port come back, so
streams still skip the ingress process. The prompt is tokenized and hashed here as OpenAIIngress would,
and the prefix router ranks replicas on the same block hashes; a body it cannot read (the replica will
answer its error) is routed by load."""

# No `from __future__ import annotations`: Serve rebuilds the route methods' signatures for FastAPI, which
# must then read `request: Request` as the class, not a string it can no longer resolve.

import json

from fastapi import FastAPI, HTTPException, Request
from pydantic import ValidationError
from ray import serve
from ray.serve.handle import DeploymentHandle

from engine.core.prepared_request import PreparedRequest
from engine.sampling_params import SamplingParams
from serve_app.app_args import AppArgs
from serve_app.errors import APIError
from serve_app.ingress import ClientFrontend
from serve_app.protocol.anthropic import MessagesRequest
from serve_app.protocol.openai import ChatCompletionRequest, CompletionRequest
from serve_app.routing.ray_router import SENT_OUT_OF_BAND

router_app = FastAPI()


@serve.deployment(name="IngressRouter", ray_actor_options={"num_cpus": 0}, max_ongoing_requests=1024)
@serve.ingress(router_app)
class IngressRouter:
    def __init__(self, engine: DeploymentHandle, args: dict) -> None:
        self.engine = engine
        self.frontend = ClientFrontend()  # its tokenizer, chat template and block hashing; it never calls the engine
        self.frontend.serve_clients(AppArgs.model_validate(args), engine)

    @router_app.post("/internal/route")
    async def route(self, request: Request) -> dict:
        routed = await self.engine_request(await request.body())
        try:
            async with self.engine.choose_replica(*([routed] if routed else []), _reserve=False,
                                                  **{SENT_OUT_OF_BAND: True}) as selection:
                replica = selection._replica
                endpoint = replica.backend_http_endpoint
        except Exception as e:  # noqa: BLE001 - HAProxy answers 503 for any non-200
            raise HTTPException(503, f"no engine replica to route to: {e}") from e
        if endpoint is None:
            raise HTTPException(503, f"engine replica {selection.replica_id} serves no HTTP")
        return {"host": endpoint[0], "port": endpoint[1], "replica_id": replica.replica_id.to_full_id_str()}

    async def engine_request(self, body: bytes) -> PreparedRequest | None:
        """What OpenAIIngress would send an engine replica for this body, as far as routing reads it (block
        hashes, adapter); None when it is not a request we can read."""
        try:
            data = json.loads(body)
            openai = self.frontend.openai
            if not isinstance(data, dict):
                return None
            if "prompt" in data:
                req = CompletionRequest.model_validate(data)
                prompt = (await openai.completion_prompts(req))[0]
            elif "messages" in data:
                try:
                    req = ChatCompletionRequest.model_validate(data)
                except ValidationError:
                    req = self.frontend.anthropic.chat_request(MessagesRequest.model_validate(data))
                prompt = await openai.chat_prompt(req)
            else:
                return None
            return await openai.engine_request("route", prompt, SamplingParams(max_tokens=1), req)
        except (ValueError, APIError):  # pydantic.ValidationError is a ValueError
            return None
