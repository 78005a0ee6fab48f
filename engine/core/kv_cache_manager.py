"""Per-request view of the block pools: which blocks a request holds, the longest cached prefix of a new
request, and registering computed blocks in the prefix cache.

Layers that attend alike form a KV cache group (engine/core/kv_cache_groups.py) with a pool and block lists
of their own; a model whose layers all attend over the full context has one. One manager per group: the
primary group's is the one the scheduler holds, and it carries the others (`window_groups`), so that each
call covers every group. A sliding-window group's block lists stay aligned with token positions, but the
blocks that fell wholly out of the window are handed back and the null block takes their place: a long
request holds only the blocks its window still reaches on those layers."""

from __future__ import annotations

from engine.core.block_pool import BlockPool, KVCacheBlock
from engine.core.request import Request


class ComputedBlocks(list):
    """The primary group's cache hit (a list of its blocks), with each window group's hit for the same
    positions (null blocks where the window no longer reaches)."""

    window_hits: list[list[KVCacheBlock]]


class KVCacheManager:
    def __init__(self, block_pool: BlockPool, block_size: int, window: int | None = None,
                 window_groups: list[KVCacheManager] = ()) -> None:
        """`window`: this group's layers attend over the last this-many positions (None: all of them);
        `window_groups`: the managers of the other groups, each with a window."""
        self.block_pool = block_pool
        self.block_size = block_size
        self.window = window
        self.window_groups = list(window_groups)
        self.enable_caching = block_pool.enable_caching
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self.req_to_block_ids: dict[str, list[int]] = {}  # kept alongside: read every step
        self._num_cached_blocks: dict[str, int] = {}  # leading blocks already in the hash map
        self._num_skipped: dict[str, int] = {}  # leading blocks out of the window, handed back
        # Prefix-cache statistics, in tokens, over admitted requests.
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    @property
    def usage(self) -> float:
        return self.block_pool.get_usage()

    def get_computed_blocks(self, request: Request) -> ComputedBlocks:
        """Cached blocks covering the longest prefix of the request that every group holds. The last token is
        always left to compute, since sampling needs its logits."""
        hit = ComputedBlocks()
        hit.window_hits = []
        # Prompt logprobs need every prompt position's logits; mean and CLS pooling every position's state.
        if not self.enable_caching or request.wants_prompt_logprobs or request.skip_reading_prefix_cache:
            return hit
        num_blocks = self._longest_hit(request, (request.num_tokens - 1) // self.block_size)
        groups = (self, *self.window_groups)  # a window's reach moves with the prefix: check each again
        while any((n := group._longest_hit(request, num_blocks)) < num_blocks for group in groups[1:]):
            num_blocks = n  # a window group holds less: every group takes the shorter prefix
            num_blocks = self._longest_hit(request, num_blocks)
        hit.extend(self._hit_blocks(request, num_blocks))
        hit.window_hits = [group._hit_blocks(request, num_blocks) for group in self.window_groups]
        return hit

    def _longest_hit(self, request: Request, max_blocks: int) -> int:
        """The most leading blocks (at most max_blocks) whose KV this group has cached, as far as its layers
        read it: all of them, or with a window only those the window reaches from the end of the prefix."""
        get = self.block_pool.get_cached_block
        hashes = request.block_hashes
        if self.window is None:
            n = 0
            while n < max_blocks and get(hashes[n]) is not None:
                n += 1
            return n
        for n in range(max_blocks, 0, -1):
            if all(get(hashes[i]) is not None for i in range(self._first_needed(n * self.block_size), n)):
                return n
        return 0

    def _hit_blocks(self, request: Request, num_blocks: int) -> list[KVCacheBlock]:
        first = self._first_needed(num_blocks * self.block_size) if self.window is not None else 0
        get = self.block_pool.get_cached_block
        return [self.block_pool.null_block] * first + [get(h) for h in request.block_hashes[first:num_blocks]]

    def _first_needed(self, num_computed: int) -> int:
        """Index of the first block a window layer still reads once `num_computed` tokens are computed: the
        next token's window starts at position num_computed - window + 1."""
        return max(0, num_computed - self.window + 1) // self.block_size

    def allocate_slots(
        self, request: Request, num_new_tokens: int, new_computed_blocks: list[KVCacheBlock] = ()
    ) -> bool:
        """Give the request blocks for `num_new_tokens` more tokens after its computed ones (and after
        `new_computed_blocks`, the cache hit of a newly admitted request), in every group. False, with nothing
        allocated, if a pool is short."""
        blocks = self.req_to_blocks.get(request.request_id)
        if blocks is not None and not new_computed_blocks:
            if request.num_computed_tokens + num_new_tokens <= len(blocks) * self.block_size:
                return True  # most decode steps: the last block still has room (in every group: lists align)
        window_hits = getattr(new_computed_blocks, "window_hits", None) or [[] for _ in self.window_groups]
        groups = [(self, new_computed_blocks), *zip(self.window_groups, window_hits)]
        if not all(group._has_room(request, num_new_tokens, hit) for group, hit in groups):
            return False
        for group, hit in groups:
            group._allocate(request, num_new_tokens, hit)
        return True

    def _has_room(self, request: Request, num_new_tokens: int, new_computed_blocks: list[KVCacheBlock]) -> bool:
        if self.window is not None:
            self._skip_out_of_window(request, request.num_computed_tokens)
        num_new_blocks = self._num_new_blocks(request, num_new_tokens, new_computed_blocks)
        # Cache hits sitting in the free queue stop being free once touched.
        num_free_hits = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        return num_new_blocks <= self.block_pool.get_num_free_blocks() - num_free_hits

    def _allocate(self, request: Request, num_new_tokens: int, new_computed_blocks: list[KVCacheBlock]) -> None:
        rid = request.request_id
        num_new_blocks = self._num_new_blocks(request, num_new_tokens, new_computed_blocks)
        blocks = self.req_to_blocks.setdefault(rid, [])
        block_ids = self.req_to_block_ids.setdefault(rid, [])
        if new_computed_blocks:
            null = self.block_pool.null_block
            self.block_pool.touch(b for b in new_computed_blocks if b is not null)
            blocks.extend(new_computed_blocks)
            block_ids.extend(b.block_id for b in new_computed_blocks)
            self._num_cached_blocks[rid] = len(blocks)
            self._num_skipped[rid] = sum(1 for b in new_computed_blocks if b is null)
        if num_new_blocks > 0:
            new_blocks = self.block_pool.allocate(num_new_blocks)
            blocks.extend(new_blocks)
            block_ids.extend(b.block_id for b in new_blocks)

    def _num_new_blocks(self, request: Request, num_new_tokens: int, new_computed_blocks: list[KVCacheBlock]) -> int:
        """Blocks to allocate so that this group covers the request's computed tokens, `new_computed_blocks` (a
        hit) and `num_new_tokens` more."""
        num_computed = request.num_computed_tokens + len(new_computed_blocks) * self.block_size
        num_held = len(self.req_to_blocks.get(request.request_id, ()))
        return -(-(num_computed + num_new_tokens) // self.block_size) - num_held - len(new_computed_blocks)

    def _skip_out_of_window(self, request: Request, num_computed: int) -> None:
        """Hand back the blocks no query of this window group reads any more (cached ones stay findable
        until evicted, like any freed block)."""
        rid = request.request_id
        blocks = self.req_to_blocks.get(rid)
        skipped = self._num_skipped.get(rid, 0)
        first = min(self._first_needed(num_computed), len(blocks or ()))
        if blocks is None or first <= skipped:
            return
        null = self.block_pool.null_block
        gone = blocks[skipped:first]
        blocks[skipped:first] = [null] * (first - skipped)
        # A new list, not an edit in place: the block table sees it and rewrites the row.
        self.req_to_block_ids[rid] = [b.block_id for b in blocks]
        self._num_skipped[rid] = first
        self.block_pool.free(b for b in reversed(gone) if b is not null)

    def record_prefix_hit(self, request: Request, num_hit_tokens: int) -> None:
        self.prefix_cache_queries += request.num_tokens
        self.prefix_cache_hits += num_hit_tokens

    def cache_computed_blocks(self, request: Request) -> None:
        """Register the request's full blocks whose KV is now computed, in every group. Done after the forward,
        never at allocation: a block hashed before its KV exists could be hit by another request and read as
        garbage if its owner were preempted in the same step."""
        if not self.enable_caching:
            return
        for group in self.window_groups:
            group.cache_computed_blocks(request)
        rid = request.request_id
        start = self._num_cached_blocks.get(rid, 0)
        end = min(request.num_computed_tokens // self.block_size, len(request.block_hashes))
        if end <= start:
            return
        blocks, null = self.req_to_blocks[rid], self.block_pool.null_block
        for i in range(start, end):
            if blocks[i] is not null:
                self.block_pool.cache_full_block(blocks[i], request.block_hashes[i])
        self._num_cached_blocks[rid] = end

    def free_tail(self, request: Request) -> None:
        """Release the blocks past those holding the request's tokens: slots reserved for draft tokens
        that were rejected (or never proposed). Never cached: no computed token lives in them."""
        for group in self.window_groups:
            group.free_tail(request)
        blocks = self.req_to_blocks.get(request.request_id)
        keep = -(-request.num_tokens // self.block_size)
        if blocks is None or len(blocks) <= keep:
            return
        tail = blocks[keep:]
        del blocks[keep:]
        self.req_to_block_ids[request.request_id] = [b.block_id for b in blocks]
        self.block_pool.free(reversed(tail))

    def free(self, request: Request) -> None:
        """Release the request's blocks in every group, tail first, so the free queue evicts a chain's tail
        (its least shareable blocks) before its head."""
        for group in self.window_groups:
            group.free(request)
        rid = request.request_id
        blocks = self.req_to_blocks.pop(rid, [])
        self.req_to_block_ids.pop(rid, None)
        self._num_cached_blocks.pop(rid, None)
        self._num_skipped.pop(rid, None)
        null = self.block_pool.null_block
        self.block_pool.free(b for b in reversed(blocks) if b is not null)

    def get_block_ids(self, request: Request) -> list[int]:
        """The primary group's blocks (the only group of a model without sliding-window layers)."""
        return self.req_to_block_ids[request.request_id]

    def get_window_block_ids(self, request: Request) -> list[list[int]]:
        """Each window group's blocks, null blocks where the window no longer reaches."""
        return [group.req_to_block_ids[request.request_id] for group in self.window_groups]

    def num_held_blocks(self, request: Request) -> list[int]:
        """Blocks the request holds in each group, the primary first (null blocks not counted)."""
        groups = [self, *self.window_groups]
        return [sum(b is not g.block_pool.null_block for b in g.req_to_blocks.get(request.request_id, ()))
                for g in groups]
