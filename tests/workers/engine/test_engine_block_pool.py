"""BlockPool and its free queue: LRU order, tail-first eviction, BlockRemoved on eviction (vLLM semantics)."""

from __future__ import annotations

from switchyard.workers.engine.block_pool import BlockPool
from switchyard.workers.engine.kv_events import AllBlocksCleared, BlockRemoved, BlockStored


def _ids(blocks) -> list[int]:
    return [b.block_id for b in blocks]


def _cache(pool: BlockPool, blocks, tag: int) -> None:
    n = len(blocks)
    digests = [bytes([tag, i]) * 8 for i in range(n)]
    hashes = [tag * 100 + i for i in range(n)]
    pool.cache_full_blocks(blocks, digests, hashes, list(range(n * pool.block_size)), 0, n, None)


def test_null_block_and_initial_free_order() -> None:
    pool = BlockPool(num_blocks=6, enable_caching=True, block_size=4)
    # block 0 is the null block: 6 - 1 = 5 usable, handed out in id order
    assert pool.null_block.block_id == 0
    assert pool.get_num_free_blocks() == 5
    assert _ids(pool.free_block_queue.get_all_free_blocks()) == [1, 2, 3, 4, 5]
    assert _ids(pool.get_new_blocks(2)) == [1, 2]
    assert pool.get_num_used_blocks() == 2


def test_free_appends_in_given_order_and_middle_removal() -> None:
    pool = BlockPool(num_blocks=6, enable_caching=True, block_size=4)
    a = pool.get_new_blocks(3)  # [1, 2, 3]; free = [4, 5]
    pool.free_blocks(reversed(a))  # a request frees tail first: free = [4, 5, 3, 2, 1]
    assert _ids(pool.free_block_queue.get_all_free_blocks()) == [4, 5, 3, 2, 1]
    pool.touch([pool.blocks[2]])  # a prefix hit pulls block 2 out of the middle in O(1)
    assert _ids(pool.free_block_queue.get_all_free_blocks()) == [4, 5, 3, 1]
    assert pool.blocks[2].ref_cnt == 1


def test_lru_eviction_tail_first_then_least_recently_freed() -> None:
    pool = BlockPool(num_blocks=7, enable_caching=True, block_size=4)
    a = pool.get_new_blocks(3)  # request A: blocks [1, 2, 3]
    b = pool.get_new_blocks(3)  # request B: blocks [4, 5, 6]; pool now empty
    _cache(pool, a, tag=1)  # hashes 100, 101, 102
    _cache(pool, b, tag=2)  # hashes 200, 201, 202
    pool.take_events()
    pool.free_blocks(reversed(a))  # A finishes first: free = [3, 2, 1]
    pool.free_blocks(reversed(b))  # then B:            free = [3, 2, 1, 6, 5, 4]
    got = pool.get_new_blocks(4)
    # A's tail (3) goes first, then A's head; B (freed later) only after A is gone
    assert _ids(got) == [3, 2, 1, 6]
    # one BlockRemoved for the whole allocation, hashes in eviction order (vLLM would emit one per block)
    assert pool.take_events() == [BlockRemoved((102, 101, 100, 202))]
    assert pool.get_cached_block(bytes([2, 0]) * 8) is pool.blocks[4]
    assert pool.get_cached_block(bytes([1, 0]) * 8) is None


def test_cache_full_blocks_event_and_reset() -> None:
    pool = BlockPool(num_blocks=5, enable_caching=True, block_size=2)
    blocks = pool.get_new_blocks(3)
    toks = [7, 8, 9, 10, 11, 12]
    pool.cache_full_blocks(blocks, [b"d0", b"d1", b"d2"], [10, 11, 12], toks, 0, 2, "lora-a")
    pool.cache_full_blocks(blocks, [b"d0", b"d1", b"d2"], [10, 11, 12], toks, 2, 3, "lora-a")
    assert pool.take_events() == [
        BlockStored((10, 11), None, (7, 8, 9, 10), 2, "lora-a"),
        BlockStored((12,), 11, (11, 12), 2, "lora-a"),  # parent = previous block's event hash
    ]
    assert pool.reset_prefix_cache() is False  # refused while blocks are in use (vLLM)
    pool.free_blocks(reversed(blocks))
    # one chain, though stored by two events
    assert pool.snapshot_events() == [BlockStored((10, 11, 12), None, (7, 8, 9, 10, 11, 12), 2, "lora-a")]
    assert pool.reset_prefix_cache() is True
    assert pool.take_events() == [AllBlocksCleared()]
    assert pool.get_cached_block(b"d0") is None
    assert pool.snapshot_events() == []


def test_duplicate_digests_are_all_cached_and_lookups_return_the_earliest() -> None:
    pool = BlockPool(num_blocks=8, enable_caching=True, block_size=1)
    a = pool.get_new_blocks(3)
    pool.cache_full_blocks(a, [b"x", b"y", b"x"], [1, 2, 1], [5, 6, 5], 0, 3, None)  # a repeat within one run
    b = pool.get_new_blocks(2)
    pool.cache_full_blocks(b, [b"y", b"z"], [2, 3], [6, 7], 0, 2, None)  # a repeat of a cached digest
    assert sorted(x.block_id for x in pool.iter_cached_blocks()) == [1, 2, 3, 4, 5]
    assert pool.get_cached_block(b"x") is a[0] and pool.get_cached_block(b"y") is a[1]
    pool.take_events()
    pool.free_blocks(reversed(a))  # free: [6, 7, 3, 2, 1]
    pool.free_blocks(reversed(b))  # free: [6, 7, 3, 2, 1, 5, 4]
    assert _ids(pool.get_new_blocks(4)) == [6, 7, 3, 2]  # evicts a[2] (x) and a[1] (y)
    assert pool.take_events() == [BlockRemoved((1, 2))]
    assert pool.get_cached_block(b"x") is a[0] and pool.get_cached_block(b"y") is b[0]
    assert _ids(pool.get_new_blocks(3)) == [1, 5, 4]
    assert pool.take_events() == [BlockRemoved((1, 3, 2))]
    assert list(pool.iter_cached_blocks()) == [] and pool.cached_block_hash_to_block == {}
