"""A request's state inside the engine: its tokens, how many of them have KV computed, its blocks'
hashes, its lifecycle status and timings. With n > 1 each sample is its own Request (a child), all
sharing the parent's prompt; the frontend's output processor reassembles them."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.core.block_hash import BlockHash, hash_block_chain
from engine.outputs import PromptLogprobs, SampleLogprobs, StepTiming
from engine.sample.thinking import ThinkingState
from engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    import numpy as np
    import torch

    from engine.lora.peft import LoRAAdapter
    from engine.multimodal.inputs import MultiModalInput
    from engine.pooling.params import PoolingParams
    from engine.structured_output.manager import GrammarState


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    # Everything after this point is finished.
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5
    FINISHED_ERROR = 6

    @property
    def finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED


FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    max_tokens: int  # resolved: sampling_params.max_tokens capped by max_model_len
    block_size: int
    eos_token_ids: frozenset[int] = frozenset()
    arrival_time: float = field(default_factory=time.monotonic)
    priority: int = 0
    cache_salt: str | None = None
    seed: int | None = None  # this sample's seed (derived per child when n > 1)
    parent_id: str | None = None  # the request the caller knows; None when it is this one
    index: int = 0  # which of the parent's n samples
    # Disaggregated prefill/decode (engine/kv_transfer): what the caller says of the KV (produce it for a
    # consumer, or load it from a producer), and, once finished, what a consumer needs to load it.
    kv_transfer_params: dict | None = None
    kv_transfer_result: dict | None = None
    lora: LoRAAdapter | None = None  # the adapter it runs with (held here: its weights are what it was hashed with)
    mm_inputs: list[MultiModalInput] = field(default_factory=list)  # the prompt's images (engine/multimodal)
    # An embedder's request (engine/pooling): it pools its prompt and samples nothing. Mean and CLS pooling read
    # the first positions, so such requests never start from a prefix-cache hit.
    pooling_params: PoolingParams | None = None
    skip_reading_prefix_cache: bool = False

    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    all_token_ids: list[int] = field(init=False)
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1  # prefix-cache hit in tokens, set when first scheduled
    num_preemptions: int = 0
    # The full blocks' hashes (engine/core/block_hash.py), extended as output fills blocks; given by the
    # request's preparation (computed here when not), and shared by a request's samples until they diverge.
    block_hashes: list[BlockHash] | None = None
    logprobs: SampleLogprobs | None = None
    cumulative_logprob: float = 0.0
    prompt_logprobs: PromptLogprobs | None = None
    stop_reason: int | str | None = None
    error: str | None = None
    # Timings, time.monotonic() of this process.
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    preempted_times: list[float] = field(default_factory=list)
    # Speculative decoding: draft tokens the current step verifies after the last token; never part of
    # all_token_ids (nor of block hashes) unless accepted.
    spec_token_ids: list[int] = field(default_factory=list)
    step_timings: list[StepTiming] = field(default_factory=list)  # not yet sent in an output
    # What the core already sent to the frontend (engine/core/core_output.py): outputs carry what is new.
    num_emitted_tokens: int = 0
    num_emitted_logprobs: int = 0
    prompt_logprobs_emitted: bool = False
    grammar: GrammarState | None = None  # structured outputs: this sample's compile and matcher
    thinking: ThinkingState | None = field(init=False)  # a reasoning model's thinking (engine/sample/thinking.py)
    lora_slot: int = -1  # the device slot of its adapter while it runs (engine/lora/manager.py); -1: none
    pooled_sum: torch.Tensor | None = None  # an embedder's running sum of its pooled rows, until the prompt is done
    pooled: np.ndarray | None = None  # then its embedding

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids)
        self.thinking = ThinkingState.of(self.sampling_params)
        if self.block_hashes is None:
            self.block_hashes = hash_block_chain(self.all_token_ids, self.block_size, self.cache_salt,
                                                 lora_digest=self.lora_digest, mm_inputs=self.mm_inputs)
        if self.sampling_params.logprobs is not None:
            self.logprobs = []
        if self.sampling_params.prompt_logprobs is not None:
            self.prompt_logprobs = [None]  # the first prompt token has no context to be predicted from

    @property
    def lora_digest(self) -> str | None:
        return self.lora.digest if self.lora is not None else None

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status >= 3  # RequestStatus.FINISHED_STOPPED; a plain int compare: this runs per token

    @property
    def finish_reason(self) -> str | None:
        return FINISH_REASONS.get(self.status)

    @property
    def external_id(self) -> str:
        return self.parent_id if self.parent_id is not None else self.request_id

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Still owes prompt logprobs: its prompt positions need logits, so it cannot skip them via
        the prefix cache."""
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < self.num_prompt_tokens

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
        if len(self.all_token_ids) % self.block_size == 0:  # a block just filled: hash it
            self.block_hashes = hash_block_chain(
                self.all_token_ids, self.block_size, self.cache_salt, self.block_hashes, self.lora_digest,
                self.mm_inputs,
            )
