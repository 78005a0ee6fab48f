"""Block pool, free queue, block hashes and the KV-cache manager, through their public interfaces."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from engine.core import block_hash
from engine.core.block_hash import NONE_HASH, hash_block_chain, hash_block_tokens
from engine.core.block_pool import BlockPool, FreeKVCacheBlockQueue, KVCacheBlock
from engine.core.kv_cache_manager import KVCacheManager
from engine.core.request import Request
from engine.sampling_params import SamplingParams

BS = 4  # block size of the manager tests


def _ids(blocks) -> list[int]:
    return [b.block_id for b in blocks]


def _request(rid: str, tokens: list[int], block_size: int = BS, cache_salt: str | None = None) -> Request:
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    return Request(rid, tokens, params, max_tokens=8, block_size=block_size, cache_salt=cache_salt)


def _compute(kv: KVCacheManager, request: Request, num_tokens: int) -> None:
    """What a step does for `request`: allocate, 'run the forward', register the computed blocks."""
    assert kv.allocate_slots(request, num_tokens)
    request.num_computed_tokens += num_tokens
    kv.cache_computed_blocks(request)


# --- FreeKVCacheBlockQueue ---------------------------------------------------------------------------


def test_free_queue_pops_in_lru_order_and_appends_at_the_tail() -> None:
    blocks = [KVCacheBlock(i) for i in range(5)]
    queue = FreeKVCacheBlockQueue(blocks)
    assert queue.num_free_blocks == 5
    first = queue.popleft()
    assert first.block_id == 0 and first.prev_free is None and first.next_free is None
    queue.append(first)
    assert _ids(queue) == [1, 2, 3, 4, 0]
    assert _ids(queue.popleft() for _ in range(5)) == [1, 2, 3, 4, 0]
    assert queue.num_free_blocks == 0


def test_free_queue_removes_from_the_middle() -> None:
    blocks = [KVCacheBlock(i) for i in range(5)]
    queue = FreeKVCacheBlockQueue(blocks)
    queue.remove(blocks[2])
    queue.remove(blocks[4])  # the last one
    queue.remove(blocks[0])  # the first one
    assert _ids(queue) == [1, 3]
    assert queue.num_free_blocks == 2
    assert blocks[2].prev_free is None and blocks[2].next_free is None
    queue.append(blocks[2])
    assert _ids(queue) == [1, 3, 2]
    assert _ids(queue.popleft() for _ in range(3)) == [1, 3, 2]


def _time_middle_removals(queue_len: int, num_removals: int = 1000) -> float:
    blocks = [KVCacheBlock(i) for i in range(queue_len)]
    queue = FreeKVCacheBlockQueue(blocks)
    middle = blocks[queue_len // 2 - num_removals // 2 : queue_len // 2 + num_removals // 2]
    start = time.perf_counter()
    for block in middle:
        queue.remove(block)
    return time.perf_counter() - start


def test_free_queue_removal_does_not_scale_with_queue_length() -> None:
    # O(1) removal: 1000 removals from the middle of a 100x longer queue cost about the same. A list
    # or a scan would be ~100x slower; the factor 20 leaves room for timing noise.
    small = min(_time_middle_removals(2_000) for _ in range(3))
    large = min(_time_middle_removals(200_000) for _ in range(3))
    assert large < 20 * small + 1e-3


def test_free_queue_popleft_on_empty_raises() -> None:
    queue = FreeKVCacheBlockQueue([])
    with pytest.raises(IndexError):
        queue.popleft()
    queue = FreeKVCacheBlockQueue([KVCacheBlock(1)])
    queue.popleft()
    with pytest.raises(IndexError):
        queue.popleft()
    assert queue.num_free_blocks == 0


# --- BlockPool ----------------------------------------------------------------------------------------


def test_block_zero_is_the_null_block_and_never_allocated() -> None:
    pool = BlockPool(6)
    assert pool.null_block is pool.blocks[0] and pool.null_block.block_id == 0
    assert pool.null_block.ref_cnt == 1
    assert pool.num_usable_blocks == 5 and pool.get_num_free_blocks() == 5
    blocks = pool.allocate(5)
    assert sorted(_ids(blocks)) == [1, 2, 3, 4, 5]
    with pytest.raises(ValueError):
        pool.allocate(1)
    pool.free(blocks)
    assert 0 not in _ids(pool.allocate(5))


def test_pool_needs_a_usable_block() -> None:
    with pytest.raises(ValueError):
        BlockPool(1)


def test_allocate_touch_free_track_ref_counts() -> None:
    pool = BlockPool(4)
    (block,) = pool.allocate(1)
    assert block.ref_cnt == 1 and pool.get_num_free_blocks() == 2
    pool.touch([block])  # a second request shares it
    assert block.ref_cnt == 2
    pool.free([block])
    assert block.ref_cnt == 1 and block not in list(pool.free_block_queue)
    pool.free([block])
    assert block.ref_cnt == 0 and list(pool.free_block_queue)[-1] is block
    assert pool.get_num_free_blocks() == 3


def test_allocating_more_than_free_raises_and_takes_nothing() -> None:
    pool = BlockPool(4)
    with pytest.raises(ValueError):
        pool.allocate(4)
    assert pool.get_num_free_blocks() == 3
    assert all(b.ref_cnt == 0 for b in pool.blocks[1:])


def test_touch_pulls_a_free_cached_block_out_of_the_free_queue() -> None:
    pool = BlockPool(5)
    (block,) = pool.allocate(1)
    pool.cache_full_block(block, 1234)
    pool.free([block])
    assert block in list(pool.free_block_queue) and pool.get_num_free_blocks() == 4
    hit = pool.get_cached_block(1234)
    assert hit is block
    pool.touch([hit])
    assert block.ref_cnt == 1
    assert block not in list(pool.free_block_queue) and pool.get_num_free_blocks() == 3
    # Allocating every free block can no longer evict it.
    pool.allocate(3)
    assert pool.get_cached_block(1234) is block and block.block_hash == 1234


def test_freed_block_keeps_its_hash_until_reallocated() -> None:
    pool = BlockPool(4)  # usable: 1, 2, 3
    a, b = pool.allocate(2)
    pool.cache_full_block(a, 111)
    pool.cache_full_block(b, 222)
    pool.free([b, a])  # queue: 3, b, a
    assert pool.get_cached_block(111) is a and pool.get_cached_block(222) is b
    (first,) = pool.allocate(1)  # the never-cached block 3: nothing evicted
    assert first is not a and first is not b
    assert pool.get_cached_block(111) is a and pool.get_cached_block(222) is b
    (second,) = pool.allocate(1)  # b, freed first, is evicted first
    assert second is b and b.block_hash is None
    assert pool.get_cached_block(222) is None and 222 not in pool.cached_block_hash_to_block
    assert pool.get_cached_block(111) is a and a.block_hash == 111


def test_free_order_is_eviction_order() -> None:
    pool = BlockPool(6)
    blocks = pool.allocate(5)
    order = [blocks[3], blocks[0], blocks[4], blocks[1], blocks[2]]
    pool.free(order)
    assert _ids(pool.free_block_queue) == _ids(order)
    assert _ids(pool.allocate(5)) == _ids(order)


def test_usage_counts_referenced_blocks_only() -> None:
    pool = BlockPool(5)
    assert pool.get_usage() == 0.0
    blocks = pool.allocate(3)
    assert pool.get_usage() == pytest.approx(3 / 4)
    pool.cache_full_block(blocks[0], 7)
    pool.free(blocks[:1])  # cached but free: counts as free
    assert pool.get_usage() == pytest.approx(2 / 4)
    pool.free(blocks[1:])
    assert pool.get_usage() == 0.0


def test_reset_prefix_cache_refuses_while_blocks_are_in_use() -> None:
    pool = BlockPool(4)
    a, b = pool.allocate(2)
    pool.cache_full_block(a, 1)
    pool.cache_full_block(b, 2)
    pool.free([a])
    assert pool.reset_prefix_cache() is False
    assert pool.get_cached_block(1) is a and b.block_hash == 2  # untouched
    pool.free([b])
    assert pool.reset_prefix_cache() is True
    assert pool.cached_block_hash_to_block == {}
    assert all(block.block_hash is None for block in pool.blocks)


def test_caching_disabled_caches_nothing() -> None:
    pool = BlockPool(3, enable_caching=False)
    (block,) = pool.allocate(1)
    pool.cache_full_block(block, 5)
    assert block.block_hash is None and pool.get_cached_block(5) is None


def test_duplicate_block_hash_keeps_the_first_writer() -> None:
    pool = BlockPool(4)
    a, b = pool.allocate(2)
    pool.cache_full_block(a, 9)
    pool.cache_full_block(b, 9)
    assert pool.get_cached_block(9) is a
    pool.free([b])
    pool.allocate(2)  # evicts b (and the last plain block); a's entry must survive
    assert pool.get_cached_block(9) is a and a.block_hash == 9


# --- block hashes -------------------------------------------------------------------------------------


def test_hash_chain_covers_full_blocks_only() -> None:
    assert len(hash_block_chain(list(range(11)), 4)) == 2
    assert len(hash_block_chain(list(range(12)), 4)) == 3
    assert hash_block_chain([1, 2, 3], 4) == []


def test_hash_chain_is_equal_for_equal_prefixes() -> None:
    a = hash_block_chain([1, 2, 3, 4, 5, 6, 7, 8, 9, 10], 4)
    b = hash_block_chain([1, 2, 3, 4, 5, 6, 7, 8, 99, 100, 101, 102], 4)
    assert a[:2] == b[:2]
    assert a[0] != a[1]
    assert a[0] == hash_block_tokens(NONE_HASH, [1, 2, 3, 4])
    assert a[1] == hash_block_tokens(a[0], [5, 6, 7, 8])


def test_hash_chain_differs_after_a_different_earlier_block() -> None:
    a = hash_block_chain([1, 2, 3, 4, 5, 6, 7, 8], 4)
    b = hash_block_chain([0, 2, 3, 4, 5, 6, 7, 8], 4)  # same second block, different first
    assert a[0] != b[0] and a[1] != b[1]


def test_hash_chain_continues_from_parent_hashes() -> None:
    tokens = list(range(100, 117))
    full = hash_block_chain(tokens, 4)
    assert hash_block_chain(tokens, 4, parent_hashes=full[:2]) == full
    salted = hash_block_chain(tokens, 4, cache_salt="s")
    assert hash_block_chain(tokens, 4, cache_salt="s", parent_hashes=salted[:1]) == salted


def test_cache_salt_changes_the_whole_chain() -> None:
    tokens = list(range(12))
    plain = hash_block_chain(tokens, 4)
    a = hash_block_chain(tokens, 4, cache_salt="alice")
    b = hash_block_chain(tokens, 4, cache_salt="bob")
    assert all(x != y for x, y in zip(plain, a))
    assert all(x != y for x, y in zip(a, b))
    assert a == hash_block_chain(tokens, 4, cache_salt="alice")


def test_block_hashes_are_stable_across_processes() -> None:
    tokens = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8]
    # Load the module by path: importing the `engine` package would pull in torch (slow).
    code = (
        "import importlib.util as u;"
        f"spec = u.spec_from_file_location('block_hash', {block_hash.__file__!r});"
        "m = u.module_from_spec(spec); spec.loader.exec_module(m);"
        f"print(m.hash_block_chain({tokens}, 4), m.hash_block_chain({tokens}, 4, cache_salt='x'))"
    )
    outputs = set()
    for seed in ("0", "12345"):  # a different str/tuple hash() in each process
        env = {**os.environ, "PYTHONHASHSEED": seed}
        result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
        outputs.add(result.stdout.strip())
    here = f"{hash_block_chain(tokens, 4)} {hash_block_chain(tokens, 4, cache_salt='x')}"
    assert outputs == {here}


def test_request_hashes_its_full_blocks_as_tokens_arrive() -> None:
    request = _request("r", [1, 2, 3, 4, 5, 6])
    assert request.block_hashes == hash_block_chain([1, 2, 3, 4, 5, 6], BS)
    request.append_output_token(7)
    assert len(request.block_hashes) == 1
    request.append_output_token(8)
    assert request.block_hashes == hash_block_chain([1, 2, 3, 4, 5, 6, 7, 8], BS)


# --- KVCacheManager -----------------------------------------------------------------------------------


def test_computed_blocks_leave_the_last_token_to_compute() -> None:
    kv = KVCacheManager(BlockPool(10), BS)
    owner = _request("owner", list(range(12)))  # 3 full blocks
    _compute(kv, owner, 12)
    assert len(kv.block_pool.cached_block_hash_to_block) == 3
    owner_blocks = kv.req_to_blocks["owner"]
    # 8 tokens: 2 full cached blocks, but the 8th token must be recomputed -> 1 block.
    assert kv.get_computed_blocks(_request("a", list(range(8)))) == owner_blocks[:1]
    # 9 tokens: both full blocks are hits, the 9th token is computed.
    assert kv.get_computed_blocks(_request("b", list(range(9)))) == owner_blocks[:2]
    # 12 tokens, all cached: still one block short of the end.
    assert kv.get_computed_blocks(_request("c", list(range(12)))) == owner_blocks[:2]
    assert kv.get_computed_blocks(_request("d", list(range(3)))) == []


def test_computed_blocks_stop_at_the_first_miss() -> None:
    kv = KVCacheManager(BlockPool(10), BS)
    owner = _request("owner", list(range(12)))
    _compute(kv, owner, 12)
    diverging = _request("x", [0, 1, 2, 3, 9, 9, 9, 9, 8, 9, 10, 11, 12])  # block 1 differs
    assert _ids(kv.get_computed_blocks(diverging)) == kv.get_block_ids(owner)[:1]
    salted = _request("s", list(range(13)), cache_salt="other")
    assert kv.get_computed_blocks(salted) == []


def test_no_hits_with_caching_disabled() -> None:
    kv = KVCacheManager(BlockPool(10, enable_caching=False), BS)
    _compute(kv, _request("owner", list(range(12))), 12)
    assert kv.get_computed_blocks(_request("x", list(range(12)))) == []


def test_allocate_slots_takes_cache_hits_and_new_blocks() -> None:
    kv = KVCacheManager(BlockPool(10), BS)
    owner = _request("owner", list(range(9)))
    _compute(kv, owner, 9)
    kv.free(owner)  # the two cached blocks are now free, still hit-able
    reader = _request("reader", list(range(13)))
    hits = kv.get_computed_blocks(reader)
    assert len(hits) == 2 and all(b.ref_cnt == 0 for b in hits)
    assert kv.allocate_slots(reader, 13 - 8, hits)
    assert all(b.ref_cnt == 1 for b in hits)
    assert kv.get_block_ids(reader)[:2] == _ids(hits) and len(kv.get_block_ids(reader)) == 4
    assert kv.block_pool.get_num_free_blocks() == 9 - 4


def _pool_state(pool: BlockPool) -> tuple:
    return (
        [(b.ref_cnt, b.block_hash) for b in pool.blocks],
        _ids(pool.free_block_queue),
        dict(pool.cached_block_hash_to_block),
    )


def test_allocate_slots_fails_without_side_effects_when_the_pool_is_short() -> None:
    kv = KVCacheManager(BlockPool(5), BS)  # 4 usable blocks
    owner = _request("owner", list(range(9)))
    _compute(kv, owner, 9)  # 3 blocks, 2 cached
    kv.free(owner)
    reader = _request("reader", list(range(17)))  # 2 hits (free) + 3 new blocks = 5 > 4
    hits = kv.get_computed_blocks(reader)
    assert len(hits) == 2
    before = _pool_state(kv.block_pool)
    assert kv.allocate_slots(reader, 17 - 8, hits) is False
    assert _pool_state(kv.block_pool) == before
    assert kv.req_to_blocks.get("reader", []) == [] and kv.req_to_block_ids.get("reader", []) == []
    # Exactly enough: the free hits count against the free blocks only once.
    fits = _request("fits", list(range(16)))  # 2 hits + 2 new = 4
    assert kv.allocate_slots(fits, 16 - 8, kv.get_computed_blocks(fits))
    assert kv.block_pool.get_num_free_blocks() == 0


def test_allocate_slots_for_a_running_request_fails_cleanly() -> None:
    kv = KVCacheManager(BlockPool(4), BS)  # 3 usable blocks
    running = _request("r", list(range(8)))
    _compute(kv, running, 8)
    hog = _request("hog", list(range(100, 104)))
    assert kv.allocate_slots(hog, 4)
    before = _pool_state(kv.block_pool)
    assert kv.allocate_slots(running, 1) is False  # needs a third block, none free
    assert _pool_state(kv.block_pool) == before
    assert len(kv.get_block_ids(running)) == 2


def test_cache_computed_blocks_registers_only_fully_computed_blocks() -> None:
    kv = KVCacheManager(BlockPool(10), BS)
    request = _request("r", list(range(10)))
    assert kv.allocate_slots(request, 10)
    blocks = kv.req_to_blocks["r"]
    pool = kv.block_pool
    request.num_computed_tokens = 7  # a chunk that stops inside block 1
    kv.cache_computed_blocks(request)
    assert pool.cached_block_hash_to_block == {request.block_hashes[0]: blocks[0]}
    assert blocks[1].block_hash is None
    request.num_computed_tokens = 10  # block 2 holds only 2 tokens: never cached while partial
    kv.cache_computed_blocks(request)
    assert pool.cached_block_hash_to_block == {request.block_hashes[i]: blocks[i] for i in range(2)}
    assert blocks[2].block_hash is None
    # Decoding fills block 2; once its KV is computed it is registered too.
    request.append_output_token(10)
    request.append_output_token(11)
    request.num_computed_tokens = 11
    kv.cache_computed_blocks(request)
    assert blocks[2].block_hash is None
    assert kv.allocate_slots(request, 1)
    request.num_computed_tokens = 12
    kv.cache_computed_blocks(request)
    assert pool.get_cached_block(request.block_hashes[2]) is blocks[2]


def test_free_returns_all_blocks_tail_first() -> None:
    kv = KVCacheManager(BlockPool(8), BS)
    request = _request("r", list(range(14)))
    _compute(kv, request, 14)
    held = kv.get_block_ids(request)
    assert len(held) == 4 and kv.block_pool.get_num_free_blocks() == 3
    kv.free(request)
    pool = kv.block_pool
    assert pool.get_num_free_blocks() == pool.num_usable_blocks
    assert all(b.ref_cnt == 0 for b in pool.blocks[1:])
    assert _ids(pool.free_block_queue)[-4:] == held[::-1]  # the chain's tail is evicted first
    assert "r" not in kv.req_to_blocks and "r" not in kv.req_to_block_ids


def test_free_of_shared_blocks_only_drops_references() -> None:
    kv = KVCacheManager(BlockPool(8), BS)
    first = _request("a", list(range(9)))
    _compute(kv, first, 9)
    second = _request("b", list(range(9)))
    hits = kv.get_computed_blocks(second)
    assert kv.allocate_slots(second, 1, hits)
    assert [b.ref_cnt for b in hits] == [2, 2]
    kv.free(first)
    assert [b.ref_cnt for b in hits] == [1, 1]
    assert not any(b in list(kv.block_pool.free_block_queue) for b in hits)
    kv.free(second)
    assert kv.block_pool.get_num_free_blocks() == kv.block_pool.num_usable_blocks
