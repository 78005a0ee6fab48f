"""Structured outputs at the ingress: the format a request asks for (OpenAI's response_format, vLLM's
structured_outputs, or a tool_choice that forces a call) as the engine's StructuredOutputsParams, and
its validation with the model's tokenizer, so that a bad schema, regex or grammar is a 400 naming its
field before anything reaches a replica. The compile attempt is the same one a replica makes (cached
by the format's text here too, and run on a worker thread: a big schema never blocks the event loop)."""

from __future__ import annotations

import asyncio
import json
import threading
from typing import TYPE_CHECKING

from engine.frontend.input_processor import InputProcessor
from engine.sampling_params import StructuredOutputsParams
from engine.tokenizer import resolve_eos_token_ids
from serve_app.errors import APIError
from serve_app.protocol.openai import SamplingFields

if TYPE_CHECKING:
    from engine.structured_output.grammar import GrammarCompiler


def requested_format(req: SamplingFields) -> tuple[StructuredOutputsParams | None, str]:
    """The format `req` asks for, and the request field that asked (for errors)."""
    fmt = req.response_format if req.response_format is not None and req.response_format.type != "text" else None
    if fmt is not None and req.structured_outputs is not None:
        raise APIError(400, "response_format: give either response_format or structured_outputs, not both",
                       param="response_format", code="invalid_value")
    if req.structured_outputs is not None:
        return req.structured_outputs, "structured_outputs"
    if fmt is None:
        return None, "response_format"
    try:
        if fmt.type == "json_object":
            return StructuredOutputsParams(json_object=True), "response_format"
        if fmt.type == "structural_tag":
            tag = fmt.model_dump(include={"type", "format", "structures", "triggers"}, exclude_none=True)
            return StructuredOutputsParams(structural_tag=json.dumps(tag)), "response_format"
        return StructuredOutputsParams(json=fmt.json_schema.schema_), "response_format"
    except ValueError as e:
        raise _named(e, "response_format") from None


def _named(e: Exception, param: str) -> APIError:
    message = str(e).splitlines()[0] if not hasattr(e, "errors") else str(e.errors()[0]["msg"])
    message = message.removeprefix("Value error, ").removeprefix("structured_outputs: ")
    return APIError(400, f"{param}: {message}", param=param, code="invalid_value")


class FormatValidator:
    """Compiles formats with the model's tokenizer (what a replica will do) to find bad ones early."""

    def __init__(self, processor: InputProcessor) -> None:
        self._processor = processor
        self._compiler: GrammarCompiler | None = None  # built on the first structured request
        self._lock = threading.Lock()

    def _compile(self, params: StructuredOutputsParams) -> None:
        with self._lock:
            if self._compiler is None:
                # xgrammar imports torch (4 s, ~200 MiB): an ingress pays for it at its first structured request.
                from engine.structured_output.grammar import GrammarCompiler

                p = self._processor
                stop = resolve_eos_token_ids(p.model_config, p.tokenizer)  # as the replica's engine: same grammar
                self._compiler = GrammarCompiler(p.tokenizer, p.model_config.vocab_size, stop)
        self._compiler.compile(params)

    async def check(self, params: StructuredOutputsParams, param: str) -> None:
        """Raises a 400 naming `param` when the format does not compile."""
        compiler = self._compiler
        if compiler is not None and compiler.cached(params) is not None:
            return
        try:
            await asyncio.to_thread(self._compile, params)
        except ValueError as e:
            raise _named(e, param) from None
