"""InputProcessor: turns what a caller sends (text or token ids, chat messages, sampling parameters) into
a validated, tokenized request. It needs the tokenizer and the model's config but not its weights, so
the serving ingress builds one too and rejects bad input before anything reaches an engine replica."""

from __future__ import annotations

import itertools
import time
from pathlib import Path

from transformers import PreTrainedTokenizerBase

from engine.config import EngineConfig, resolve_max_model_len
from engine.core.block_hash import hash_block_chain
from engine.core.prepared_request import PreparedRequest
from engine.lora.request import LoRARequest
from engine.models.config import ModelConfig
from engine.models.model_path import resolve_model_path
from engine.pooling.config import check_dimensions, resolve_pooler
from engine.pooling.params import PoolingParams
from engine.sampling_params import RequestOutputKind, SamplingParams
from engine.text_validation import check_text
from engine.tokenizer import max_chars_per_token, tokenizer_for

# What an embedding request carries as sampling params: the engine's per-request bookkeeping (samples, output
# kind) reads them; nothing is ever sampled.
POOLING_SAMPLING_PARAMS = SamplingParams(max_tokens=None, detokenize=False, output_kind=RequestOutputKind.FINAL_ONLY)


def text_chars(value) -> int:
    """Characters of all the text in a str, or in lists and dicts of them (a chat's messages)."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, dict):
        return sum(text_chars(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(text_chars(v) for v in value)
    return 0


class InputProcessor:
    """Thread-safe: it holds no per-request state."""

    def __init__(
        self, config: EngineConfig, model_config: ModelConfig, tokenizer: PreTrainedTokenizerBase, max_model_len: int,
        model_path: Path,
    ) -> None:
        """`model_path`: the checkpoint folder (a vision-language model's image processor is read from it)."""
        self.config = config
        self.model_path = model_path
        self.model_config = model_config
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        # A text longer than this cannot fit max_model_len tokens under any tokenization: refused before
        # paying to tokenize it (a megabyte prompt costs a CPU-second). None: the tokenizer gives no bound.
        chars_per_token = max_chars_per_token(tokenizer)
        self.max_prompt_chars = max_model_len * chars_per_token if chars_per_token else None
        self._request_counter = itertools.count()
        # task 'embed': how prompts are pooled (engine/pooling), for the checks of `dimensions`
        self.pooler_config = resolve_pooler(model_path, config.pooler_config) if config.task == "embed" else None
        self.processed_images = None  # a vision-language model's processed images, by content hash
        if model_config.vision is not None and config.mm_processor_cache_gb > 0:
            from engine.multimodal.images import ProcessedImageCache

            self.processed_images = ProcessedImageCache(int(config.mm_processor_cache_gb * 2**30))

    @classmethod
    def from_config(cls, config: EngineConfig) -> InputProcessor:
        """Without the weights or torch: for a process that validates requests but runs no model. Whether
        the model can run the way the config asks is ModelSpec's check (engine/model_spec.py check_config),
        made where a model is built or before anything starts for it (the serving app's build_app)."""
        path = resolve_model_path(config.model, config.revision, weights=False)
        model_config = ModelConfig.from_pretrained(path)
        tokenizer = tokenizer_for(config, path)
        return cls(config, model_config, tokenizer, resolve_max_model_len(config, model_config), path)

    def tokenize(self, prompt: str | list[int]) -> list[int]:
        """Token ids of a prompt given as text or ids, validated (the parameter is named `prompt`)."""
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt: must not be empty")
            check_text("prompt", prompt)
            self.check_prompt_length("prompt", len(prompt))
            return self.tokenizer.encode(prompt)
        ids = list(prompt)
        if not ids:
            raise ValueError("prompt: must not be empty")
        vocab = self.model_config.vocab_size
        for t in ids:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab:
                raise ValueError(f"prompt: token id {t!r} is outside the vocabulary [0, {vocab})")
        return ids

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs) -> list[int]:
        """Prompt token ids for a chat, through the tokenizer's chat template."""
        if not messages:
            raise ValueError("messages: must not be empty")
        if self.tokenizer.chat_template is None:
            raise ValueError(f"messages: the tokenizer of {self.config.model} has no chat template")
        check_text("messages", messages)
        check_text("chat_template_kwargs", kwargs)

        def render(**how):
            try:
                return self.tokenizer.apply_chat_template(
                    messages, add_generation_prompt=add_generation_prompt, **how, **kwargs)
            except Exception as e:  # jinja errors: a role the template rejects, a missing field
                raise ValueError(f"messages: the chat template rejected them: {e}") from e

        if self.max_prompt_chars is not None and text_chars(messages) + text_chars(kwargs) > self.max_prompt_chars:
            # Perhaps too long: measure the rendered text (cheap) before tokenizing it. Only then, and
            # not the messages themselves, because a template may leave content out (earlier reasoning).
            self.check_prompt_length("messages", len(render(tokenize=False)),
                                     "the chat prompt (messages, system prompt and tools)")
        return list(render(tokenize=True, return_dict=False))

    def check_prompt_length(self, param: str, num_chars: int, what: str = "the prompt") -> None:
        """Raises ValueError naming `param` when a text of `num_chars` characters is known to exceed
        max_model_len tokens, before anyone pays to tokenize it."""
        if self.max_prompt_chars is not None and num_chars > self.max_prompt_chars:
            raise ValueError(
                f"{param}: {what} has {num_chars} characters, which cannot fit in max_model_len={self.max_model_len} "
                f"tokens (one token of this tokenizer covers at most {self.max_prompt_chars // self.max_model_len} "
                "characters); "
                "shorten the prompt"
            )

    def prepare_request(
        self,
        prompt: str | list[int],
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        kv_transfer_params: dict | None = None,
        lora_request: LoRARequest | None = None,
        lora_digest: str | None = None,
        trace_context: dict[str, str] | None = None,
        multi_modal_data: dict | None = None,
        pooling_params: PoolingParams | None = None,
    ) -> PreparedRequest:
        """Validate and tokenize a request, and hash its prompt's blocks, without touching engine state, so
        that any thread may call it. `lora_digest`: the adapter's weight digest where the caller knows it
        (an ingress's registry); the hashes then need no recomputing. `pooling_params`: an embedding request
        (task 'embed'), instead of sampling_params. Raises ValueError naming the bad parameter."""
        params = self._check_task(sampling_params, pooling_params)
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise ValueError(f"priority: expected an int, got {priority!r}")
        token_ids = self.tokenize(prompt)
        mm_inputs = []
        if multi_modal_data is not None or self.model_config.vision is not None:
            token_ids, mm_inputs = self.place_images(token_ids, multi_modal_data)
        if pooling_params is not None and len(token_ids) > self.max_model_len:
            raise ValueError(f"prompt: {len(token_ids)} tokens exceed max_model_len={self.max_model_len}")
        if pooling_params is None and len(token_ids) >= self.max_model_len:
            raise ValueError(
                f"prompt: {len(token_ids)} tokens leave no room to generate within max_model_len={self.max_model_len}"
            )
        vocab = self.model_config.vocab_size
        bad = sorted(t for t in params.token_ids_to_check() if t >= vocab)
        if bad:
            raise ValueError(f"stop_token_ids/logit_bias: token ids {bad} are outside the vocabulary [0, {vocab})")
        if params.n > self.config.max_num_seqs:
            raise ValueError(f"n: {params.n} exceeds max_num_seqs={self.config.max_num_seqs}")
        if kv_transfer_params is not None and not isinstance(kv_transfer_params, dict):
            raise ValueError(f"kv_transfer_params: expected a dict, got {type(kv_transfer_params).__name__}")
        if lora_request is not None:
            if not isinstance(lora_request, LoRARequest):
                raise ValueError(f"lora_request: expected a LoRARequest, got {type(lora_request).__name__}")
            if not self.config.enable_lora:
                raise ValueError("lora_request: this engine was started without enable_lora=True")
        elif lora_digest is not None:
            raise ValueError("lora_digest: given without a lora_request")
        return PreparedRequest(
            request_id=request_id if request_id is not None else f"req-{next(self._request_counter)}",
            prompt=prompt if isinstance(prompt, str) else None,
            prompt_token_ids=token_ids,
            sampling_params=params,
            arrival_time=arrival_time if arrival_time is not None else time.monotonic(),
            priority=priority,
            cache_salt=cache_salt,
            kv_transfer_params=kv_transfer_params,
            lora_request=lora_request,
            block_hashes=hash_block_chain(token_ids, self.config.block_size, cache_salt, lora_digest=lora_digest,
                                          mm_inputs=mm_inputs),
            lora_digest=lora_digest,
            trace_context=trace_context or {},
            mm_inputs=mm_inputs,
            pooling_params=pooling_params,
        )

    def _check_task(self, sampling_params: SamplingParams | None,
                    pooling_params: PoolingParams | None) -> SamplingParams:
        """The request's sampling params, once its kind matches the engine's task."""
        if self.config.task == "embed":
            if sampling_params is not None or pooling_params is None:
                raise ValueError(f"sampling_params: {self.config.model} is served with task='embed'; it embeds "
                                 "(pooling_params, LLM.embed, /v1/embeddings) and generates nothing")
            if not isinstance(pooling_params, PoolingParams):
                raise ValueError(f"pooling_params: expected PoolingParams, got {type(pooling_params).__name__}")
            check_dimensions(self.pooler_config, pooling_params.dimensions, self.model_config.hidden_size)
            return POOLING_SAMPLING_PARAMS
        if pooling_params is not None:
            raise ValueError(f"pooling_params: {self.config.model} is served with task='generate'; start it with "
                             "task='embed' to embed")
        params = sampling_params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params: expected SamplingParams, got {type(params).__name__}")
        return params

    def place_images(self, token_ids: list[int], multi_modal_data: dict | None) -> tuple[list[int], list]:
        """The prompt with its images' placeholders expanded, and the images prepared (engine/multimodal)."""
        vision = self.model_config.vision
        data = dict(multi_modal_data or {})
        unknown = set(data) - {"image"}
        if unknown:
            raise ValueError(f"multi_modal_data: {', '.join(sorted(unknown))} not supported; only 'image' is")
        images = data.get("image", [])
        images = list(images) if isinstance(images, (list, tuple)) else [images]
        if vision is None:
            if images:
                raise ValueError(f"multi_modal_data: {self.config.model} is a text-only model; it takes no images")
            return token_ids, []
        limit = self.config.limit_mm_per_prompt.get("image", 1 << 30)
        if len(images) > limit:
            raise ValueError(f"multi_modal_data: {len(images)} images exceed limit_mm_per_prompt['image']={limit}")
        from engine.multimodal.images import expand_images  # PIL and the image processor: only with images

        return expand_images(token_ids, images, vision, self.model_path, self.config.mm_processor_kwargs,
                             self.processed_images)


class PreparesRequests:
    """The request-side calls an engine front end (LLMEngine, DataParallelEngine) forwards to its InputProcessor."""

    input_processor: InputProcessor

    def tokenize(self, prompt: str | list[int]) -> list[int]:
        return self.input_processor.tokenize(prompt)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs) -> list[int]:
        return self.input_processor.apply_chat_template(messages, add_generation_prompt, **kwargs)

    def prepare_request(self, *args, **kwargs) -> PreparedRequest:
        return self.input_processor.prepare_request(*args, **kwargs)
