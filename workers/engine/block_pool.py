"""KV cache blocks, their LRU free queue and the hash -> block map, with vLLM v1's eviction and event semantics
(`vllm/v1/core/block_pool.py`, `kv_cache_utils.FreeKVCacheBlockQueue`). KV events queue here until the owner
calls `take_events()`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from switchyard.workers.engine.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KvEvent


class KVCacheBlock:
    """One KV block. The cache fields are set while the block is cached (full, hashed)."""

    __slots__ = (
        "block_id",
        "ref_cnt",
        "digest",
        "event_hash",
        "parent_event_hash",
        "token_ids",
        "depth",
        "lora_name",
        "prev_free",
        "next_free",
    )

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.digest: bytes | None = None  # full chained digest (the cache key); None = not cached
        self.event_hash = 0  # uint64 id carried by KV events
        self.parent_event_hash: int | None = None  # kept for snapshot_events()
        self.token_ids: tuple[int, ...] = ()
        self.depth = 0  # index of the block in its sequence: parents have smaller depths
        self.lora_name: str | None = None
        # Free-queue links; None when not in the queue.
        self.prev_free: KVCacheBlock | None = None
        self.next_free: KVCacheBlock | None = None

    def reset_hash(self) -> None:
        self.digest = None
        self.token_ids = ()

    def __repr__(self) -> str:
        return f"KVCacheBlock(id={self.block_id}, ref={self.ref_cnt}, cached={self.digest is not None})"


class FreeKVCacheBlockQueue:
    """Free blocks in eviction order (front = evicted first).

    NOTE: a doubly linked list with sentinels, not a deque: a cached free block hit by a new request is removed
    from the middle in O(1).
    """

    def __init__(self, blocks: Sequence[KVCacheBlock]) -> None:
        self.head = KVCacheBlock(-1)
        self.tail = KVCacheBlock(-1)
        prev = self.head
        for b in blocks:
            prev.next_free = b
            b.prev_free = prev
            prev = b
        prev.next_free = self.tail
        self.tail.prev_free = prev
        self.num_free_blocks = len(blocks)

    def popleft(self) -> KVCacheBlock:
        b = self.head.next_free
        if b is self.tail or b is None:
            raise ValueError("no free blocks")
        self.remove(b)
        return b

    def remove(self, b: KVCacheBlock) -> None:
        prev, nxt = b.prev_free, b.next_free
        assert prev is not None and nxt is not None, "block is not in the free queue"
        prev.next_free = nxt
        nxt.prev_free = prev
        b.prev_free = b.next_free = None
        self.num_free_blocks -= 1

    def append(self, b: KVCacheBlock) -> None:
        last = self.tail.prev_free
        assert last is not None
        last.next_free = b
        b.prev_free = last
        b.next_free = self.tail
        self.tail.prev_free = b
        self.num_free_blocks += 1

    def peek(self, n: int) -> list[KVCacheBlock]:
        """The first n blocks that popleft() would return, without removing them."""
        out = []
        b = self.head.next_free
        while len(out) < n and b is not self.tail and b is not None:
            out.append(b)
            b = b.next_free
        return out

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        return self.peek(self.num_free_blocks)


class BlockPool:
    """Allocates, frees and caches blocks. Block 0 is vLLM's null block: never handed out.

    Args:
        num_blocks: total blocks, the null block included (usable = num_blocks - 1, as vLLM).
        enable_caching: keep full blocks findable by hash after they are freed.
        block_size: tokens per block.
    """

    def __init__(self, num_blocks: int, enable_caching: bool, block_size: int) -> None:
        if num_blocks < 2:
            raise ValueError("need at least 2 KV blocks (one is the null block)")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.block_size = block_size
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks)
        self.null_block = self.free_block_queue.popleft()
        # digest -> {block_id: block}. NOTE: like vLLM, duplicates are not merged (block tables stay append-only):
        # a recomputed block with an already-cached hash is a second entry, and evicting either emits BlockRemoved.
        self.cached_block_hash_to_block: dict[bytes, dict[int, KVCacheBlock]] = {}
        self.kv_event_queue: list[KvEvent] = []

    # -- queries -------------------------------------------------------------------------------------------
    def get_num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    def get_num_used_blocks(self) -> int:
        """Blocks held by requests (the null block excluded)."""
        return self.num_blocks - 1 - self.free_block_queue.num_free_blocks

    def get_cached_block(self, digest: bytes) -> KVCacheBlock | None:
        blocks = self.cached_block_hash_to_block.get(digest)
        if not blocks:
            return None
        return next(iter(blocks.values()))

    # -- allocation ----------------------------------------------------------------------------------------
    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Pop blocks from the front of the free queue, evicting cached ones (a BlockRemoved each)."""
        if num_blocks > self.free_block_queue.num_free_blocks:
            raise ValueError(f"cannot get {num_blocks} free blocks from the pool")
        out = []
        popleft = self.free_block_queue.popleft
        for _ in range(num_blocks):
            b = popleft()
            if b.digest is not None:
                self._evict_cached_block(b)
            b.ref_cnt = 1
            out.append(b)
        return out

    def _evict_cached_block(self, b: KVCacheBlock) -> None:
        assert b.digest is not None
        same = self.cached_block_hash_to_block[b.digest]
        del same[b.block_id]
        if not same:
            del self.cached_block_hash_to_block[b.digest]
        self.kv_event_queue.append(BlockRemoved(block_hashes=(b.event_hash,)))
        b.reset_hash()

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """A prefix hit: take a reference, pulling the block out of the free queue if it was an eviction candidate."""
        for b in blocks:
            if b.ref_cnt == 0 and b is not self.null_block:
                self.free_block_queue.remove(b)
            b.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop a reference from each block; those reaching 0 join the queue's end in the given order."""
        for b in ordered_blocks:
            b.ref_cnt -= 1
            if b.ref_cnt == 0 and b is not self.null_block:
                self.free_block_queue.append(b)

    # -- caching -------------------------------------------------------------------------------------------
    def cache_full_blocks(
        self,
        blocks: Sequence[KVCacheBlock],
        digests: Sequence[bytes],
        event_hashes: Sequence[int],
        all_token_ids: Sequence[int],
        num_cached_blocks: int,
        num_full_blocks: int,
        lora_name: str | None,
    ) -> None:
        """Cache blocks[num_cached_blocks:num_full_blocks] and queue one BlockStored for them.

        The event's parent is the event hash of block num_cached_blocks - 1 (None at the sequence start).
        """
        if num_full_blocks <= num_cached_blocks:
            return
        bs = self.block_size
        parent = event_hashes[num_cached_blocks - 1] if num_cached_blocks > 0 else None
        table = self.cached_block_hash_to_block
        prev = parent
        for i in range(num_cached_blocks, num_full_blocks):
            b = blocks[i]
            assert b.digest is None, f"block {b.block_id} is already cached"
            d = digests[i]
            b.digest = d
            b.event_hash = event_hashes[i]
            b.parent_event_hash = prev
            b.token_ids = tuple(all_token_ids[i * bs : (i + 1) * bs])
            b.depth = i
            b.lora_name = lora_name
            same = table.get(d)
            if same is None:
                table[d] = {b.block_id: b}
            else:
                same[b.block_id] = b
            prev = b.event_hash
        self.kv_event_queue.append(
            BlockStored(
                block_hashes=tuple(event_hashes[num_cached_blocks:num_full_blocks]),
                parent_block_hash=parent,
                token_ids=tuple(all_token_ids[num_cached_blocks * bs : num_full_blocks * bs]),
                block_size=bs,
                lora_name=lora_name,
            )
        )

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash (AllBlocksCleared). Refused (False), as vLLM, while any block is in use."""
        if self.get_num_used_blocks() != 0:
            return False
        self.cached_block_hash_to_block.clear()
        for b in self.blocks:
            b.reset_hash()
        self.kv_event_queue.append(AllBlocksCleared())
        return True

    # -- events --------------------------------------------------------------------------------------------
    def take_events(self) -> list[KvEvent]:
        events, self.kv_event_queue = self.kv_event_queue, []
        return events

    def snapshot_events(self) -> list[KvEvent]:
        """One BlockStored per cached block, shallow blocks first (so parents precede children)."""
        cached = [b for same in self.cached_block_hash_to_block.values() for b in same.values()]
        cached.sort(key=lambda b: (b.depth, b.block_id))
        return [
            BlockStored(
                block_hashes=(b.event_hash,),
                parent_block_hash=b.parent_event_hash,
                token_ids=b.token_ids,
                block_size=self.block_size,
                lora_name=b.lora_name,
            )
            for b in cached
        ]
