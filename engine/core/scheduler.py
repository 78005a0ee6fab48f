"""Continuous batching with one token budget per step.

Each step hands out up to `max_num_batched_tokens` over the running requests first, then the waiting
ones; there are no prefill and decode phases, only requests whose computed tokens catch up with their
known tokens. A prompt larger than what is left of the budget is chunked. When the pool runs out of
blocks, the lowest-priority, latest request is preempted: its blocks are freed and it is recomputed
later (usually cheaply, from the prefix cache).

With LoRA, a request is admitted only once its adapter has a device slot (engine/lora/manager.py): one
that cannot get one, every slot being pinned by running requests, stays in the queue while requests
behind it that can run are admitted, and the slot chosen to drain for it takes no new requests."""

from __future__ import annotations

import heapq
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Literal

from engine.core.encoder_cache import EncoderCache
from engine.core.kv_cache_manager import KVCacheManager
from engine.core.request import Request, RequestStatus
from engine.kv_transfer.base import KVConnector
from engine.lora.manager import LoRAManager
from engine.multimodal.inputs import MultiModalInput
from engine.spec_decode.eligibility import can_draft


@dataclass
class SchedulerOutput:
    requests: list[Request] = field(default_factory=list)
    num_scheduled_tokens: list[int] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    # Requests that left the running set since the previous step (finished or preempted): the model
    # runner drops its per-request state for them.
    released_request_ids: list[str] = field(default_factory=list)

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens)

    @property
    def is_empty(self) -> bool:
        return not self.requests


class _FCFSQueue:
    """Arrival order; preempted requests go back to the front."""

    def __init__(self) -> None:
        self._q: deque[Request] = deque()

    def add(self, r: Request) -> None:
        self._q.append(r)

    def prepend(self, r: Request) -> None:
        self._q.appendleft(r)

    def peek(self) -> Request:
        return self._q[0]

    def pop(self) -> Request:
        return self._q.popleft()

    def remove(self, r: Request) -> None:
        self._q.remove(r)

    def __len__(self) -> int:
        return len(self._q)

    def __iter__(self):
        return iter(self._q)


class _PriorityQueue:
    """Lower priority value first, then arrival; a preempted request keeps its place by key."""

    def __init__(self) -> None:
        self._heap: list[tuple[int, float, int, Request]] = []
        self._seq = 0  # ties beyond (priority, arrival) stay stable

    def add(self, r: Request) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (r.priority, r.arrival_time, self._seq, r))

    prepend = add

    def peek(self) -> Request:
        return self._heap[0][3]

    def pop(self) -> Request:
        return heapq.heappop(self._heap)[3]

    def remove(self, r: Request) -> None:
        self._heap = [e for e in self._heap if e[3] is not r]
        heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self):
        return (e[3] for e in self._heap)


class Scheduler:
    def __init__(
        self,
        kv_cache_manager: KVCacheManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        enable_chunked_prefill: bool = True,
        policy: Literal["fcfs", "priority"] = "fcfs",
        num_speculative_tokens: int = 0,
        connector: KVConnector | None = None,
        lora_manager: LoRAManager | None = None,
        encoder_cache: EncoderCache | None = None,
        encoder_budget: int = 0,
    ) -> None:
        """`encoder_cache`, `encoder_budget`: a vision-language model's images held, and the embeddings its
        encoder may compute in one step (EngineConfig.max_num_encoder_input_tokens)."""
        self.kv_cache_manager = kv_cache_manager
        self.connector = connector  # disaggregated prefill/decode: KV loaded from, or held for, another engine
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.enable_chunked_prefill = enable_chunked_prefill
        self.policy = policy
        self.num_speculative_tokens = num_speculative_tokens  # 0: no speculative decoding
        self.lora_manager = lora_manager
        self.encoder_cache, self.encoder_budget = encoder_cache, encoder_budget
        self._encoder_left, self._encoding = encoder_budget, set()  # this step's: budget left, images encoded
        self.waiting = _PriorityQueue() if policy == "priority" else _FCFSQueue()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        # Requests in a step that has not come back yet (pipeline parallelism keeps several steps in flight):
        # they are not scheduled again, nor preempted, until `update_from_output` has their tokens.
        self.in_flight: set[str] = set()
        self._released: list[str] = []
        # Counters since start.
        self.num_preemptions = 0
        self.num_prompt_tokens = 0
        self.num_prompt_images = 0
        self.num_generation_tokens = 0
        self.num_finished = 0
        self.num_spec_drafts = 0  # verifications of at least one draft token
        self.num_spec_draft_tokens = 0
        self.num_spec_accepted_tokens = 0

    def add_request(self, request: Request, front: bool = False) -> None:
        """Queue a request; `front` puts it ahead of the waiting ones (it arrived before them)."""
        self.requests[request.request_id] = request
        if front:
            self.waiting.prepend(request)
        else:
            self.waiting.add(request)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(released_request_ids=self._released)
        self._released = []
        budget = self.max_num_batched_tokens
        kv = self.kv_cache_manager
        self._encoder_left, self._encoding = self.encoder_budget, set()

        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            if request.request_id in self.in_flight:
                i += 1
                continue
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            if request.mm_inputs:
                num_new = self._fit_encoder_budget(request, request.num_computed_tokens, num_new)
                if not num_new:
                    i += 1
                    continue
            # Slots for draft tokens, filled by the proposer before the forward. They never cost another
            # request its blocks: without room for them the request decodes plainly.
            num_drafts = self._num_draft_slots(request, num_new, budget)
            if num_drafts and kv.allocate_slots(request, num_new + num_drafts):
                num_new += num_drafts
            while not kv.allocate_slots(request, num_new):
                victim = self._choose_victim(request)
                self._preempt(victim, out)
                if victim is request:
                    break
                budget += self._unschedule(victim, out)
                i = self.running.index(request)  # the victim may have sat before it
            if request.status is not RequestStatus.RUNNING:
                continue
            out.requests.append(request)
            out.num_scheduled_tokens.append(num_new)
            budget -= num_new
            i += 1

        # Admit nothing new in a step that had to preempt: the pool is under pressure.
        skipped: list[Request] = []  # waiting for an adapter slot; they keep their place in the queue
        draining: int | None = None
        while not out.preempted and self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting.peek()
            if request.lora is not None:
                request.lora_slot = self.lora_manager.acquire(request.lora, draining)
                if request.lora_slot is None:
                    request.lora_slot = -1
                    skipped.append(self.waiting.pop())
                    if draining is None:
                        draining = self.lora_manager.draining_slot()
                    continue
            hit_blocks = kv.get_computed_blocks(request)
            num_hit = len(hit_blocks) * kv.block_size
            # KV another engine computed (its prefill), loaded in this step rather than computed: only at
            # first admission (a preempted request recomputes what its prefix cache lost).
            num_external = 0
            if self.connector is not None and request.num_cached_tokens < 0:
                num_external = self.connector.get_num_new_matched_tokens(request, num_hit)
            remaining = request.num_tokens - num_hit - num_external
            if not self.enable_chunked_prefill and remaining > budget:
                self._release_lora(request)
                break
            num_new = min(remaining, budget)
            if request.mm_inputs:
                fitted = self._fit_encoder_budget(request, num_hit + num_external, num_new)
                if not fitted or (fitted < num_new and not self.enable_chunked_prefill):
                    self._release_lora(request)
                    break
                num_new = fitted
            if not kv.allocate_slots(request, num_external + num_new, hit_blocks):
                self._release_lora(request)
                break
            self.waiting.pop()
            if request.num_cached_tokens < 0:  # first admission; a resumed request is not a new query
                request.num_cached_tokens = num_hit
                request.first_scheduled_time = time.monotonic()
                kv.record_prefix_hit(request, num_hit)
                self.num_prompt_tokens += request.num_prompt_tokens
                self.num_prompt_images += len(request.mm_inputs)
            request.num_computed_tokens = num_hit
            if num_external:
                self.connector.update_state_after_alloc(request, kv.get_block_ids(request), num_external)
                request.num_computed_tokens += num_external
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            out.requests.append(request)
            out.num_scheduled_tokens.append(num_new)
            budget -= num_new
        for request in reversed(skipped):
            self.waiting.prepend(request)
        self.in_flight.update(r.request_id for r in out.requests)
        return out

    def _fit_encoder_budget(self, request: Request, start: int, num_new: int) -> int:
        """`num_new` tokens from `start`, cut before the first image among them whose encoding the step's
        encoder budget cannot afford (0: not even the tokens before it); the images kept are charged. An image
        larger than the whole budget goes when nothing else was encoded in the step, so that it always goes."""
        if self.encoder_cache is None:
            return num_new
        charged: list[MultiModalInput] = []
        left = self._encoder_left
        for image in request.mm_inputs:
            if image.end <= start or image.offset >= start + num_new:
                continue
            if image.content_hash in self._encoding or self.encoder_cache.holds(image.content_hash):
                continue
            if image.length > left and left < self.encoder_budget:
                num_new = max(image.offset - start, 0)
                break
            left -= image.length
            charged.append(image)
        if num_new:
            self._encoder_left = left
            self._encoding.update(image.content_hash for image in charged)
        return num_new

    def _release_lora(self, request: Request) -> None:
        """Unpin the request's adapter slot (it stopped running, or was not admitted after all)."""
        if request.lora_slot >= 0:
            self.lora_manager.release(request.lora_slot)
            request.lora_slot = -1

    def _num_draft_slots(self, request: Request, num_new: int, budget: int) -> int:
        """Draft tokens a decoding request may verify this step: within the token budget, and never more
        than max_tokens leaves room for (the step emits up to drafts + 1 tokens)."""
        if not self.num_speculative_tokens or num_new != 1 or request.num_tokens - request.num_computed_tokens != 1:
            return 0
        if not can_draft(request):
            return 0
        return max(0, min(self.num_speculative_tokens, budget - 1, request.max_tokens - request.num_output_tokens - 1))

    def _choose_victim(self, request: Request) -> Request:
        """The running request to preempt so that `request` gets blocks (possibly itself); never one
        whose step is still in flight."""
        candidates = [r for r in self.running if r.request_id not in self.in_flight] or [request]
        if self.policy == "priority":
            return max(candidates, key=lambda r: (r.priority, r.arrival_time))
        return candidates[-1]

    def _preempt(self, request: Request, out: SchedulerOutput) -> None:
        self.running.remove(request)
        self.kv_cache_manager.free(request)
        self._release_lora(request)
        out.released_request_ids.append(request.request_id)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        request.preempted_times.append(time.monotonic())
        self.num_preemptions += 1
        self.waiting.prepend(request)
        out.preempted.append(request)

    @staticmethod
    def _unschedule(request: Request, out: SchedulerOutput) -> int:
        """Drop a request preempted after being scheduled this step; returns its tokens."""
        for j, r in enumerate(out.requests):
            if r is request:
                out.requests.pop(j)
                return out.num_scheduled_tokens.pop(j)
        return 0

    def update_from_output(
        self,
        out: SchedulerOutput,
        sampled_token_ids: list[int | None],
        num_accepted_drafts: dict[int, int] | None = None,
    ) -> list[Request]:
        """Advance each scheduled request by its computed tokens and append its sampled token (None
        for a prefill chunk that does not reach the end, or a request that failed); a request that
        verified drafts (request.spec_token_ids) first appends the accepted ones, num_accepted_drafts[j]
        for out.requests[j]. Returns the requests that got a token, finished ones included (an embedder's
        request finishes, tokenless, with its prompt)."""
        kv = self.kv_cache_manager
        block_size = kv.block_size
        updated = []
        now = time.monotonic()
        self.in_flight.difference_update(r.request_id for r in out.requests)
        for j, (request, num_tokens, token) in enumerate(zip(out.requests, out.num_scheduled_tokens,
                                                             sampled_token_ids)):
            if request.is_finished:  # aborted or failed while the step ran
                request.spec_token_ids = []
                continue
            if request.spec_token_ids:
                if self._update_speculative(request, token, (num_accepted_drafts or {}).get(j, 0), now):
                    updated.append(request)
                continue
            computed = request.num_computed_tokens + num_tokens
            request.num_computed_tokens = computed
            # A block just filled, or blocks of KV loaded from another engine are now usable.
            if computed // block_size != (computed - num_tokens) // block_size or request.kv_transfer_params:
                kv.cache_computed_blocks(request)
            if token is None:
                if request.pooling_params is not None and computed >= request.num_prompt_tokens:
                    self._finish(request, RequestStatus.FINISHED_STOPPED)  # pooled: done with its prompt
                    updated.append(request)
                continue
            request.append_output_token(token)
            self.num_generation_tokens += 1
            if request.first_token_time is None:
                request.first_token_time = now
            request.last_token_time = now
            status = self._check_stop(request, token)
            if status is not None:
                self._finish(request, status)
            elif self.num_speculative_tokens:
                kv.free_tail(request)  # draft slots the proposer found no drafts for
            updated.append(request)
        return updated

    def _update_speculative(self, request: Request, token: int | None, num_accepted: int, now: float) -> bool:
        """update_from_output for a request that verified drafts: append the accepted drafts and the
        sampled token, up to a stop (EOS, stop token, max_tokens), and roll back the KV of the rest: the
        computed tokens end after the last accepted draft, and blocks past the request's tokens return
        to the pool. Rejected drafts never enter all_token_ids, so no block hash or cached block holds
        them. Returns whether the request got tokens."""
        drafts, request.spec_token_ids = request.spec_token_ids, []
        if token is None:  # the step failed for this request: nothing was computed
            return False
        kv = self.kv_cache_manager
        self.num_spec_drafts += 1
        self.num_spec_draft_tokens += len(drafts)
        self.num_spec_accepted_tokens += num_accepted
        old = request.num_computed_tokens
        status = None
        for t in drafts[:num_accepted] + [token]:
            request.append_output_token(t)
            self.num_generation_tokens += 1
            status = self._check_stop(request, t)
            if status is not None:
                break  # tokens after a stop are dropped, as if never sampled
        # KV exists for the last token and each accepted draft, but not past the tokens a stop kept.
        request.num_computed_tokens = min(old + 1 + num_accepted, request.num_tokens)
        if request.num_computed_tokens // kv.block_size != old // kv.block_size:
            kv.cache_computed_blocks(request)  # after appending: the hashes cover the accepted drafts
        if request.first_token_time is None:
            request.first_token_time = now
        request.last_token_time = now
        if status is not None:
            self._finish(request, status)
        else:
            kv.free_tail(request)
        return True

    def _check_stop(self, request: Request, token: int) -> RequestStatus | None:
        params = request.sampling_params
        num_output = len(request.output_token_ids)
        if num_output >= params.min_tokens:
            if not params.ignore_eos and token in request.eos_token_ids:
                request.stop_reason = None
                return RequestStatus.FINISHED_STOPPED
            if params.stop_token_ids and token in params.stop_token_ids:
                request.stop_reason = token
                return RequestStatus.FINISHED_STOPPED
        if num_output >= request.max_tokens or len(request.all_token_ids) >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> list[Request]:
        """Finish (e.g. abort) requests wherever they are; unknown or finished ids are ignored."""
        finished = []
        for rid in request_ids:
            request = self.requests.get(rid)
            if request is None:
                continue
            if request.status is RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
            self._finish(request, status)
            finished.append(request)
        return finished

    def _finish(self, request: Request, status: RequestStatus) -> None:
        if request in self.running:
            self.running.remove(request)
        request.status = status
        request.finished_time = time.monotonic()
        held = False
        if self.connector is not None:
            block_ids = self.kv_cache_manager.req_to_block_ids.get(request.request_id, [])
            held, request.kv_transfer_result = self.connector.request_finished(request, block_ids)
        if not held:  # a producer's connector keeps them for the consumer, under a lease
            self.kv_cache_manager.free(request)
        self._release_lora(request)
        self._released.append(request.request_id)
        del self.requests[request.request_id]
        self.num_finished += 1
