"""Per-sample grammar matchers and the per-step token bitmask.

A constrained request's grammar compiles on a worker thread, never on the step loop; the engine holds
the request back until it is ready. Then each step, for the rows that sample a constrained request,
its matcher fills one row of a bitmask and xgrammar's CPU kernel masks the disallowed logits of those
rows only (unconstrained rows are untouched, so their samples do not change). After the step each
matcher consumes its request's new tokens; a terminated grammar (its stop token accepted) ends the
request. With n > 1 the samples share one compiled grammar, each with its own matcher. Preemption by
recompute never re-samples a token, so a matcher's state stays valid across it."""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import xgrammar as xgr
from transformers import PreTrainedTokenizerBase

from engine.sampling_params import StructuredOutputsParams
from engine.structured_output.grammar import GrammarCompiler

if TYPE_CHECKING:
    from engine.core.request import Request

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class GrammarState:
    """One sample's grammar: a compile in flight (or done), then its matcher."""

    future: Future[xgr.CompiledGrammar]
    is_json: bool  # gets the compiler's json_token_mask on top of the grammar's
    matcher: xgr.GrammarMatcher | None = None
    num_accepted: int = 0  # output tokens the matcher has consumed

    @property
    def ready(self) -> bool:
        return self.future.done()

    def error(self) -> str | None:
        """Why the compile failed, once done; None when it succeeded."""
        e = self.future.exception() if not self.future.cancelled() else None
        return None if e is None else str(e)


class StructuredOutputManager:
    def __init__(
        self, tokenizer: PreTrainedTokenizerBase, vocab_size: int, stop_token_ids: frozenset[int], max_rows: int
    ) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._stop_token_ids = stop_token_ids
        self._max_rows = max_rows
        self._compiler: GrammarCompiler | None = None  # built on first use: ~60 ms for a 32k vocab
        self._compiler_lock = threading.Lock()
        # One worker: compiles run in arrival order, beside (not inside) the step loop.
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pagedserve-grammar")
        self._bitmask: torch.Tensor | None = None
        self.num_active = 0  # samples holding a grammar state: the per-step fast path when 0

    def compiler(self) -> GrammarCompiler:
        with self._compiler_lock:
            if self._compiler is None:
                self._compiler = GrammarCompiler(self._tokenizer, self._vocab_size, self._stop_token_ids)
            return self._compiler

    def add(self, samples: list[Request]) -> None:
        """Start compiling the grammar of a request's samples (at once from the cache when it holds it)."""
        params: StructuredOutputsParams = samples[0].sampling_params.structured_outputs
        grammar = self._compiler.cached(params) if self._compiler is not None else None
        if grammar is not None:
            future: Future = Future()
            future.set_result(grammar)
        else:
            future = self._executor.submit(lambda: self.compiler().compile(params))
        is_json = params.kind in ("json", "json_object")
        for sample in samples:
            sample.grammar = GrammarState(future, is_json)
        self.num_active += len(samples)

    def release(self, request: Request) -> None:
        """Drop a finished or aborted sample's matcher (and its compile, if nothing else waits on it)."""
        if request.grammar is not None:
            request.grammar.future.cancel()  # a no-op once running or done
            request.grammar = None
            self.num_active -= 1

    def apply_bitmask(self, logits: torch.Tensor, requests: list[Request]) -> None:
        """Mask, in place, the logits that the grammar forbids in the rows of constrained requests;
        `requests[i]` samples from `logits[i]`."""
        if not self.num_active:
            return
        # A grammar constrains the answer after a reasoning model's thinking, never the thinking itself; while the
        # output may still open its thinking, the start tag is allowed beside the grammar's first tokens.
        rows = [i for i, r in enumerate(requests)
                if r.grammar is not None and (r.thinking is None or r.thinking.in_answer
                                              or r.thinking.opening_token is not None)]
        if not rows:
            return
        if self._bitmask is None or self._bitmask.shape[0] < len(requests):
            self._bitmask = xgr.allocate_token_bitmask(max(self._max_rows, len(requests)), self._vocab_size)
        for i in rows:
            state = requests[i].grammar
            if state.matcher is None:
                state.matcher = xgr.GrammarMatcher(state.future.result())
            state.matcher.fill_next_token_bitmask(self._bitmask, i)
            if state.is_json:  # a row view's in-place AND: advanced indexing here costs milliseconds
                self._bitmask[i] &= self._compiler.json_token_mask
            opening = requests[i].thinking.opening_token if requests[i].thinking is not None else None
            if opening is not None:
                _allow(self._bitmask[i], opening)
        bitmask = self._bitmask[: len(requests)]
        if logits.device.type != "cpu":
            bitmask = bitmask.to(logits.device, non_blocking=True)
        xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=self._vocab_size, indices=rows)

    def advance(self, updated: list[Request]) -> tuple[list[Request], list[Request]]:
        """Feed each constrained sample's new tokens to its matcher. Returns the samples still running
        whose grammar has terminated (they end with "stop"), and those a token of which the grammar
        rejected (only possible if something after the mask changed the choice)."""
        terminated, rejected = [], []
        if not self.num_active:
            return terminated, rejected
        for request in updated:
            state = request.grammar
            if state is None or state.matcher is None or (request.thinking and not request.thinking.in_answer):
                continue
            if request.thinking is not None:  # the thinking before the answer is not the grammar's
                state.num_accepted = max(state.num_accepted, request.thinking.answer_start)
            new = request.output_token_ids[state.num_accepted :]
            state.num_accepted = request.num_output_tokens
            if not all(state.matcher.accept_token(t) for t in new):
                logger.warning("request %s: a sampled token broke its grammar", request.request_id)
                rejected.append(request)
            elif state.matcher.is_terminated() and not request.is_finished:
                terminated.append(request)
        return terminated, rejected


def _allow(row: torch.Tensor, token_id: int) -> None:
    """Set `token_id`'s bit in a bitmask row (bit i of int32 word w is token 32w + i)."""
    word = int(row[token_id >> 5]) | (1 << (token_id & 31))
    row[token_id >> 5] = word - (1 << 32) if word >= 1 << 31 else word
