"""Runtime LoRA adapter management, vLLM's routes: `POST /v1/load_lora_adapter {lora_name, lora_path,
load_inplace}` and `POST /v1/unload_lora_adapter {lora_name}`. Served only with
`allow_runtime_lora_updating: true`, behind the API keys (they are /v1 routes), for folders under
`lora_root` only. A load validates the adapter against the base model before registering it (400 naming
the problem, an unreadable folder too: nothing reaches an engine replica); replicas read it from disk on its
first request. A registry under lora_root that cannot be read or written is the deployment's fault: 500
naming the file (serve_app/lora_registry.py RegistryUnavailable)."""

from __future__ import annotations

import asyncio

from fastapi import FastAPI
from fastapi.responses import PlainTextResponse
from pydantic import ConfigDict, Field

from engine.text_validation import ValidTextModel
from serve_app.errors import APIError, from_exception
from serve_app.lora_registry import AdapterNotFound, LoRARegistry
from serve_app.protocol.openai import ErrorResponse

_ERRORS = {status: {"model": ErrorResponse} for status in (400, 401, 404, 500)}


class LoadLoRAAdapterRequest(ValidTextModel):
    model_config = ConfigDict(extra="forbid")

    lora_name: str = Field(min_length=1, max_length=256)
    lora_path: str = Field(min_length=1, description="An adapter folder under the app's lora_root (or relative to it).")
    load_inplace: bool = Field(False, description="Replace a runtime-loaded adapter of this name with these weights.")


class UnloadLoRAAdapterRequest(ValidTextModel):
    model_config = ConfigDict(extra="forbid")

    lora_name: str = Field(min_length=1, max_length=256)
    lora_int_id: int | None = Field(None, description="Accepted for vLLM compatibility; the name decides.")


def add_routes(app: FastAPI, registry: LoRARegistry) -> None:
    @app.post("/v1/load_lora_adapter", response_class=PlainTextResponse, responses=_ERRORS,
              summary="Serve a LoRA adapter from under lora_root as a model of its own")
    async def load_lora_adapter(body: LoadLoRAAdapterRequest):
        try:  # reads and hashes the adapter's files: off the event loop
            await asyncio.to_thread(registry.load, body.lora_name, body.lora_path, body.load_inplace)
        except ValueError as e:
            raise from_exception(e) from e
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter", response_class=PlainTextResponse, responses=_ERRORS,
              summary="Stop serving a runtime-loaded LoRA adapter")
    async def unload_lora_adapter(body: UnloadLoRAAdapterRequest):
        try:
            await asyncio.to_thread(registry.unload, body.lora_name)
        except AdapterNotFound:
            raise APIError(404, f"lora_name: no LoRA adapter named `{body.lora_name}` is loaded", param="lora_name",
                           code="model_not_found") from None
        except ValueError as e:
            raise from_exception(e) from e
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")
