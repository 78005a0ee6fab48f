"""Per-request view of the block pool: which blocks a request holds, the longest cached prefix of a new
request, and registering computed blocks in the prefix cache."""

from __future__ import annotations

from engine.core.block_pool import BlockPool, KVCacheBlock
from engine.core.request import Request


class KVCacheManager:
    def __init__(self, block_pool: BlockPool, block_size: int) -> None:
        self.block_pool = block_pool
        self.block_size = block_size
        self.enable_caching = block_pool.enable_caching
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self.req_to_block_ids: dict[str, list[int]] = {}  # kept alongside: read every step
        self._num_cached_blocks: dict[str, int] = {}  # leading blocks already in the hash map
        # Prefix-cache statistics, in tokens, over admitted requests.
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    @property
    def usage(self) -> float:
        return self.block_pool.get_usage()

    def get_computed_blocks(self, request: Request) -> list[KVCacheBlock]:
        """Cached blocks covering the longest prefix of the request. The last token is always left
        to compute, since sampling needs its logits."""
        if not self.enable_caching or request.wants_prompt_logprobs:  # those need every prompt position's logits
            return []
        max_blocks = (request.num_tokens - 1) // self.block_size
        blocks = []
        for block_hash in request.block_hashes[:max_blocks]:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def allocate_slots(
        self, request: Request, num_new_tokens: int, new_computed_blocks: list[KVCacheBlock] = ()
    ) -> bool:
        """Give the request blocks for `num_new_tokens` more tokens after its computed ones (and after
        `new_computed_blocks`, the cache hit of a newly admitted request). False if the pool is short."""
        blocks = self.req_to_blocks.get(request.request_id)
        if blocks is not None and not new_computed_blocks:
            if request.num_computed_tokens + num_new_tokens <= len(blocks) * self.block_size:
                return True  # most decode steps: the last block still has room
        blocks = self.req_to_blocks.setdefault(request.request_id, [])
        block_ids = self.req_to_block_ids.setdefault(request.request_id, [])
        num_computed = request.num_computed_tokens + len(new_computed_blocks) * self.block_size
        num_needed = -(-(num_computed + num_new_tokens) // self.block_size)
        num_new_blocks = num_needed - len(blocks) - len(new_computed_blocks)
        # Cache hits sitting in the free queue stop being free once touched.
        num_free_hits = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        if num_new_blocks > self.block_pool.get_num_free_blocks() - num_free_hits:
            return False
        if new_computed_blocks:
            self.block_pool.touch(new_computed_blocks)
            blocks.extend(new_computed_blocks)
            block_ids.extend(b.block_id for b in new_computed_blocks)
            self._num_cached_blocks[request.request_id] = len(blocks)
        if num_new_blocks > 0:
            new_blocks = self.block_pool.allocate(num_new_blocks)
            blocks.extend(new_blocks)
            block_ids.extend(b.block_id for b in new_blocks)
        return True

    def record_prefix_hit(self, request: Request, num_hit_tokens: int) -> None:
        self.prefix_cache_queries += request.num_tokens
        self.prefix_cache_hits += num_hit_tokens

    def cache_computed_blocks(self, request: Request) -> None:
        """Register the request's full blocks whose KV is now computed. Done after the forward, never
        at allocation: a block hashed before its KV exists could be hit by another request and read as
        garbage if its owner were preempted in the same step."""
        if not self.enable_caching:
            return
        start = self._num_cached_blocks.get(request.request_id, 0)
        end = min(request.num_computed_tokens // self.block_size, len(request.block_hashes))
        if end <= start:
            return
        blocks = self.req_to_blocks[request.request_id]
        for i in range(start, end):
            self.block_pool.cache_full_block(blocks[i], request.block_hashes[i])
        if end > start:
            self._num_cached_blocks[request.request_id] = end

    def free_tail(self, request: Request) -> None:
        """Release the blocks past those holding the request's tokens: slots reserved for draft tokens
        that were rejected (or never proposed). Never cached: no computed token lives in them."""
        blocks = self.req_to_blocks.get(request.request_id)
        keep = -(-request.num_tokens // self.block_size)
        if blocks is None or len(blocks) <= keep:
            return
        tail = blocks[keep:]
        del blocks[keep:]
        # A new list, not an edit in place: the block table sees it and rewrites the row.
        self.req_to_block_ids[request.request_id] = [b.block_id for b in blocks]
        self.block_pool.free(reversed(tail))

    def free(self, request: Request) -> None:
        """Release the request's blocks, tail first, so the free queue evicts a chain's tail (its least
        shareable blocks) before its head."""
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self.req_to_block_ids.pop(request.request_id, None)
        self._num_cached_blocks.pop(request.request_id, None)
        self.block_pool.free(reversed(blocks))

    def get_block_ids(self, request: Request) -> list[int]:
        return self.req_to_block_ids[request.request_id]
