"""The OpenAI routes' logic, independent of HTTP: turns requests into PreparedRequests, streams them from
the engine replicas, and shapes the deltas into OpenAI responses or stream chunks. The HTTP layer and
Python callers holding a DeploymentHandle to the ingress share it."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import uuid
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from engine.core.prepared_request import PreparedRequest
from engine.frontend.input_processor import InputProcessor, text_chars
from engine.multimodal.media import MediaSettings, load_images, split_image_parts
from engine.outputs import CompletionOutput, RequestOutput
from engine.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams
from serve_app import tracing
from serve_app.chat_tools import ChoiceTools, ToolPlan, plan_tools
from serve_app.errors import APIError, from_exception
from serve_app.formats import FormatValidator, requested_format
from serve_app.harmony import is_harmony_template
from serve_app.lora_registry import AdapterEntry, AdapterNotFound, LoRARegistry
from serve_app.protocol.openai import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChoiceLogprobs,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    DeltaMessage,
    ModelCard,
    PromptTokensDetails,
    ResponseMessage,
    SamplingFields,
    TokenLogprob,
    TopLogprob,
    Usage,
    new_id,
)
from serve_app.reasoning_parsers import think_format, thinking_tags
from serve_app.tool_parsers import get_tool_parser

# Tokenizing costs about 0.5 ms per 1,000 characters here. A text above this many is tokenized in a
# thread (HF's fast tokenizer releases the GIL while it works), so that one large prompt does not stall
# every other stream of this ingress replica; shorter ones stay inline, where the hop would cost more.
_OFF_LOOP_CHARS = 8192


async def tokenize_off_loop_if_large(num_chars: int, tokenize, *args, **kwargs):
    """`tokenize(*args, **kwargs)`, in a worker thread when the text is large."""
    if num_chars > _OFF_LOOP_CHARS:
        return await asyncio.to_thread(tokenize, *args, **kwargs)
    return tokenize(*args, **kwargs)


@dataclass
class _Prompt:
    token_ids: list[int]
    text: str | None  # the caller's text, when the prompt came as text
    images: list = field(default_factory=list)  # PIL images of a chat's image_url parts, in order


@dataclass
class UsageTally:
    """Token counts across a request's prompts and samples, for `usage`."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    seen_prompts: set[int] = field(default_factory=set)

    def add(self, prompt_index: int, output: RequestOutput) -> None:
        if prompt_index not in self.seen_prompts:
            self.seen_prompts.add(prompt_index)
            self.prompt_tokens += len(output.prompt_token_ids)
            self.cached_tokens += output.num_cached_tokens
        self.completion_tokens += sum(len(c.token_ids) for c in output.outputs)

    def usage(self) -> Usage:
        return Usage(
            prompt_tokens=self.prompt_tokens,
            completion_tokens=self.completion_tokens,
            total_tokens=self.prompt_tokens + self.completion_tokens,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=self.cached_tokens),
        )


def _own_internal_request_id() -> None:
    """Ray Serve gives every handle call made while serving one request that request's internal id, and a
    content-aware (non-FIFO) router, like ours, matches chosen replicas to pending calls by that id: two
    calls in flight at once for one request (a batch of prompts) then wait on each other forever. Give
    the calls of this context an id of their own. (Relies on Serve's private request context.)"""
    from ray.serve import context

    current = context._get_serve_request_context()
    context._serve_request_context.set(dataclasses.replace(current, _internal_request_id=uuid.uuid4().hex))


class OpenAIServing:
    def __init__(self, processor: InputProcessor, served_model_name: str, engine, tool_call_parser: str = "auto",
                 lora: LoRARegistry | None = None, media: MediaSettings | None = None,
                 reasoning_parser: str | None = None) -> None:
        self.processor = processor
        self.lora = lora  # the adapters served as models of their own (None: the base model only)
        self._adapter_handles: dict[str, object] = {}
        self.tokenizer = processor.tokenizer
        self.model_name = served_model_name
        self.engine = engine  # DeploymentHandle to LLMServer, with stream=True
        self.tool_parser = get_tool_parser(tool_call_parser, self.tokenizer.chat_template)
        self.harmony = is_harmony_template(self.tokenizer.chat_template)  # gpt-oss's channels (serve_app/harmony.py)
        if reasoning_parser == "gpt_oss" and not self.harmony:
            raise ValueError(f"reasoning_parser: gpt_oss reads Harmony's channels; {served_model_name}'s chat "
                             "template does not write Harmony")
        self.think = think_format(reasoning_parser) if reasoning_parser else None  # <think> ... </think>
        encode = functools.partial(self.tokenizer.encode, add_special_tokens=False)
        self.thinking_tags = thinking_tags(reasoning_parser, encode) if reasoning_parser else None
        self.formats = FormatValidator(processor)
        self.media = media or MediaSettings()
        # Images are fetched, decoded and processed here, so that the prefix router sees their hashes: on
        # threads of their own (PIL and the image processors' numpy release the GIL), never on the event loop.
        self.media_pool = ThreadPoolExecutor(self.media.preprocess_workers, thread_name_prefix="mm-preprocess")

    # --- shared -------------------------------------------------------------------------------------

    def check_model(self, model: str | None) -> AdapterEntry | None:
        """The LoRA adapter a request's `model` names (None: the base model); 404 naming an unknown model."""
        if model is None or model == self.model_name:
            return None
        if self.lora is not None:
            try:
                return self.lora.resolve(model)
            except AdapterNotFound:
                raise APIError(404, f"The model `{model}` does not exist: it is neither `{self.model_name}` nor one of "
                               "its LoRA adapters (GET /v1/models lists them).", param="model",
                               code="model_not_found") from None
        raise APIError(404, f"The model `{model}` does not exist; this server serves `{self.model_name}`.",
                       param="model", code="model_not_found")

    def model_cards(self) -> list[ModelCard]:
        """The base model, then each adapter as a model of its own whose parent is the base (vLLM's cards)."""
        max_len = self.processor.max_model_len
        modalities = ["text"] if self.processor.model_config.vision is None else ["text", "image"]
        cards = [ModelCard(id=self.model_name, max_model_len=max_len, input_modalities=modalities)]
        for entry in self.lora.entries() if self.lora is not None else ():
            cards.append(ModelCard(id=entry.name, root=entry.path, parent=self.model_name, max_model_len=max_len))
        return cards

    def check_task(self, task: str, route: str) -> None:
        """400 when this app's engine runs another task than `route` needs (generation or embedding)."""
        served = self.processor.config.task
        if served != task:
            remedy = ("deploy an embedding model with engine task 'embed'" if task == "embed"
                      else "it answers /v1/embeddings only")
            raise APIError(400, f"task: {self.model_name} is served with task '{served}'; {route} needs task "
                           f"'{task}': {remedy}", param="model", code="unsupported_task")

    def response_model(self, req) -> str:
        """The model name a response carries: the one the request named (an adapter's), else the base model's."""
        return req.model or self.model_name

    async def structured_outputs(self, req: SamplingFields,
                                 plan: ToolPlan | None = None) -> StructuredOutputsParams | None:
        """The format the request constrains its output to, compiled once here to reject a bad one (400)."""
        so, param = requested_format(req)
        if plan is not None and plan.structured_outputs is not None:
            so, param = plan.structured_outputs, "tools"
        if so is not None:
            await self.formats.check(so, param)
        return so

    def thinking(self, req: ChatCompletionRequest, structured_outputs: StructuredOutputsParams | None) -> dict:
        """The thinking fields of a chat request's SamplingParams (engine/sample/thinking.py): its budget, and the
        tags that make a grammar (a format, a forced tool call) start after the thinking."""
        budget = req.thinking_token_budget
        if self.thinking_tags is None:
            if budget is not None:
                raise APIError(400, f"thinking_token_budget: {self.model_name} is served without a reasoning_parser "
                               "(app args), so it has no thinking to end", param="thinking_token_budget",
                               code="unsupported_parameter")
            return {}
        if self.harmony and structured_outputs is not None:
            # A forced call or format on a Harmony model constrains the whole output, headers included.
            if budget is not None:
                raise APIError(400, "thinking_token_budget: a Harmony model's forced tool call or response format "
                               "constrains its whole output, which then has no thinking to end",
                               param="thinking_token_budget", code="unsupported_parameter")
            return {}
        if budget is None and structured_outputs is None:
            return {}
        start, end = self.thinking_tags
        return {"thinking_token_budget": budget, "thinking_start_token_ids": start, "thinking_end_token_ids": end}

    def sampling_params(
        self, req: SamplingFields, prompt_len: int, max_tokens: int | None, logprobs: int | None,
        kind: RequestOutputKind, structured_outputs: StructuredOutputsParams | None = None,
        thinking: dict | None = None,
    ) -> SamplingParams:
        room = self.processor.max_model_len - prompt_len
        if room < 1:
            what = ("the chat prompt (messages, system prompt and tools)" if isinstance(req, ChatCompletionRequest)
                    else "the prompt")
            raise APIError(400, f"prompt: {what} has {prompt_len} tokens, which leave no room to generate within this "
                           f"model's maximum context length of {self.processor.max_model_len}", param="prompt",
                           code="context_length_exceeded")
        if max_tokens is not None and max_tokens > room:
            raise APIError(400, f"max_tokens: this model's maximum context length is {self.processor.max_model_len} "
                           f"tokens; {prompt_len} in the prompt leave room for {room}, {max_tokens} were requested",
                           param="max_tokens", code="context_length_exceeded")
        # Harmony's headers are special tokens: the chat routes read the channels from them.
        keep_special = self.harmony and isinstance(req, ChatCompletionRequest)
        fields = {
            "n": req.n, "presence_penalty": req.presence_penalty, "frequency_penalty": req.frequency_penalty,
            "seed": req.seed, "stop": req.stop or [], "min_tokens": req.min_tokens, "ignore_eos": req.ignore_eos,
            "stop_token_ids": req.stop_token_ids or [], "include_stop_str_in_output": req.include_stop_str_in_output,
            "skip_special_tokens": req.skip_special_tokens and not keep_special, "logprobs": logprobs,
            "prompt_logprobs": req.prompt_logprobs, "max_tokens": max_tokens or room, "output_kind": kind,
            "logit_bias": {int(k): v for k, v in req.logit_bias.items()} if req.logit_bias else None,
            "structured_outputs": structured_outputs, **(thinking or {}),
        }
        optional = {"temperature": req.temperature, "top_p": req.top_p, "top_k": req.top_k, "min_p": req.min_p,
                    "repetition_penalty": req.repetition_penalty}
        fields.update({k: v for k, v in optional.items() if v is not None})
        try:
            return SamplingParams(**fields)
        except ValueError as e:
            raise from_exception(e) from e

    async def engine_request(self, request_id: str, prompt: _Prompt, params: SamplingParams,
                             req: SamplingFields) -> PreparedRequest:
        """The request prepared for an engine replica. A prompt's images are processed (resized, normalized,
        hashed) on the preprocessing pool, off the event loop."""
        adapter = self.check_model(req.model)
        prepare = functools.partial(
            self.processor.prepare_request, prompt.token_ids, params, request_id, priority=req.priority,
            cache_salt=req.cache_salt, lora_request=adapter.lora_request() if adapter is not None else None,
            lora_digest=adapter.digest if adapter is not None else None, trace_context=tracing.inject(),
            multi_modal_data={"image": prompt.images} if prompt.images else None)
        try:
            if not prompt.images:
                return prepare()
            with tracing.span("preprocess_images", images=len(prompt.images)):
                return await asyncio.get_running_loop().run_in_executor(self.media_pool, prepare)
        except ValueError as e:
            raise from_exception(e) from e

    def _engine_for(self, request: PreparedRequest):
        """The engine handle for a request: an adapter's carries Ray Serve's multiplexed_model_id (the
        adapter's name), which tags the call in Serve's request context and logs; the prefix router ranks
        replicas by the adapters they report holding (serve_app/routing)."""
        if request.lora_request is None:
            return self.engine
        name = request.lora_request.lora_name
        handle = self._adapter_handles.get(name)
        if handle is None:
            if len(self._adapter_handles) > 1024:
                self._adapter_handles.clear()
            handle = self._adapter_handles[name] = self.engine.options(multiplexed_model_id=name)
        return handle

    async def _stream(self, requests: list[PreparedRequest]) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Deltas of several engine requests as they come, tagged with each one's index. Closing or
        cancelling this iterator cancels the engine calls, which abort their requests."""
        if len(requests) == 1:
            stream = self._engine_for(requests[0]).generate.remote(requests[0])
            finished = False
            try:
                async for output in stream:
                    finished = output.finished
                    yield 0, output
            finally:
                if not finished:
                    stream.cancel()
            return
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(i: int, request: PreparedRequest) -> None:
            _own_internal_request_id()  # this task's context is a copy: the change stays in it
            try:
                async for output in self._engine_for(request).generate.remote(request):
                    await queue.put((i, output))
            except BaseException as e:  # noqa: BLE001 - handed to the consumer
                await queue.put((i, e))
            finally:
                await queue.put((i, None))

        tasks = [asyncio.create_task(pump(i, r)) for i, r in enumerate(requests)]
        try:
            remaining = len(tasks)
            while remaining:
                i, item = await queue.get()
                if item is None:
                    remaining -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield i, item
        finally:
            for task in tasks:
                task.cancel()

    @functools.lru_cache(maxsize=65536)  # noqa: B019 - one instance per ingress replica, tokens are few
    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    # --- /v1/completions ----------------------------------------------------------------------------

    async def completion_prompts(self, req: CompletionRequest) -> list[_Prompt]:
        prompt = req.prompt
        if isinstance(prompt, str):
            items = [prompt]
        elif prompt and all(isinstance(t, int) for t in prompt):
            items = [prompt]
        else:
            items = list(prompt)
        return await self.tokenize_prompts(items, "prompt")

    async def tokenize_prompts(self, items: list[str | list[int]], param: str) -> list[_Prompt]:
        """Each text tokenized (off the event loop when large) or token-id prompt checked; 400 naming `param`."""
        if not items:
            raise APIError(400, f"{param}: must not be empty", param=param, code="invalid_value")
        try:
            with tracing.span("tokenize", prompts=len(items)):
                ids = await tokenize_off_loop_if_large(text_chars(items),
                                                       lambda: [self.processor.tokenize(p) for p in items])
        except ValueError as e:
            # The processor names its argument `prompt`; the route's field may be another (`input`).
            raise from_exception(ValueError(str(e).replace("prompt:", f"{param}:", 1))) from e
        return [_Prompt(token_ids, p if isinstance(p, str) else None) for token_ids, p in zip(ids, items)]

    async def completions(self, req: CompletionRequest) -> CompletionResponse | AsyncIterator[CompletionResponse]:
        """Validates everything first (raising APIError), then returns the response or a chunk stream."""
        self.check_task("generate", "/v1/completions")
        self.check_model(req.model)
        prompts = await self.completion_prompts(req)
        so = await self.structured_outputs(req)
        request_id = req.request_id or new_id("cmpl")
        kind = RequestOutputKind.DELTA if req.stream else RequestOutputKind.FINAL_ONLY
        echo_logprobs = req.echo and req.logprobs is not None
        requests = []
        for i, prompt in enumerate(prompts):
            params = self.sampling_params(req, len(prompt.token_ids), req.max_tokens, req.logprobs, kind, so)
            if echo_logprobs:
                params = params.model_copy(update={"prompt_logprobs": req.logprobs})
            rid = request_id if len(prompts) == 1 else f"{request_id}-{i}"
            requests.append(await self.engine_request(rid, prompt, params, req))
        if req.stream:
            return self._completion_stream(req, request_id, prompts, requests)
        return await self._completion_full(req, request_id, prompts, requests)

    async def _completion_full(self, req, request_id, prompts, requests) -> CompletionResponse:
        tally = UsageTally()
        finals: dict[int, RequestOutput] = {}
        async for i, output in self._stream(requests):
            tally.add(i, output)
            finals[i] = output
        choices = []
        for i, prompt in enumerate(prompts):
            output = finals[i]
            for c in output.outputs:
                choices.append(self._completion_choice(req, i, prompt, output, c, first=True))
        choices.sort(key=lambda c: c.index)
        return CompletionResponse(id=request_id, model=self.response_model(req), choices=choices, usage=tally.usage())

    def _completion_choice(
        self, req: CompletionRequest, prompt_index: int, prompt: _Prompt, output: RequestOutput,
        c: CompletionOutput, first: bool, offset: int = 0,
    ) -> CompletionChoice:
        """One choice (or one chunk of it); `first` marks where echo puts the prompt, `offset` is the
        length of the text already sent for this choice (for text_offset)."""
        text = c.text
        logprobs = None
        prompt_text = ""
        if req.echo and first:
            prompt_text = prompt.text if prompt.text is not None else self.tokenizer.decode(prompt.token_ids)
        if req.logprobs is not None:
            logprobs = CompletionLogprobs()
            position = offset
            if req.echo and first:
                position = self._legacy_prompt_logprobs(logprobs, output, position)
            for token, entry in zip(c.token_ids, c.logprobs or []):
                token_text = self.token_text(token)
                logprobs.tokens.append(token_text)
                logprobs.token_logprobs.append(entry[token].logprob)
                logprobs.top_logprobs.append({self.token_text(t): lp.logprob for t, lp in entry.items()})
                logprobs.text_offset.append(position)
                position += len(token_text)
        return CompletionChoice(
            index=prompt_index * req.n + c.index,
            text=prompt_text + text,
            logprobs=logprobs,
            finish_reason=c.finish_reason,
            stop_reason=c.stop_reason,
        )

    def _legacy_prompt_logprobs(self, logprobs: CompletionLogprobs, output: RequestOutput, position: int) -> int:
        entries = output.prompt_logprobs or [None] * len(output.prompt_token_ids)
        for token, entry in zip(output.prompt_token_ids, entries):
            token_text = self.token_text(token)
            logprobs.tokens.append(token_text)
            logprobs.token_logprobs.append(None if entry is None else entry[token].logprob)
            logprobs.top_logprobs.append(None if entry is None
                                         else {self.token_text(t): lp.logprob for t, lp in entry.items()})
            logprobs.text_offset.append(position)
            position += len(token_text)
        return position

    async def _completion_stream(self, req, request_id, prompts, requests) -> AsyncIterator[CompletionResponse]:
        tally = UsageTally()
        sent_text: dict[int, int] = {}  # choice index -> characters sent (for text_offset)
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        continuous = bool(include_usage and req.stream_options.continuous_usage_stats)
        async for i, output in self._stream(requests):
            tally.add(i, output)
            choices = []
            for c in output.outputs:
                index = i * req.n + c.index
                first = index not in sent_text
                choice = self._completion_choice(req, i, prompts[i], output, c, first=first,
                                                 offset=sent_text.get(index, 0))
                sent_text[index] = sent_text.get(index, 0) + len(choice.text)
                if choice.text or choice.finish_reason or (choice.logprobs and choice.logprobs.tokens):
                    choices.append(choice)
            if choices:
                yield CompletionResponse(id=request_id, model=self.response_model(req), choices=choices,
                                         usage=tally.usage() if continuous else None)
        if include_usage:
            yield CompletionResponse(id=request_id, model=self.response_model(req), choices=[], usage=tally.usage())

    # --- /v1/chat/completions -----------------------------------------------------------------------

    async def chat_prompt(self, req: ChatCompletionRequest) -> _Prompt:
        try:
            messages, sources = split_image_parts([_template_message(m) for m in req.messages])
            images = await self._load_images(sources) if sources else []
            kwargs = dict(req.chat_template_kwargs or {})
            if req.tools:
                kwargs["tools"] = [t.model_dump(exclude_none=True) for t in req.tools]
            with tracing.span("tokenize", messages=len(messages)):
                token_ids = await tokenize_off_loop_if_large(
                    text_chars(messages), self.processor.apply_chat_template, messages, req.add_generation_prompt,
                    **kwargs)
        except ValueError as e:
            raise from_exception(e) from e
        return _Prompt(token_ids, None, images)

    async def _load_images(self, sources: list[tuple[object, str]]) -> list:
        """The images, decoded (and fetched) off the event loop; ValueError naming the part."""
        if self.processor.model_config.vision is None:
            raise ValueError(f"{sources[0][1]}: {self.model_name} is a text-only model; it takes no image_url parts")
        if not all(isinstance(url, str) for url, _ in sources):
            where = next(where for url, where in sources if not isinstance(url, str))
            raise ValueError(f"{where}: image_url.url must be a string")
        with tracing.span("load_images", images=len(sources)):
            return await asyncio.get_running_loop().run_in_executor(self.media_pool, load_images, sources, self.media)

    async def chat(self, req: ChatCompletionRequest) -> ChatCompletionResponse | AsyncIterator[ChatCompletionChunk]:
        self.check_task("generate", "/v1/chat/completions")
        self.check_model(req.model)
        plan = plan_tools(req, self.tool_parser, self.harmony, self.think)
        prompt = await self.chat_prompt(req)
        so = await self.structured_outputs(req, plan)
        request_id = req.request_id or new_id("chatcmpl")
        kind = RequestOutputKind.DELTA if req.stream else RequestOutputKind.FINAL_ONLY
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        max_tokens = req.max_completion_tokens or req.max_tokens
        thinking = self.thinking(req, so)
        params = self.sampling_params(req, len(prompt.token_ids), max_tokens, logprobs, kind, so, thinking)
        engine_request = await self.engine_request(request_id, prompt, params, req)
        if req.stream:
            return self._chat_stream(req, request_id, engine_request, plan)
        return await self._chat_full(req, request_id, engine_request, plan)

    def _chat_logprobs(self, req: ChatCompletionRequest, c: CompletionOutput) -> ChoiceLogprobs | None:
        if not req.logprobs:
            return None
        content = []
        for token, entry in zip(c.token_ids, c.logprobs or []):
            text = self.token_text(token)
            top = sorted(((t, lp) for t, lp in entry.items()), key=lambda x: x[1].rank)[: req.top_logprobs or 0]
            content.append(TokenLogprob(
                token=text, logprob=entry[token].logprob, bytes=list(text.encode()),
                top_logprobs=[TopLogprob(token=self.token_text(t), logprob=lp.logprob,
                                         bytes=list(self.token_text(t).encode()))
                              for t, lp in top],
            ))
        return ChoiceLogprobs(content=content)

    async def _chat_full(self, req, request_id, engine_request, plan: ToolPlan) -> ChatCompletionResponse:
        tally, final = UsageTally(), None
        async for _, output in self._stream([engine_request]):
            tally.add(0, output)
            final = output
        choices = []
        for c in final.outputs:
            content, tool_calls, finish_reason, reasoning = ChoiceTools(plan).final(c.text, c.finish_reason)
            message = ResponseMessage(content=content, tool_calls=tool_calls, reasoning=reasoning)
            choices.append(ChatChoice(index=c.index, message=message,
                                      logprobs=self._chat_logprobs(req, c), finish_reason=finish_reason,
                                      stop_reason=c.stop_reason))
        return ChatCompletionResponse(id=request_id, model=self.response_model(req), choices=choices,
                                      usage=tally.usage())

    async def _chat_stream(self, req, request_id, engine_request, plan: ToolPlan) -> AsyncIterator[ChatCompletionChunk]:
        tally = UsageTally()
        tools = [ChoiceTools(plan) for _ in range(req.n)]
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        continuous = bool(include_usage and req.stream_options.continuous_usage_stats)
        first = True
        async for _, output in self._stream([engine_request]):
            if first:  # the first chunk of every choice carries the role, as OpenAI's do
                first = False
                yield ChatCompletionChunk(id=request_id, model=self.response_model(req), choices=[
                    ChatChunkChoice(index=i, delta=DeltaMessage(role="assistant", content="")) for i in range(req.n)
                ])
            tally.add(0, output)
            choices = []
            for c in output.outputs:
                content, tool_calls, finish_reason, reasoning = tools[c.index].delta(c.text, c.finish_reason)
                if content or tool_calls or reasoning or finish_reason or (req.logprobs and c.token_ids):
                    choices.append(ChatChunkChoice(
                        index=c.index, delta=DeltaMessage(content=content, tool_calls=tool_calls, reasoning=reasoning),
                        logprobs=self._chat_logprobs(req, c), finish_reason=finish_reason, stop_reason=c.stop_reason,
                    ))
            if choices:
                yield ChatCompletionChunk(id=request_id, model=self.response_model(req), choices=choices,
                                          usage=tally.usage() if continuous else None)
        if include_usage:
            yield ChatCompletionChunk(id=request_id, model=self.response_model(req), choices=[], usage=tally.usage())


def _template_message(m) -> dict:
    """A chat message as chat templates expect it: tool calls' arguments as objects (Hugging Face's
    convention; OpenAI sends JSON text), tool results with their call's id; content parts kept as parts where
    images are among them (engine/multimodal/media.py's split_image_parts reads them), else joined text."""
    has_images = isinstance(m.content, list) and any(isinstance(p, dict) and p.get("type") == "image_url"
                                                     for p in m.content)
    message = {"role": m.role, "content": m.content if has_images else m.text()}
    if m.name:
        message["name"] = m.name
    if m.tool_call_id is not None:
        message["tool_call_id"] = m.tool_call_id
    if m.tool_calls:
        message["tool_calls"] = [_with_parsed_arguments(c) for c in m.tool_calls]
    return message


def _with_parsed_arguments(call: dict) -> dict:
    function = call.get("function")
    if not isinstance(function, dict) or not isinstance(function.get("arguments"), str):
        return call
    try:
        arguments = json.loads(function["arguments"])
    except ValueError:
        return call
    return {**call, "function": {**function, "arguments": arguments}}
