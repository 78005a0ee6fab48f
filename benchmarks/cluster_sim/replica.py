"""One simulated engine replica: the engine's own scheduling and prefix cache, with a fitted clock.

The cache is the ground truth every router is judged against, so nothing of it is re-implemented: a
replica is the engine's Scheduler (one token budget per step, running requests first, then waiting ones,
chunked prefill; when blocks run out the latest running request is preempted and later recomputed, and a
step that preempted admits nothing new) over the engine's KVCacheManager and BlockPool (cache full
prompt blocks once computed, free on finish tail-first, LRU eviction of freed blocks at allocation).
Only the model is replaced: each step's duration comes from the fitted step-cost model, and the sampled
token is the one the workload says the model answers.

A decode replica of a disaggregated (P/D) fleet also takes requests whose prompt KV is computed elsewhere
(`reserve_remote`, then `activate_remote`), as vLLM's KV connector does: blocks for the prompt are
allocated first (after this replica's own prefix-cache hit), the KV is pulled into them, and then the
request runs with every prompt token but the last computed; the last one is recomputed here, and its
logits give the first token.

A replica is `starting` (cold start: it takes no requests), `running`, `draining` (chosen to stop: it
takes no new requests and stops when its streams have finished) or `stopped`."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from engine.core.block_hash import BlockHash, short_hash
from engine.core.block_pool import BlockPool
from engine.core.kv_cache_manager import KVCacheManager
from engine.core.request import Request, RequestStatus
from engine.core.scheduler import Scheduler, SchedulerOutput
from engine.sampling_params import SamplingParams

from .fit import StepCostModel, prefill_pairs
from .workloads import SimRequest

_PARAMS = SamplingParams(temperature=0, max_tokens=None, ignore_eos=True, detokenize=False)
_MAX_MODEL_LEN = 1 << 20  # requests end by their own length, never by this


@dataclass(frozen=True)
class ReplicaConfig:
    num_kv_blocks: int = 1024  # usable blocks (the engine adds the null block)
    block_size: int = 16
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048


@dataclass(frozen=True)
class Done:
    """A request that left the replica: finished, or cut when the replica stopped."""

    sim: SimRequest
    cached_tokens: int  # prefix-cache hit at first admission; -1 if never admitted
    preemptions: int


@dataclass(frozen=True)
class StepResult:
    tokens: list[SimRequest]  # every request that got a token in this step (first ones included)
    first_tokens: list[SimRequest]
    finished: list[Done]


class SimReplica:
    def __init__(self, replica_id: str, config: ReplicaConfig, cost: StepCostModel, started_at: float,
                 ready_at: float) -> None:
        self.replica_id = replica_id
        self.config = config
        self.cost = cost
        self.pool = BlockPool(config.num_kv_blocks + 1)
        self.kv = KVCacheManager(self.pool, config.block_size)
        self.scheduler = Scheduler(self.kv, config.max_num_seqs, config.max_num_batched_tokens, _MAX_MODEL_LEN)
        self.state = "starting"
        self.started_at, self.ready_at = started_at, ready_at
        self.stopped_at: float | None = None
        self.drain_started_at: float | None = None
        self.in_step = False
        self._step: SchedulerOutput | None = None
        self._requests: dict[str, tuple[SimRequest, Request]] = {}
        self.inflight_blocks: Counter[BlockHash] = Counter()  # prompt blocks of accepted requests (oracle)
        self._loading: dict[str, Request] = {}  # remote prefills: blocks allocated, KV on its way
        self._loaded: list[Request] = []  # remote prefills whose KV arrived: join the running set next step
        self.busy_s = 0.0
        self.num_steps = 0

    # --- load, as the replica reports it -------------------------------------------------------------
    @property
    def num_running(self) -> int:
        return self.scheduler.num_running

    @property
    def num_waiting(self) -> int:
        return self.scheduler.num_waiting

    @property
    def num_in_flight(self) -> int:
        return len(self._requests)

    @property
    def kv_cache_usage(self) -> float:
        return self.kv.usage

    def cache_summary(self) -> frozenset[int]:
        """What LLMServer.record_routing_stats reports: the short hashes of the cached blocks."""
        return frozenset(short_hash(h) for h in self.pool.cached_block_hash_to_block)

    def holds(self, block_hash: BlockHash) -> bool:
        """Cached now, or about to be: the prompt of a request already accepted here."""
        return block_hash in self.pool.cached_block_hash_to_block or block_hash in self.inflight_blocks

    # --- requests -------------------------------------------------------------------------------------
    def add(self, sim: SimRequest, now: float) -> None:
        assert self.state == "running", f"{self.replica_id} is {self.state}"
        request = Request(sim.request_id, sim.prompt, _PARAMS, len(sim.output), self.config.block_size,
                          arrival_time=now)
        self._requests[sim.request_id] = (sim, request)
        self.inflight_blocks.update(sim.block_hashes(self.config.block_size))
        self.scheduler.add_request(request)

    def reserve_remote(self, sim: SimRequest, now: float) -> int | None:
        """Take a request whose prompt is prefilled on another replica: allocate its blocks now (after the
        prefix this replica already caches, which need not travel). Returns the prompt tokens whose KV must
        be pulled, or None when the pool is short of blocks (the caller retries after a step frees some)."""
        assert self.state == "running", f"{self.replica_id} is {self.state}"
        request = Request(sim.request_id, sim.prompt, _PARAMS, len(sim.output), self.config.block_size,
                          arrival_time=now)
        hit = self.kv.get_computed_blocks(request)
        num_hit = len(hit) * self.config.block_size
        if not self.kv.allocate_slots(request, request.num_tokens - num_hit, hit):
            self.kv.free(request)  # allocate_slots registered the request before it found the pool short
            return None
        request.num_cached_tokens = num_hit
        self.kv.record_prefix_hit(request, num_hit)
        self._requests[sim.request_id] = (sim, request)
        self.inflight_blocks.update(sim.block_hashes(self.config.block_size))
        self._loading[sim.request_id] = request
        return request.num_tokens - num_hit

    def activate_remote(self, request_id: str) -> None:
        """The prompt's KV has arrived: every prompt token but the last counts as computed (vLLM recomputes
        the last one on the decode side), the full blocks enter the prefix cache, and the request joins the
        running set at the next step."""
        request = self._loading.pop(request_id)
        request.num_computed_tokens = request.num_tokens - 1
        self.kv.cache_computed_blocks(request)
        self._loaded.append(request)

    def _admit_loaded(self) -> None:
        """Loaded requests enter the running set (as vLLM's WAITING_FOR_REMOTE_KVS requests do once their KV
        is in), within max_num_seqs; they need one token of budget each."""
        sched = self.scheduler
        while self._loaded and len(sched.running) < sched.max_num_seqs:
            request = self._loaded.pop(0)
            request.status = RequestStatus.RUNNING
            sched.requests[request.request_id] = request
            sched.running.append(request)

    def start_step(self) -> float | None:
        """Schedule one step; returns its duration, or None when there is nothing to run."""
        if not self._requests:
            return None
        self._admit_loaded()
        out = self.scheduler.schedule()
        if out.is_empty:
            if not self.scheduler.running and not self._loading and not self._loaded:
                raise RuntimeError(f"{self.replica_id}: a waiting request can never fit in the KV cache")
            return None
        prefill = decode = 0
        pairs = context = 0.0
        for request, n in zip(out.requests, out.num_scheduled_tokens):
            if n == 1 and request.num_output_tokens and request.num_computed_tokens == request.num_tokens - 1:
                decode += 1
                context += request.num_tokens
            else:
                prefill += n
                pairs += prefill_pairs(n, request.num_computed_tokens)
        self._step, self.in_step = out, True
        duration = self.cost.step_time(prefill, decode, pairs, context)
        self.busy_s += duration
        self.num_steps += 1
        return duration

    def finish_step(self) -> StepResult:
        out, self._step, self.in_step = self._step, None, False
        sampled: list[int | None] = []
        tokens: list[SimRequest] = []
        first: list[SimRequest] = []
        for request, n in zip(out.requests, out.num_scheduled_tokens):
            if request.num_computed_tokens + n < request.num_tokens:
                sampled.append(None)  # a prefill chunk short of the end samples nothing
                continue
            sim = self._requests[request.request_id][0]
            sampled.append(sim.output[request.num_output_tokens])
            tokens.append(sim)
            if request.num_output_tokens == 0:
                first.append(sim)
        self.scheduler.update_from_output(out, sampled)
        finished = []
        for request in out.requests:
            if request.is_finished and request.request_id in self._requests:
                finished.append(self._release(request.request_id))
        return StepResult(tokens, first, finished)

    def cut(self) -> list[Done]:
        """Stop now: every accepted request is cut (its stream dropped)."""
        ids = list(self._requests)
        self.scheduler.finish_requests(ids, RequestStatus.FINISHED_ABORTED)
        for request in [*self._loading.values(), *self._loaded]:
            self.kv.free(request)
        self._loading.clear()
        self._loaded.clear()
        self._step, self.in_step = None, False
        return [self._release(rid) for rid in ids]

    def _release(self, request_id: str) -> Done:
        sim, request = self._requests.pop(request_id)
        blocks = self.inflight_blocks
        for h in sim.block_hashes(self.config.block_size):
            if blocks[h] <= 1:
                del blocks[h]
            else:
                blocks[h] -= 1
        return Done(sim, request.num_cached_tokens, request.num_preemptions)

    @property
    def prefix_cache_queries(self) -> int:
        return self.kv.prefix_cache_queries

    @property
    def prefix_cache_hits(self) -> int:
        return self.kv.prefix_cache_hits
