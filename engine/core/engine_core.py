"""EngineCore: the one owner of each step. It holds the scheduler, the executor and the KV connector, and
every step reads: schedule -> build the model input -> executor -> sample -> update the scheduler -> emit.
It takes prepared requests and gives back, per step, what changed in each sample it advanced, in token
ids only (EngineCoreOutput). Text is made by the frontend (engine/frontend/output_processor.py, in the
caller's process), which tells the core which samples a stop string ended (`stop`). Not thread-safe: one
thread drives it (LLMEngine's caller, or the engine loop of engine/core/engine_loop.py)."""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Iterable
from concurrent import futures

import numpy as np
import torch
from transformers import PreTrainedTokenizerBase

from engine.config import EngineConfig, resolve_max_num_batched_tokens
from engine.core.batch_builder import BatchBuilder, StepPlan
from engine.core.block_hash import hash_block_chain, short_hash
from engine.core.block_pool import BlockPool
from engine.core.block_table import BlockTable
from engine.core.core_output import EngineCoreOutput
from engine.core.encoder_cache import EncoderCache
from engine.core.kv_cache_groups import KVCacheGroups
from engine.core.kv_cache_manager import KVCacheManager
from engine.core.prepared_request import PreparedRequest
from engine.core.request import Request, RequestStatus
from engine.core.scheduler import Scheduler, SchedulerOutput
from engine.distributed.data_parallel import DataParallelControl
from engine.errors import WorkerFailedError
from engine.executor import ModelInput, Rendezvous, create_executor
from engine.executor.worker import INIT_TIMEOUT, threads_per_rank
from engine.kv_transfer.factory import create_kv_connector
from engine.lora.manager import LoRAManager
from engine.lora.request import LoRARequest
from engine.model_spec import ModelSpec
from engine.outputs import Logprob, StepTiming
from engine.pooling.pooler import Pooler
from engine.sample.sampler import Sampler, sample_seed
from engine.sample.step_sampler import LogprobEntry, StepOutput, StepSampler
from engine.sampling_params import RequestOutputKind
from engine.spec_decode.draft_proposer import DraftCheckpoint, DraftModelProposer
from engine.spec_decode.drafter import Drafter
from engine.spec_decode.mtp_proposer import MTPProposer
from engine.spec_decode.ngram_proposer import NgramProposer
from engine.stats import EngineStats
from engine.structured_output import StructuredOutputManager
from engine.tokenizer import resolve_eos_token_ids, tokenizer_for

logger = logging.getLogger(__name__)

_MAX_FAILED_STEPS = 3  # single-request steps failing in a row before the engine declares itself dead


class EngineCore:
    def __init__(self, config: EngineConfig, spec: ModelSpec, tokenizer: PreTrainedTokenizerBase,
                 rendezvous: Rendezvous | None = None) -> None:
        """`tokenizer`: for grammars (structured outputs) and the EOS tokens only. `rendezvous`: workers of a
        multi-rank engine that a launcher already started (AsyncLLM, the serving app); without it a
        multi-rank engine spawns its own (`mp`)."""
        self.config = config
        eos_token_ids = resolve_eos_token_ids(spec.model_config, tokenizer)
        ranks_on_host = config.world_size * config.data_parallel_size
        if config.num_threads is not None or ranks_on_host > 1:
            torch.set_num_threads(threads_per_rank(config, ranks_on_host))
        self.model_config = spec.model_config
        self.max_model_len = spec.max_model_len
        self.max_num_batched_tokens = resolve_max_num_batched_tokens(config, self.max_model_len)
        self.kv_groups = KVCacheGroups.of(spec.model_config)
        self.kv_dtype_bytes = spec.dtype.itemsize
        self.eos_token_ids = eos_token_ids
        draft = config.speculative_config
        # The draft's config is checked before any worker starts; its KV shares the target's block budget.
        draft_checkpoint = None
        if draft is not None and draft.method == "draft_model":
            draft_checkpoint = DraftCheckpoint.resolve(draft.model, spec)
        elif draft is not None and draft.method == "mtp":
            draft_checkpoint = DraftCheckpoint.mtp(spec)
        draft_bytes = draft_checkpoint.kv_bytes_per_block(config.block_size, spec.dtype) if draft_checkpoint else 0
        self.executor = create_executor(config, spec, rendezvous, draft_bytes)
        self.kv_connector = None
        self.dp: DataParallelControl | None = None  # a DP rank's lockstep with the other DP ranks
        try:  # the workers of a multi-rank engine are up: a failure from here on stops them
            # Every tensor of a step is made on the driver rank's device.
            device = self.executor.device
            sampler = Sampler(config.seed, device)
            max_blocks = -(-self.max_model_len // config.block_size)
            block_tables = [BlockTable(config.max_num_seqs, max_blocks) for _ in self.kv_groups.windows]
            block_table = block_tables[0]
            drafter = None
            if draft_checkpoint is not None:
                worker = draft_checkpoint.build_worker(config, spec, device, self.executor.num_blocks)
                proposer = (MTPProposer(worker, block_table, config.block_size, sampler.generator,
                                        self.executor.driver_worker) if draft.method == "mtp"
                            else DraftModelProposer(worker, block_table, config.block_size, sampler.generator))
                drafter = Drafter(model=proposer)
            elif draft is not None:
                drafter = Drafter(ngram=NgramProposer(draft.prompt_lookup_min, draft.prompt_lookup_max))
            self.kv_connector = create_kv_connector(config, self.model_config, spec.dtype, "scheduler")
            self.lora_manager = None
            if config.enable_lora:
                executor = self.executor
                self.lora_manager = LoRAManager(
                    self.model_config, config.max_loras, config.cpu_lora_capacity, config.max_lora_rank,
                    lambda slot, adapter: executor.collective_rpc("load_lora", slot, adapter),
                )
            self.encoder_cache = None  # a vision-language model's images held by the workers
            if spec.model_config.vision is not None:
                per_embedding = spec.model_config.hidden_size * spec.dtype.itemsize
                self.encoder_cache = EncoderCache(int(config.mm_encoder_cache_gb * 2**30), per_embedding)
            self.scheduler = self._build_scheduler(self.executor.num_blocks)
            self.kv_bytes_per_token = sum(self.executor.driver_worker.kv_bytes_per_block()) // config.block_size
            self.structured_output = StructuredOutputManager(
                tokenizer, self.model_config.vocab_size, eos_token_ids, config.max_num_seqs
            )
            mrope_merge = spec.model_config.vision.spatial_merge_size if spec.model_config.mrope_section else None
            self.pooler_config = spec.pooler_config
            self.pooler = Pooler(spec.pooler_config) if spec.pooler_config is not None else None
            self.batch_builder = BatchBuilder(config, block_tables, drafter, self.kv_connector, self.encoder_cache,
                                              mrope_merge, self.pooler)
            self.step_sampler = StepSampler(sampler, device, self.model_config.vocab_size, self.structured_output)
            if config.data_parallel_size > 1:
                self.dp = DataParallelControl(config.data_parallel_master, config.data_parallel_rank,
                                              config.data_parallel_size, config.step_timeout_s, INIT_TIMEOUT)
        except BaseException:
            self.shutdown()
            raise
        self._compiling: dict[str, list[Request]] = {}  # samples whose grammar is still compiling
        self._children: dict[str, list[Request]] = {}  # in-flight parent id -> its samples
        self._parked: dict[str, list[Request]] = {}  # samples waiting for their first sibling's prefill
        self._num_steps = 0
        self._encoder_seconds_seen = 0.0
        self._consecutive_failed_steps = 0
        self._pipeline_depth = config.pipeline_parallel_size
        self._in_flight: deque[tuple[StepPlan, float]] = deque()

    @classmethod
    def from_config(cls, config: EngineConfig, rendezvous: Rendezvous | None = None,
                    tokenizer: PreTrainedTokenizerBase | None = None) -> EngineCore:
        """For an engine process, which shares no model spec with its frontend. `tokenizer`: the frontend's,
        passed over (unpickling it takes 0.15 s; loading one takes 3-4 s, most of it transformers
        importing the model's config classes to pick the tokenizer's)."""
        spec = ModelSpec.resolve(config)
        return cls(config, spec, tokenizer or tokenizer_for(config, spec.path), rendezvous)

    def _build_scheduler(self, num_blocks: int) -> Scheduler:
        config = self.config
        if (num_blocks - 1) * config.block_size < self.max_model_len:
            raise ValueError(
                f"num_kv_blocks: {num_blocks - 1} usable blocks of {config.block_size} tokens cannot hold one "
                f"request of max_model_len={self.max_model_len}; raise the KV budget or lower max_model_len"
            )
        sizes = self.kv_groups.pool_sizes(num_blocks, config.block_size, config.max_num_seqs,
                                          self.max_num_batched_tokens)
        managers = [KVCacheManager(BlockPool(size, enable_caching=config.enable_prefix_caching), config.block_size,
                                   window) for size, window in zip(sizes, self.kv_groups.windows)]
        managers[0].window_groups = managers[1:]
        if self.kv_groups.has_window_groups:
            logger.info("KV cache: %s", self.kv_groups.describe(sizes, self.model_config, config.block_size,
                                                                self.kv_dtype_bytes))
        return Scheduler(
            managers[0],
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            enable_chunked_prefill=config.enable_chunked_prefill,
            policy=config.scheduling_policy,
            num_speculative_tokens=config.speculative_config.num_speculative_tokens if config.speculative_config else 0,
            connector=self.kv_connector,
            lora_manager=self.lora_manager,
            encoder_cache=self.encoder_cache,
            encoder_budget=config.max_num_encoder_input_tokens or self.max_num_batched_tokens,
        )

    # --- requests in --------------------------------------------------------------------------------------

    def add_request(self, prepared: PreparedRequest) -> None:
        """Enqueue a prepared request as its n samples. ValueError (nothing enqueued) if it cannot run here."""
        rid, params = prepared.request_id, prepared.sampling_params
        if prepared.is_pooling != (self.pooler is not None):
            raise ValueError(f"pooling_params: this engine runs task='{self.config.task}'; it takes "
                             f"{'embedding' if self.pooler is not None else 'generation'} requests only")
        if rid in self._children or (self.kv_connector is not None and self.kv_connector.holds(rid)):
            raise ValueError(f"request_id: {rid!r} is already in flight (or its KV is held for a consumer)")
        room = self.max_model_len - len(prepared.prompt_token_ids)
        adapter = self._resolve_lora(prepared.lora_request)
        hashes = prepared.block_hashes
        digest = adapter.digest if adapter is not None else None
        num_blocks = len(prepared.prompt_token_ids) // self.config.block_size
        if hashes is None or prepared.lora_digest != digest or len(hashes) != num_blocks:
            # Hashed under another adapter's weights (or not at all): the prefix cache must not mix them.
            hashes = hash_block_chain(prepared.prompt_token_ids, self.config.block_size, prepared.cache_salt,
                                      lora_digest=digest, mm_inputs=prepared.mm_inputs)
        children = [
            Request(
                request_id=rid if params.n == 1 else f"{rid}#{i}",
                prompt_token_ids=prepared.prompt_token_ids,
                sampling_params=params,
                max_tokens=min(params.max_tokens or room, room),
                block_size=self.config.block_size,
                eos_token_ids=self.eos_token_ids,
                arrival_time=prepared.arrival_time,
                priority=prepared.priority,
                cache_salt=prepared.cache_salt,
                seed=None if params.seed is None else (params.seed if i == 0 else sample_seed(params.seed, -i)),
                parent_id=None if params.n == 1 else rid,
                index=i,
                # The first sample loads or produces the prompt's KV; its siblings share it (prefix cache).
                kv_transfer_params=prepared.kv_transfer_params if i == 0 else None,
                lora=adapter,
                mm_inputs=prepared.mm_inputs,
                block_hashes=hashes,  # one list for every sample: a sample extends it into a new list
                pooling_params=prepared.pooling_params,
                skip_reading_prefix_cache=prepared.is_pooling and self.pooler_config.reads_every_position,
            )
            for i in range(params.n)
        ]
        self._children[rid] = children
        if params.structured_outputs is not None:
            # Compiled off the step loop; the scheduler sees the request once its grammar is ready.
            self.structured_output.add(children)
            self._compiling[rid] = children
        else:
            self._enqueue(rid, children)

    def _resolve_lora(self, lora_request: LoRARequest | None):
        if lora_request is None:
            return None
        if self.lora_manager is None:
            raise ValueError("lora_request: this engine was started without enable_lora=True")
        return self.lora_manager.resolve(lora_request)

    def add_lora(self, lora_request: LoRARequest) -> bool:
        self._resolve_lora(lora_request)
        return True

    def remove_lora(self, lora_int_id: int) -> bool:
        return self.lora_manager.remove(lora_int_id) if self.lora_manager is not None else False

    def list_loras(self) -> set[int]:
        return set(self.lora_manager.host) if self.lora_manager is not None else set()

    def _enqueue(self, rid: str, children: list[Request]) -> None:
        self.scheduler.add_request(children[0])
        if len(children) > 1 and self.config.enable_prefix_caching:
            # The other samples wait for the first to compute the prompt, then share its blocks.
            self._parked[rid] = children[1:]
        else:
            for child in children[1:]:
                self.scheduler.add_request(child)

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus,
                        error: str | None = None) -> list[Request]:
        """Finish requests by the ids callers know (aborts, failures); returns the samples it finished.
        Unknown ids are ignored."""
        requests = []
        for rid in request_ids:
            parked = self._parked.pop(rid, []) + self._compiling.pop(rid, [])
            for child in self._children.get(rid, []):
                if child.is_finished:
                    continue
                child.error = error
                if child in parked:  # never queued: nothing to free
                    child.status, child.finished_time = status, time.monotonic()
                else:
                    self.scheduler.finish_requests([child.request_id], status)
                requests.append(child)
        return requests

    def abort(self, request_ids: Iterable[str]) -> list[EngineCoreOutput]:
        """Abort requests by the ids callers know; their final outputs. Unknown ids are ignored."""
        return self._emit(self.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED))

    def stop(self, samples: Iterable[tuple[str, int]]) -> None:
        """The frontend found a stop string in these samples' text ((caller's id, index) pairs) and already
        made their final outputs: they end now, with "stop", and send nothing more."""
        for rid, index in samples:
            children = self._children.get(rid)
            if children is None or children[index].is_finished:
                continue  # it finished here meanwhile (the frontend learns it from the step's outputs)
            self.scheduler.finish_requests([children[index].request_id], RequestStatus.FINISHED_STOPPED)
            self._forget_if_done(rid)

    def _forget_if_done(self, rid: str) -> None:
        children = self._children.get(rid)
        if children is not None and all(c.is_finished for c in children):
            del self._children[rid]
            for child in children:
                self.structured_output.release(child)
            self._parked.pop(rid, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self._children) or bool(self._in_flight)  # steps in flight are drained even if aborted

    def wants_step(self, poll: bool = True) -> bool:
        """Whether the engine loop should call `step` now: unfinished requests here, or (a DP rank) a wave of
        the data-parallel group running, which every rank steps through (engine/distributed/data_parallel.py).
        `poll`: first take the wave messages that came (raises WorkerFailedError if the group is broken)."""
        if self.dp is None:
            return self.has_unfinished_requests()
        if poll:
            self.dp.poll()
        return self.dp.in_wave or self.has_unfinished_requests()

    def wait_sources(self) -> list:
        """What an idle engine loop must wake on besides its commands (a DP rank: a wave started elsewhere)."""
        return self.dp.wait_sources() if self.dp is not None else []

    @property
    def num_unfinished_requests(self) -> int:
        return len(self._children)

    # --- the step -----------------------------------------------------------------------------------------

    def step(self) -> list[EngineCoreOutput]:
        """Run one scheduled step; returns what changed in the samples it advanced or finished."""
        if self.dp is not None:
            return self._emit(self._step_data_parallel())
        return self._emit(self._step())

    def _step_data_parallel(self) -> list[Request]:
        """A DP rank's turn: join or start the group's wave, tell the other ranks this step's tokens, and run the
        step with them; with no tokens here but some elsewhere, a one-token dummy step (the MoE layers' collectives
        need every rank). Any failure of the forward is fatal: the ranks are out of step, nothing can be re-run."""
        dp = self.dp
        dp.poll()
        if self.has_unfinished_requests():
            dp.start()
        if not dp.in_wave:
            return []
        compile_failures = self._release_compiled()
        so = self.scheduler.schedule()
        plan = None if so.is_empty else self.batch_builder.build(so, self.scheduler.kv_cache_manager)
        counts = dp.exchange(plan.inp.num_tokens if plan is not None else 0, self.has_unfinished_requests())
        if plan is None:
            self.batch_builder.release(so.released_request_ids)
            if any(counts):
                self._num_steps += 1
                self.executor.execute_model(self._dummy_input(counts))
            elif self._compiling:  # nothing schedulable anywhere: wait for a grammar rather than spin
                futures.wait([c[0].grammar.future for c in self._compiling.values()], 0.02, futures.FIRST_COMPLETED)
            elif dp.in_wave:  # requests on another rank, none schedulable there either
                time.sleep(0.005)
            return compile_failures
        self._num_steps += 1
        plan.inp.dp_num_tokens = counts
        start = time.monotonic()
        logits = self.executor.execute_model(plan.inp)
        try:
            return compile_failures + self._update(so, self._sample(plan, logits), [], start)
        except WorkerFailedError:
            raise
        except Exception:
            logger.exception("sampling a step of %d requests failed; failing them", len(so.requests))
        failed = [r.external_id for r in so.requests]
        so.num_scheduled_tokens[:] = [0] * len(so.requests)
        return compile_failures + self._update(so, StepOutput.empty(len(so.requests)), failed, start)

    def _dummy_input(self, dp_num_tokens: list[int]) -> ModelInput:
        """One token at position 0 whose KV goes to the null block (block 0, which no request reads), nothing
        sampled: this rank's part of a step in which only other DP ranks have work."""
        tables = [np.zeros((1, 1), dtype=np.int32) for _ in self.kv_groups.windows]
        inp = ModelInput.build([0], [0], [1], tables[0], self.config.block_size, window_block_tables=tables[1:])
        inp.dp_num_tokens = dp_num_tokens
        return inp

    def _step(self) -> list[Request]:
        self.poll_kv_leases()
        compile_failures = self._release_compiled()
        if self._pipeline_depth > 1:
            return compile_failures + self._step_pipelined()
        so = self.scheduler.schedule()
        self._num_steps += 1
        if so.is_empty:
            self._idle(so)
            return compile_failures
        start = time.monotonic()
        out, failed = self._execute_isolated(so)
        return compile_failures + self._update(so, out, failed, start)

    def _emit(self, updated: list[Request]) -> list[EngineCoreOutput]:
        """What each sample gained since its last output. A final-only request without stop strings sends
        nothing until it finishes: its frontend makes text once, at the end."""
        outputs = []
        for r in updated:
            finished, params = r.is_finished, r.sampling_params
            if not finished and params.output_kind is RequestOutputKind.FINAL_ONLY and not params.stop:
                continue
            new_token_ids = r.output_token_ids[r.num_emitted_tokens :]
            r.num_emitted_tokens = r.num_output_tokens
            new_logprobs = None
            if r.logprobs is not None:
                new_logprobs = r.logprobs[r.num_emitted_logprobs :]
                r.num_emitted_logprobs = len(r.logprobs)
            prompt_logprobs = None
            if r.index == 0 and r.prompt_logprobs is not None and not r.prompt_logprobs_emitted \
                    and not r.wants_prompt_logprobs:
                prompt_logprobs, r.prompt_logprobs_emitted = r.prompt_logprobs, True
            steps = ()
            if r.step_timings:
                steps = tuple(r.step_timings)
                r.step_timings.clear()
            outputs.append(EngineCoreOutput(
                r.external_id, r.index, new_token_ids, new_logprobs, r.cumulative_logprob, r.finish_reason,
                r.stop_reason, r.error, max(r.num_cached_tokens, 0), prompt_logprobs,
                r.kv_transfer_result if finished else None, r.first_scheduled_time, r.first_token_time,
                r.last_token_time, r.finished_time, tuple(r.preempted_times) if r.preempted_times else (), steps,
                r.pooled if finished else None,
            ))
            if finished:
                self._forget_if_done(r.external_id)
        return outputs

    def _execute(self, so: SchedulerOutput) -> StepOutput:
        plan = self.batch_builder.build(so, self.scheduler.kv_cache_manager)
        return self._sample(plan, self.executor.execute_model(plan.inp))

    def _sample(self, plan: StepPlan, logits: torch.Tensor | None) -> StepOutput:
        if plan.inp.kv_meta is not None:  # every rank ran the step: its loads are done
            self.kv_connector.loads_done(plan.inp.kv_meta)
        if self.pooler is not None:  # `logits` are an embedder's pooled sums, one row per plan.pooled
            self._pool(plan, logits)
            return StepOutput.empty(len(plan.so.requests))
        return self.step_sampler.sample(plan, logits)

    def _pool(self, plan: StepPlan, sums: torch.Tensor | None) -> None:
        """Add the step's pooled rows to each request's sum; a request whose prompt this step completes gets its
        embedding (the scheduler then finishes it)."""
        so = plan.so
        for (j, start), row in zip(plan.pooled, sums if sums is not None else ()):
            request = so.requests[j]
            request.pooled_sum = self.pooler.accumulate(request.pooled_sum, start, row)
        for request, num_tokens in zip(so.requests, so.num_scheduled_tokens):
            # Not yet advanced past this step: its prompt is done when the step's tokens reach the end.
            if request.num_computed_tokens + num_tokens == request.num_prompt_tokens:
                request.pooled = self.pooler.finish(request.pooled_sum, request.num_prompt_tokens,
                                                    request.pooling_params)
                request.pooled_sum = None

    def _step_pipelined(self) -> list[Request]:
        """Pipeline parallelism: up to pipeline_parallel_size steps in flight. A new step is submitted
        before the oldest is collected, so that the earlier stages compute it while the driver (the last
        stage) finishes the oldest. A step whose sampling fails fails its requests (steps cannot be
        re-run one request at a time while others are in flight); a rank's failure is fatal."""
        submitted = False
        if len(self._in_flight) < self._pipeline_depth:
            so = self.scheduler.schedule()
            if so.is_empty:
                if not self._in_flight:
                    self._idle(so)
                    return []
                self.batch_builder.release(so.released_request_ids)
            else:
                self._num_steps += 1
                plan = self.batch_builder.build(so, self.scheduler.kv_cache_manager)
                self.executor.submit(plan.inp)
                self._in_flight.append((plan, time.monotonic()))
                submitted = True
        if not self._in_flight or (submitted and len(self._in_flight) < self._pipeline_depth):
            return []  # room for another step before the oldest must come back
        plan, start = self._in_flight.popleft()
        logits = self.executor.collect()
        try:
            return self._update(plan.so, self._sample(plan, logits), [], start)
        except WorkerFailedError:
            raise
        except Exception:
            logger.exception("sampling a pipelined step of %d requests failed; failing them", len(plan.so.requests))
        so = plan.so
        failed = [r.external_id for r in so.requests]
        so.num_scheduled_tokens[:] = [0] * len(so.requests)
        return self._update(so, StepOutput.empty(len(so.requests)), failed, start)

    def _idle(self, so: SchedulerOutput) -> None:
        self.batch_builder.release(so.released_request_ids)
        if self._compiling:  # nothing to run but grammars compiling: wait for one rather than spin
            futures.wait([c[0].grammar.future for c in self._compiling.values()], 0.02, futures.FIRST_COMPLETED)

    def _update(self, so: SchedulerOutput, out: StepOutput, failed: list[str], start: float) -> list[Request]:
        """Apply a step's results: tokens, logprobs, grammars, failures; the samples it advanced."""
        if self.config.collect_step_timings:
            self._record_step(so, start, time.monotonic(), self._take_encoder_seconds())
        for j, entries in out.prompt_logprobs.items():
            so.requests[j].prompt_logprobs.extend(_logprob_dict(e) for e in entries)
        updated = self.scheduler.update_from_output(so, out.sampled_token_ids, out.num_accepted_drafts)
        for j, (request, entry) in enumerate(zip(so.requests, out.logprobs)):
            if entry is not None:
                # One entry per token appended: accepted drafts first; a stop may have cut some.
                entries = out.draft_logprobs[j] + [entry] if j in out.draft_logprobs else [entry]
                for e in entries[: request.num_output_tokens - len(request.logprobs)]:
                    request.logprobs.append(_logprob_dict(e))
                    request.cumulative_logprob += e[1][0]
        for request in updated:
            if request.thinking is not None:
                request.thinking.advance(request.output_token_ids)
        self._advance_grammars(updated)
        failures = self.finish_requests(failed, RequestStatus.FINISHED_ERROR,
                                        error="the engine failed while running this request")
        self._release_parked()
        return failures + updated

    def _release_compiled(self) -> list[Request]:
        """Queue the requests whose grammar has compiled; fail those whose compile failed."""
        if not self._compiling:
            return []
        failed = []
        for rid, children in list(self._compiling.items()):
            state = children[0].grammar
            if not state.ready:
                continue
            error = state.error()
            if error is not None:
                failed.extend(self.finish_requests([rid], RequestStatus.FINISHED_ERROR, error=error))
            else:
                del self._compiling[rid]
                self._enqueue(rid, children)
        return failed

    def _advance_grammars(self, updated: list[Request]) -> None:
        """Matchers consume the new tokens; a completed grammar ends its request with "stop"."""
        terminated, rejected = self.structured_output.advance(updated)
        for request in terminated:
            self.scheduler.finish_requests([request.request_id], RequestStatus.FINISHED_STOPPED)
        for request in rejected:
            request.error = "a sampled token broke the request's structured_outputs grammar"
            self.scheduler.finish_requests([request.request_id], RequestStatus.FINISHED_ERROR)

    def _take_encoder_seconds(self) -> float:
        """The driver worker's encoder time since the last call: this step's (a step later than the one
        encoding, at worst, under pipeline parallelism's steps in flight)."""
        total = self.executor.driver_worker.encoder_seconds
        step, self._encoder_seconds_seen = total - self._encoder_seconds_seen, total
        return step

    @staticmethod
    def _record_step(so: SchedulerOutput, start: float, end: float, encoder_seconds: float) -> None:
        batch_tokens = so.total_num_scheduled_tokens
        for request, num_tokens in zip(so.requests, so.num_scheduled_tokens):
            first = request.num_computed_tokens  # advanced past this step's tokens only after this
            encoded = encoder_seconds if any(image.offset < first + num_tokens and image.end > first
                                             for image in request.mm_inputs) else 0.0
            request.step_timings.append(StepTiming(start, end, num_tokens, len(so.requests), batch_tokens,
                                                   encoded))

    def _execute_isolated(self, so: SchedulerOutput) -> tuple[StepOutput, list[str]]:
        """Run the step; if it raises, run each request alone so that only the culprits fail. Raises
        when the engine itself looks broken: every request of a batch fails alone too, or steps of a
        single request keep failing."""
        try:
            out = self._execute(so)
            self._consecutive_failed_steps = 0
            return out, []
        except WorkerFailedError:  # the ranks are out of step: nothing can be retried
            raise
        except Exception:
            logger.exception("step of %d requests failed; retrying them one by one", len(so.requests))
        merged = StepOutput.empty(len(so.requests))
        failed, errors = [], []
        for j, (request, n) in enumerate(zip(so.requests, so.num_scheduled_tokens)):
            alone = SchedulerOutput([request], [n])
            try:
                single = self._execute(alone)
            except WorkerFailedError:
                raise
            except Exception as e:
                failed.append(request.external_id)
                errors.append(e)
                so.num_scheduled_tokens[j] = 0
                continue
            so.num_scheduled_tokens[j] = alone.num_scheduled_tokens[0]  # draft slots shrink to the drafts found
            merged.sampled_token_ids[j] = single.sampled_token_ids[0]
            merged.logprobs[j] = single.logprobs[0]
            if 0 in single.num_accepted_drafts:
                merged.num_accepted_drafts[j] = single.num_accepted_drafts[0]
            if 0 in single.draft_logprobs:
                merged.draft_logprobs[j] = single.draft_logprobs[0]
            if 0 in single.prompt_logprobs:
                merged.prompt_logprobs[j] = single.prompt_logprobs[0]
        if len(failed) < len(so.requests):
            self._consecutive_failed_steps = 0
        else:
            self._consecutive_failed_steps += 1
            if len(so.requests) > 1 or self._consecutive_failed_steps >= _MAX_FAILED_STEPS:
                raise errors[0]
        return merged, failed

    def _release_parked(self) -> None:
        for rid, waiting in list(self._parked.items()):
            first = self._children[rid][0]
            if first.is_finished or first.num_computed_tokens >= first.num_prompt_tokens:
                for child in reversed(waiting):  # they arrived before anything now waiting
                    self.scheduler.add_request(child, front=True)
                del self._parked[rid]

    # --- KV held for consumers, health, stats -------------------------------------------------------------

    def release_kv(self, request_id: str) -> None:
        """A consumer has the KV this engine produced for `request_id`: its held blocks are freed at the
        next `poll_kv_leases` (the engine loop's next turn)."""
        if self.kv_connector is not None:
            self.kv_connector.release(request_id)

    def poll_kv_leases(self) -> int:
        """Free the blocks of finished producer requests whose consumer confirmed or whose lease ran out
        (cheap: call it on every turn of the engine loop, busy or idle); returns how many were freed."""
        if self.kv_connector is None or not self.kv_connector.num_held:
            return 0
        freed = self.kv_connector.get_finished(time.monotonic())
        for request in freed:
            self.scheduler.kv_cache_manager.free(request)
        return len(freed)

    def check_health(self) -> str | None:
        """Why the engine cannot serve (a worker of a multi-rank engine is gone), or None."""
        return self.executor.check_health()

    def shutdown(self) -> None:
        """Stop the workers of a multi-rank engine (idempotent; a single-rank engine holds none), and
        delete the KV staged for consumers that will not fetch it now."""
        if self.kv_connector is not None:
            self.kv_connector.discard_held()
        if self.dp is not None:
            self.dp.close()
        self.executor.shutdown()

    def cache_summary(self, max_blocks: int = 65536) -> bytes:
        """The short hashes (engine/core/block_hash.py) of the blocks the prefix cache holds, newest last, as
        packed uint64: what a router needs to know which prompts this engine could serve from cache."""
        cached = self.scheduler.kv_cache_manager.block_pool.cached_block_hash_to_block
        keys = list(cached)[-max_blocks:]
        return np.fromiter((short_hash(h) for h in keys), dtype=np.uint64, count=len(keys)).tobytes()

    @property
    def cache_version(self) -> int:
        return self.scheduler.kv_cache_manager.block_pool.cache_version

    def get_stats(self) -> EngineStats:
        s, kv = self.scheduler, self.scheduler.kv_cache_manager
        expert_load = self.executor.expert_load()  # MoE models count routed tokens
        encoder = self.encoder_cache
        return EngineStats(
            kv_cache_usage=kv.usage,
            num_running=s.num_running,
            num_waiting=s.num_waiting + sum(map(len, self._parked.values())) + sum(map(len, self._compiling.values())),
            num_kv_blocks=kv.block_pool.num_usable_blocks,
            block_size=self.config.block_size,
            kv_bytes_per_token=self.kv_bytes_per_token,
            queued_prefill_tokens=sum(max(0, r.num_prompt_tokens - r.num_computed_tokens)
                                      for queue in (s.running, s.waiting) for r in queue),
            num_kv_held=self.kv_connector.num_held if self.kv_connector is not None else 0,
            step_queue_tcp_readers=self.executor.step_queue_tcp_readers(),
            num_preemptions=s.num_preemptions,
            prefix_cache_queries=kv.prefix_cache_queries,
            prefix_cache_hits=kv.prefix_cache_hits,
            prompt_tokens=s.num_prompt_tokens,
            generation_tokens=s.num_generation_tokens,
            num_requests_finished=s.num_finished,
            num_steps=self._num_steps,
            spec_decode_num_drafts=s.num_spec_drafts,
            spec_decode_num_draft_tokens=s.num_spec_draft_tokens,
            spec_decode_num_accepted_tokens=s.num_spec_accepted_tokens,
            loaded_loras=tuple(self.lora_manager.loaded_names()) if self.lora_manager is not None else (),
            num_lora_slot_loads=self.lora_manager.num_slot_loads if self.lora_manager is not None else 0,
            expert_tokens=tuple(expert_load) if expert_load is not None else (),
            mm_prompt_images=s.num_prompt_images,
            mm_images_encoded=encoder.num_encoded if encoder is not None else 0,
            mm_encoder_cache_hits=encoder.num_hits if encoder is not None else 0,
            mm_encoder_seconds=self.executor.driver_worker.encoder_seconds,
        )


def _logprob_dict(entry: LogprobEntry) -> dict[int, Logprob]:
    ids, values, rank = entry
    result = {ids[0]: Logprob(values[0], rank)}  # the sampled (or actual) token first
    for top_rank, (t, v) in enumerate(zip(ids[1:], values[1:]), start=1):
        result.setdefault(t, Logprob(v, top_rank))
    return result
