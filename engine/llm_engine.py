"""LLMEngine: requests in, one scheduled step at a time, finished requests out. Synchronous and
single-threaded; `LLM` drives it for offline batches."""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterable

import torch

from engine.block_pool import BlockPool
from engine.config import EngineConfig
from engine.kv_cache_manager import KVCacheManager
from engine.model_runner import ModelRunner
from engine.models.config import ModelConfig
from engine.models.loader import resolve_model_path
from engine.outputs import CompletionOutput, Logprob, RequestOutput
from engine.request import Request, RequestStatus
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.tokenizer import load_tokenizer

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        path = resolve_model_path(config.model, config.revision)
        self.model_config = ModelConfig.from_pretrained(path)
        self.device = _resolve_device(config.device)
        self.dtype = _resolve_dtype(config.dtype, self.model_config, self.device)
        self.max_model_len = self._resolve_max_model_len()
        self.max_num_batched_tokens = self._resolve_max_num_batched_tokens()
        self.tokenizer = load_tokenizer(config.tokenizer or path, config.revision if config.tokenizer else None)
        self.eos_token_ids = frozenset(
            self.model_config.eos_token_ids
            or ([self.tokenizer.eos_token_id] if self.tokenizer.eos_token_id is not None else [])
        )
        self.model_runner = ModelRunner(config, self.model_config, path, self.dtype, self.device, self.max_model_len)
        num_blocks = self.model_runner.num_blocks
        if (num_blocks - 1) * config.block_size < self.max_model_len:
            raise ValueError(
                f"num_kv_blocks: {num_blocks - 1} usable blocks of {config.block_size} tokens cannot hold one "
                f"request of max_model_len={self.max_model_len}; raise the KV budget or lower max_model_len"
            )
        block_pool = BlockPool(num_blocks, enable_caching=config.enable_prefix_caching)
        self.scheduler = Scheduler(
            KVCacheManager(block_pool, config.block_size),
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            enable_chunked_prefill=config.enable_chunked_prefill,
        )
        self._request_counter = itertools.count()

    def _resolve_max_model_len(self) -> int:
        cfg = self.model_config
        limit = cfg.max_position_embeddings
        if cfg.sliding_window:  # we attend over the full context: exact only within the window
            limit = min(limit, cfg.sliding_window)
        if self.config.max_model_len is None:
            return limit
        if self.config.max_model_len > limit:
            raise ValueError(
                f"max_model_len: {self.config.max_model_len} exceeds the model's limit of {limit} tokens "
                "(max_position_embeddings, or sliding_window)"
            )
        return self.config.max_model_len

    def _resolve_max_num_batched_tokens(self) -> int:
        value = self.config.max_num_batched_tokens
        if self.config.enable_chunked_prefill:
            return value or DEFAULT_MAX_NUM_BATCHED_TOKENS
        if value is None:
            return max(DEFAULT_MAX_NUM_BATCHED_TOKENS, self.max_model_len)
        if value < self.max_model_len:
            raise ValueError(
                f"max_num_batched_tokens: {value} is below max_model_len={self.max_model_len}, so long prompts "
                "could never be scheduled without chunked prefill; raise it or enable_chunked_prefill"
            )
        return value

    @property
    def vocab_size(self) -> int:
        return self.model_config.vocab_size

    def tokenize(self, prompt: str | list[int]) -> list[int]:
        """Token ids of a prompt given as text or ids, validated (the parameter is named `prompt`)."""
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt: must not be empty")
            return self.tokenizer.encode(prompt)
        ids = list(prompt)
        if not ids:
            raise ValueError("prompt: must not be empty")
        for t in ids:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < self.vocab_size:
                raise ValueError(f"prompt: token id {t!r} is outside the vocabulary [0, {self.vocab_size})")
        return ids

    def add_request(
        self,
        prompt: str | list[int],
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
    ) -> Request:
        """Validate and enqueue a request. Raises ValueError naming the bad parameter; the engine state
        is untouched on error."""
        params = sampling_params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params: expected SamplingParams, got {type(params).__name__}")
        token_ids = self.tokenize(prompt)
        if len(token_ids) >= self.max_model_len:
            raise ValueError(
                f"prompt: {len(token_ids)} tokens leave no room to generate within max_model_len={self.max_model_len}"
            )
        bad = [t for t in params.stop_token_ids if t >= self.vocab_size]
        if bad:
            raise ValueError(f"stop_token_ids: {bad} are outside the vocabulary [0, {self.vocab_size})")
        request_id = request_id if request_id is not None else str(next(self._request_counter))
        if request_id in self.scheduler.requests:
            raise ValueError(f"request_id: {request_id!r} is already in flight")
        room = self.max_model_len - len(token_ids)
        request = Request(
            request_id=request_id,
            prompt_token_ids=token_ids,
            sampling_params=params,
            max_tokens=min(params.max_tokens or room, room),
            block_size=self.config.block_size,
            eos_token_ids=self.eos_token_ids,
            arrival_time=arrival_time if arrival_time is not None else time.monotonic(),
            priority=priority,
            cache_salt=cache_salt,
            prompt=prompt if isinstance(prompt, str) else None,
        )
        self.scheduler.add_request(request)
        return request

    def abort_request(self, request_ids: str | Iterable[str]) -> list[Request]:
        ids = [request_ids] if isinstance(request_ids, str) else request_ids
        return self.scheduler.finish_requests(ids, RequestStatus.FINISHED_ABORTED)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def step(self) -> list[Request]:
        """Run one scheduled step; returns the requests that finished in it."""
        so = self.scheduler.schedule()
        if so.is_empty:
            return []
        out = self.model_runner.execute(so, self.scheduler.kv_cache_manager)
        for request, entry in zip(so.requests, out.logprobs):
            if entry is not None:
                ids, values, rank = entry
                token_logprobs = {ids[0]: Logprob(values[0], rank)}  # the sampled token first
                for top_rank, (t, v) in enumerate(zip(ids[1:], values[1:]), start=1):
                    token_logprobs.setdefault(t, Logprob(v, top_rank))
                request.logprobs.append(token_logprobs)
                request.cumulative_logprob += values[0]
        return self.scheduler.update_from_output(so, out.sampled_token_ids)

    def make_output(self, request: Request) -> RequestOutput:
        """A cumulative RequestOutput: all tokens so far, text decoded in one go."""
        completion = CompletionOutput(
            index=0,
            text=self.tokenizer.decode(request.output_token_ids, skip_special_tokens=True),
            token_ids=list(request.output_token_ids),
            cumulative_logprob=request.cumulative_logprob if request.logprobs is not None else None,
            logprobs=request.logprobs,
            finish_reason=request.finish_reason,
            stop_reason=request.stop_reason,
        )
        return RequestOutput(
            request_id=request.request_id,
            prompt=request.prompt,
            prompt_token_ids=request.prompt_token_ids,
            outputs=[completion],
            finished=request.is_finished,
            num_cached_tokens=max(request.num_cached_tokens, 0),
        )


def _resolve_device(device: str) -> torch.device:
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device: cuda requested but torch sees no GPU; use device='cpu'")
    return torch.device(device)


def _resolve_dtype(dtype: str, cfg: ModelConfig, device: torch.device) -> torch.dtype:
    if dtype != "auto":
        return _DTYPES[dtype]
    checkpoint = _DTYPES.get(str(cfg.torch_dtype).removeprefix("torch."), torch.float32)
    if checkpoint is torch.float16 and device.type == "cpu":
        return torch.float32
    return checkpoint
