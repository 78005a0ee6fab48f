"""Scheduler + KVCacheManager + BlockPool driven without a model: random arrivals, shared prefixes,
aborts and configurations, with the pool's and the scheduler's invariants checked after every step.

A fake forward pass stands in for the model: each step it 'writes' into a shadow KV cache, for every
scheduled token, a key identifying the token's whole prefix (and cache salt), then checks that every
scheduled request's context slots hold the keys of its own prefix. That catches a prefix-cache hit on
the wrong block, a shared block being overwritten, or a block table that does not cover the tokens."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.core.block_pool import BlockPool
from engine.core.kv_cache_manager import KVCacheManager
from engine.core.request import Request, RequestStatus
from engine.core.scheduler import Scheduler, SchedulerOutput
from engine.sampling_params import SamplingParams


@dataclass(frozen=True)
class RequestSpec:
    prompt: tuple[int, ...]
    max_tokens: int
    priority: int = 0
    arrival_step: int = 0
    cache_salt: str | None = None


@dataclass(frozen=True)
class Abort:
    step: int
    request: int  # index into Scenario.requests
    mid_step: bool  # between schedule() and update_from_output(), as if while the forward ran


@dataclass(frozen=True)
class Scenario:
    block_size: int
    num_usable_blocks: int
    max_model_len: int
    max_num_batched_tokens: int
    max_num_seqs: int
    chunked_prefill: bool
    prefix_caching: bool
    policy: str
    requests: tuple[RequestSpec, ...]
    aborts: tuple[Abort, ...] = ()


def next_token(token_ids: list[int]) -> int:
    """The fake model's greedy choice: a function of the sequence, so equal prompts decode alike."""
    return 1000 + (7 * len(token_ids) + token_ids[-1]) % 13


def prefix_keys(request: Request) -> list[int]:
    """keys[p] identifies the KV of position p: the tokens 0..p and the cache salt."""
    keys, key = [], hash(("salt", request.cache_salt))
    for token in request.all_token_ids:
        key = hash((key, token))
        keys.append(key)
    return keys


@dataclass
class Harness:
    scenario: Scenario
    scheduler: Scheduler = field(init=False)
    shadow_kv: dict[int, int] = field(default_factory=dict)  # slot -> prefix key
    created: dict[int, Request] = field(default_factory=dict)
    steps: int = 0

    def __post_init__(self) -> None:
        s = self.scenario
        pool = BlockPool(s.num_usable_blocks + 1, enable_caching=s.prefix_caching)
        self.scheduler = Scheduler(
            KVCacheManager(pool, s.block_size),
            max_num_seqs=s.max_num_seqs,
            max_num_batched_tokens=s.max_num_batched_tokens,
            max_model_len=s.max_model_len,
            enable_chunked_prefill=s.chunked_prefill,
            policy=s.policy,
        )

    @property
    def kv(self) -> KVCacheManager:
        return self.scheduler.kv_cache_manager

    def run(self, max_steps: int) -> None:
        s = self.scenario
        last_arrival = max(r.arrival_step for r in s.requests)
        while self.steps <= last_arrival or self.scheduler.has_unfinished_requests():
            assert self.steps < max_steps, f"no progress: {len(self.scheduler.requests)} requests left"
            self.step()
        self.check_final()

    def step(self) -> None:
        s, sched, step = self.scenario, self.scheduler, self.steps
        for i, spec in enumerate(s.requests):
            if spec.arrival_step == step:
                self.created[i] = self._make_request(i, spec)
                sched.add_request(self.created[i])
        self._abort(step, mid_step=False)

        out = sched.schedule()
        self.check_schedule(out)
        self.check_pool()
        self.fake_forward(out)
        self._abort(step, mid_step=True)
        sampled = [
            next_token(r.all_token_ids) if r.num_computed_tokens + n == r.num_tokens else None
            for r, n in zip(out.requests, out.num_scheduled_tokens)
        ]
        sched.update_from_output(out, sampled)
        self.check_pool()
        self.steps += 1

    def _make_request(self, i: int, spec: RequestSpec) -> Request:
        return Request(
            f"req-{i}",
            list(spec.prompt),
            SamplingParams(max_tokens=spec.max_tokens, ignore_eos=True),
            max_tokens=spec.max_tokens,
            block_size=self.scenario.block_size,
            arrival_time=spec.arrival_step + i * 1e-3,
            priority=spec.priority,
            cache_salt=spec.cache_salt,
        )

    def _abort(self, step: int, mid_step: bool) -> None:
        for a in self.scenario.aborts:
            if a.step == step and a.mid_step == mid_step and a.request in self.created:
                self.scheduler.finish_requests([f"req-{a.request}"], RequestStatus.FINISHED_ABORTED)

    def slot(self, request: Request, position: int) -> int:
        bs = self.scenario.block_size
        return self.kv.get_block_ids(request)[position // bs] * bs + position % bs

    def fake_forward(self, out: SchedulerOutput) -> None:
        """Write this step's KV, then check what each request's attention would read."""
        batch = [(r, n, prefix_keys(r)) for r, n in zip(out.requests, out.num_scheduled_tokens)]
        for request, n, keys in batch:
            for p in range(request.num_computed_tokens, request.num_computed_tokens + n):
                self.shadow_kv[self.slot(request, p)] = keys[p]
        for request, n, keys in batch:
            for p in range(request.num_computed_tokens + n):
                assert self.shadow_kv.get(self.slot(request, p)) == keys[p], (
                    f"{request.request_id} reads wrong KV at position {p} (step {self.steps})"
                )

    def check_schedule(self, out: SchedulerOutput) -> None:
        s, sched = self.scenario, self.scheduler
        assert sched.num_running <= s.max_num_seqs
        assert out.total_num_scheduled_tokens <= s.max_num_batched_tokens
        assert len(set(map(id, out.requests))) == len(out.requests) == len(out.num_scheduled_tokens)
        for request, n in zip(out.requests, out.num_scheduled_tokens):
            assert n >= 1
            assert request.status is RequestStatus.RUNNING and request in sched.running
            assert request.num_computed_tokens + n <= request.num_tokens
            assert len(self.kv.get_block_ids(request)) * s.block_size >= request.num_computed_tokens + n
            if not s.chunked_prefill:
                assert request.num_computed_tokens + n == request.num_tokens
        for request in out.preempted:
            assert request not in out.requests and request not in sched.running
        arrived_all = self.steps >= max(r.arrival_step for r in s.requests)
        if sched.has_unfinished_requests() and arrived_all and not out.preempted:
            assert not out.is_empty, "idle step with unfinished requests"

    def check_pool(self) -> None:
        sched, kv = self.scheduler, self.kv
        pool = kv.block_pool
        usable = pool.blocks[1:]
        free = list(pool.free_block_queue)
        free_ids = {b.block_id for b in free}
        assert len(free_ids) == len(free) == pool.get_num_free_blocks()
        assert pool.null_block.ref_cnt == 1 and 0 not in free_ids
        for block in usable:
            assert block.ref_cnt >= 0
            assert (block.ref_cnt == 0) == (block.block_id in free_ids), f"block {block.block_id}"
        assert pool.get_num_free_blocks() == sum(b.ref_cnt == 0 for b in usable)
        for block_hash, block in pool.cached_block_hash_to_block.items():
            assert block.block_hash == block_hash and block is not pool.null_block

        # Every reference belongs to exactly one holding of a running request.
        running_ids = {r.request_id for r in sched.running}
        holders = Counter()
        for rid, blocks in kv.req_to_blocks.items():
            assert rid in running_ids or not blocks, f"{rid} holds blocks but is not running"
            assert [b.block_id for b in blocks] == kv.req_to_block_ids[rid]
            assert len({b.block_id for b in blocks}) == len(blocks)
            holders.update(b.block_id for b in blocks)
        for block in usable:
            assert block.ref_cnt == holders[block.block_id], f"block {block.block_id}"
        assert sum(holders.values()) == sum(b.ref_cnt for b in pool.blocks) - 1  # the null block's

        assert len(sched.running) + len(sched.waiting) == len(sched.requests)
        for request in sched.running:
            assert request.status is RequestStatus.RUNNING
            assert request.num_computed_tokens <= request.num_tokens
            assert all(b.ref_cnt >= 1 for b in kv.req_to_blocks[request.request_id])
        for request in sched.waiting:
            assert request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
            assert request.num_computed_tokens == 0 and request not in sched.running

    def check_final(self) -> None:
        pool = self.kv.block_pool
        assert pool.get_num_free_blocks() == pool.num_usable_blocks
        assert not any(self.kv.req_to_blocks.values())
        assert not self.scheduler.running and not len(self.scheduler.waiting)
        for request in self.created.values():
            assert request.is_finished
            if request.status is RequestStatus.FINISHED_ABORTED:
                continue
            assert request.status is RequestStatus.FINISHED_LENGTH
            assert request.num_output_tokens == request.max_tokens
            expected = list(request.prompt_token_ids)
            while len(expected) < request.num_tokens:
                expected.append(next_token(expected))
            assert request.all_token_ids == expected  # each sampled token appended once, in order


def max_steps_for(s: Scenario) -> int:
    work = sum(len(r.prompt) + r.max_tokens for r in s.requests)
    return max(r.arrival_step for r in s.requests) + 10 * work + 50


# --- property test ------------------------------------------------------------------------------------


@st.composite
def scenarios(draw: st.DrawFn) -> Scenario:
    block_size = draw(st.sampled_from([1, 2, 4, 8, 16]))
    max_model_len = draw(st.integers(8, 64))
    min_blocks = -(-max_model_len // block_size)  # one request of max_model_len always fits
    num_usable_blocks = draw(st.integers(min_blocks, 3 * min_blocks))
    chunked = draw(st.booleans())
    lowest_budget = 1 if chunked else max_model_len  # without chunking a prompt must fit one step
    max_num_batched_tokens = draw(st.integers(lowest_budget, lowest_budget + 48))

    shared_prefixes = [list(range(base, base + max_model_len)) for base in (0, 100)]
    fresh = iter(range(200, 10_000))  # unique tokens after the shared part
    requests: list[RequestSpec] = []
    for _ in range(draw(st.integers(1, 12))):
        source = draw(st.sampled_from(["fresh", "shared", "shared", "repeat"]))
        if source == "repeat" and requests:  # the same prompt again: fully cached if computed
            prompt = list(draw(st.sampled_from(requests)).prompt)
        else:
            prompt_len = draw(st.integers(1, max_model_len - 1))
            shared = 0 if source == "fresh" else draw(st.integers(0, prompt_len))
            prefix = shared_prefixes[draw(st.integers(0, 1))][:shared]
            prompt = prefix + [next(fresh) for _ in range(prompt_len - shared)]
        prompt_len = len(prompt)
        requests.append(
            RequestSpec(
                prompt=tuple(prompt),
                max_tokens=min(draw(st.integers(1, 24)), max_model_len - prompt_len),
                priority=draw(st.integers(0, 3)),
                arrival_step=draw(st.integers(0, 16)),
                cache_salt=draw(st.sampled_from([None, None, None, "tenant"])),
            )
        )
    aborts = draw(
        st.lists(
            st.builds(Abort, st.integers(0, 30), st.integers(0, len(requests) - 1), st.booleans()),
            max_size=3,
        )
    )
    return Scenario(
        block_size=block_size,
        num_usable_blocks=num_usable_blocks,
        max_model_len=max_model_len,
        max_num_batched_tokens=max_num_batched_tokens,
        max_num_seqs=draw(st.integers(1, 6)),
        chunked_prefill=chunked,
        prefix_caching=draw(st.booleans()),
        policy=draw(st.sampled_from(["fcfs", "priority"])),
        requests=tuple(requests),
        aborts=tuple(aborts),
    )


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
def test_scheduler_keeps_invariants_and_finishes_everything(scenario: Scenario) -> None:
    harness = Harness(scenario)
    harness.run(max_steps_for(scenario))


# --- deterministic scenarios --------------------------------------------------------------------------


def _uniform(num: int, prompt_len: int, max_tokens: int, **kw) -> tuple[RequestSpec, ...]:
    return tuple(
        RequestSpec(tuple(range(100 * i, 100 * i + prompt_len)), max_tokens, **kw) for i in range(num)
    )


def _scenario(requests: tuple[RequestSpec, ...], **overrides) -> Scenario:
    config = dict(
        block_size=4,
        num_usable_blocks=8,
        max_model_len=32,
        max_num_batched_tokens=64,
        max_num_seqs=8,
        chunked_prefill=True,
        prefix_caching=True,
        policy="fcfs",
    )
    return Scenario(**{**config, **overrides}, requests=requests)


def test_tight_pool_preempts_and_still_finishes() -> None:
    # Four requests of 8 prompt tokens all fit at admission (2 blocks each) but grow to 6 blocks.
    scenario = _scenario(_uniform(4, prompt_len=8, max_tokens=16))
    harness = Harness(scenario)
    harness.run(max_steps_for(scenario))
    assert harness.scheduler.num_preemptions > 0
    assert any(r.num_preemptions > 0 for r in harness.created.values())


def test_tight_pool_preempts_without_chunked_prefill_or_caching() -> None:
    scenario = _scenario(_uniform(4, prompt_len=8, max_tokens=16), chunked_prefill=False, prefix_caching=False)
    harness = Harness(scenario)
    harness.run(max_steps_for(scenario))
    assert harness.scheduler.num_preemptions > 0


def test_priority_policy_preempts_the_lowest_priority_request() -> None:
    requests = (
        RequestSpec(tuple(range(0, 8)), 16, priority=0),
        RequestSpec(tuple(range(100, 108)), 16, priority=5),
        RequestSpec(tuple(range(200, 208)), 16, priority=1),
    )
    harness = Harness(_scenario(requests, num_usable_blocks=10, policy="priority"))
    preempted: list[str] = []
    while harness.scheduler.has_unfinished_requests() or harness.steps == 0:
        assert harness.steps < 200
        before = harness.scheduler.num_preemptions
        harness.step()
        if harness.scheduler.num_preemptions > before and not preempted:
            preempted = [r.request_id for r in harness.created.values() if r.num_preemptions]
    assert preempted == ["req-1"]
    harness.check_final()


def test_shared_prefix_hits_the_cache() -> None:
    prefix = tuple(range(12))
    requests = (
        RequestSpec(prefix + (50, 51), 4),
        RequestSpec(prefix + (60, 61, 62), 4, arrival_step=2),  # after the first one's prefill
        RequestSpec(prefix + (70,), 4, arrival_step=2, cache_salt="other"),  # another tenant
    )
    harness = Harness(_scenario(requests, num_usable_blocks=16))
    harness.run(200)
    first, second, salted = (harness.created[i] for i in range(3))
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens == 12
    assert salted.num_cached_tokens == 0
    assert harness.kv.prefix_cache_hits == 12
