"""KV cache blocks, their LRU free queue and the hash -> block map, with vLLM v1's eviction and event semantics
(`vllm/v1/core/block_pool.py`, `kv_cache_utils.FreeKVCacheBlockQueue`). KV events queue here until the owner
calls `take_events()`.

NOTE: this is the simulator's hottest code (every block of every prompt passes through it several times), so the
pool's bulk operations walk the free queue's links inline instead of calling the queue's per-block methods.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterable, Iterator, Sequence

from switchyard.workers.engine.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    CachedBlock,
    KvEvent,
    chain_stored,
)


class KVCacheBlock:
    """One KV block. The cache fields are set while the block is cached (full, hashed).

    A cached block points at the BlockStored event that announced it (`stored` = (event, depth of the event's
    first block)): its parent hash, token ids and LoRA are read from there when a snapshot needs them, so
    caching a block costs a few attribute stores and no per-block tuple.
    """

    __slots__ = (
        "block_id",
        "ref_cnt",
        "digest",
        "event_hash",
        "depth",
        "stored",
        "prev_free",
        "next_free",
    )

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.digest: bytes | None = None  # full chained digest (the cache key); None = not cached
        self.event_hash = 0  # uint64 id carried by KV events
        self.depth = 0  # index of the block in its sequence: parents have smaller depths
        # (the BlockStored that announced it, the depth of that event's first block) while cached
        self.stored: tuple[BlockStored, int] | None = None
        # Free-queue links; None when not in the queue.
        self.prev_free: KVCacheBlock | None = None
        self.next_free: KVCacheBlock | None = None

    @property
    def parent_event_hash(self) -> int | None:
        if self.digest is None or self.stored is None:
            return None
        ev, start = self.stored
        i = self.depth - start
        return ev.block_hashes[i - 1] if i > 0 else ev.parent_block_hash

    @property
    def token_ids(self) -> tuple[int, ...]:
        if self.digest is None or self.stored is None:
            return ()
        ev, start = self.stored
        i = self.depth - start
        return ev.token_ids[i * ev.block_size : (i + 1) * ev.block_size]

    @property
    def lora_name(self) -> str | None:
        return self.stored[0].lora_name if self.digest is not None and self.stored is not None else None

    def reset_hash(self) -> None:
        self.digest = None
        self.stored = None

    def __repr__(self) -> str:
        return f"KVCacheBlock(id={self.block_id}, ref={self.ref_cnt}, cached={self.digest is not None})"


class FreeKVCacheBlockQueue:
    """Free blocks in eviction order (front = evicted first).

    NOTE: a doubly linked list with sentinels, not a deque: a cached free block hit by a new request is removed
    from the middle in O(1). (Faster here than an OrderedDict: measured ~2x per pop + append.)
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

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        """The first n blocks, removed in one relink (ValueError if there are fewer)."""
        if n > self.num_free_blocks:
            raise ValueError(f"only {self.num_free_blocks} free blocks, {n} wanted")
        out = []
        append = out.append
        b = self.head.next_free
        for _ in range(n):
            append(b)
            nxt = b.next_free
            b.prev_free = b.next_free = None
            b = nxt
        self.head.next_free = b
        b.prev_free = self.head
        self.num_free_blocks -= n
        return out

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

    Events: one BlockStored per cache_full_blocks call; one BlockRemoved per get_new_blocks call that evicted
    anything, listing the evicted hashes in eviction order (vLLM emits one per block; a multi-hash BlockRemoved
    means the same to every consumer, and no store falls between the removals it merges).
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
        # digest -> the cached block, or {block_id: block} when several blocks hold the same digest. NOTE: like
        # vLLM, duplicates are not merged (block tables stay append-only): a recomputed block with an
        # already-cached hash is a second entry, and evicting either emits BlockRemoved. Lookups return the
        # earliest cached of them (vLLM's BlockHashToBlockMap has the same single-block-or-dict layout).
        self.cached_block_hash_to_block: dict[bytes, KVCacheBlock | dict[int, KVCacheBlock]] = {}
        self.kv_event_queue: list[KvEvent] = []

    # -- queries -------------------------------------------------------------------------------------------
    def get_num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    def get_num_used_blocks(self) -> int:
        """Blocks held by requests (the null block excluded)."""
        return self.num_blocks - 1 - self.free_block_queue.num_free_blocks

    def get_cached_block(self, digest: bytes) -> KVCacheBlock | None:
        v = self.cached_block_hash_to_block.get(digest)
        if v is None or type(v) is KVCacheBlock:
            return v
        return next(iter(v.values()))

    def iter_cached_blocks(self) -> Iterator[KVCacheBlock]:
        """Every cached block (duplicates of a digest included)."""
        for v in self.cached_block_hash_to_block.values():
            if type(v) is KVCacheBlock:
                yield v
            else:
                yield from v.values()

    # -- allocation ----------------------------------------------------------------------------------------
    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Pop blocks from the front of the free queue, evicting cached ones (one BlockRemoved for them all)."""
        fq = self.free_block_queue
        if num_blocks > fq.num_free_blocks:
            raise ValueError(f"cannot get {num_blocks} free blocks from the pool")
        if num_blocks <= 0:
            return []
        out = []
        append = out.append
        table = self.cached_block_hash_to_block
        removed: list[int] | None = None
        head = fq.head
        b = head.next_free
        for _ in range(num_blocks):
            append(b)
            d = b.digest
            if d is not None:  # evict: forget the hash, announce it
                v = table[d]
                if v is b:
                    del table[d]
                else:
                    assert type(v) is dict
                    del v[b.block_id]
                    if len(v) == 1:
                        table[d] = next(iter(v.values()))
                if removed is None:
                    removed = [b.event_hash]
                else:
                    removed.append(b.event_hash)
                b.digest = None
                b.stored = None
            b.ref_cnt = 1
            nxt = b.next_free
            b.prev_free = b.next_free = None
            b = nxt
        head.next_free = b
        b.prev_free = head
        fq.num_free_blocks -= num_blocks
        if removed is not None:
            self.kv_event_queue.append(BlockRemoved(tuple(removed)))
        return out

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """A prefix hit: take a reference, pulling the block out of the free queue if it was an eviction candidate."""
        null = self.null_block
        taken = 0
        for b in blocks:
            if b.ref_cnt == 0 and b is not null:
                prev, nxt = b.prev_free, b.next_free
                assert prev is not None and nxt is not None, "block is not in the free queue"
                prev.next_free = nxt
                nxt.prev_free = prev
                b.prev_free = b.next_free = None
                taken += 1
            b.ref_cnt += 1
        self.free_block_queue.num_free_blocks -= taken

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop a reference from each block; those reaching 0 join the queue's end in the given order."""
        fq = self.free_block_queue
        null = self.null_block
        tail = fq.tail
        last = tail.prev_free
        assert last is not None
        added = 0
        for b in ordered_blocks:
            b.ref_cnt -= 1
            if b.ref_cnt == 0 and b is not null:
                last.next_free = b
                b.prev_free = last
                last = b
                added += 1
        last.next_free = tail
        tail.prev_free = last
        fq.num_free_blocks += added

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
        start, stop = num_cached_blocks, num_full_blocks
        if stop <= start:
            return
        bs = self.block_size
        hashes = tuple(event_hashes[start:stop])
        ev = BlockStored(
            block_hashes=hashes,
            parent_block_hash=event_hashes[start - 1] if start > 0 else None,
            token_ids=tuple(all_token_ids[start * bs : stop * bs]),
            block_size=bs,
            lora_name=lora_name,
        )
        seg = (ev, start)
        new_blocks = blocks[start:stop]
        new_digests = digests[start:stop]
        for depth, b, d, h in zip(range(start, stop), new_blocks, new_digests, hashes, strict=True):
            assert b.digest is None, f"block {b.block_id} is already cached"
            b.digest = d
            b.event_hash = h
            b.depth = depth
            b.stored = seg
        table = self.cached_block_hash_to_block
        if table.keys().isdisjoint(new_digests):  # the usual case: no duplicates, insert them all in C
            n0 = len(table)
            table.update(zip(new_digests, new_blocks))  # noqa: B905 - same lengths (checked above)
            if len(table) - n0 == len(new_blocks):
                new_blocks = []
            else:  # a digest repeats within the run (tests' toy digests): redo those by the general path
                for d in set(new_digests):
                    del table[d]
        if new_blocks:
            for b, d in zip(new_blocks, new_digests):  # noqa: B905 - same lengths (checked above)
                v = table.setdefault(d, b)
                if v is not b:  # a duplicate of a cached digest
                    if type(v) is dict:
                        v[b.block_id] = b
                    else:
                        table[d] = {v.block_id: v, b.block_id: b}
        self.kv_event_queue.append(ev)

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
        """Every cached block, as BlockStored chains, shallow blocks first (so parents precede children)."""
        return self.capture_snapshot()()

    def capture_snapshot(self) -> Callable[[], list[KvEvent]]:
        """`snapshot_events` in two halves: this one reads four fields of every cached block (~15-20 ms at 64k
        blocks); the function it returns builds the events from those and the immutable events that stored the
        blocks, touching nothing the pool changes, so it may run in another thread while the engine goes on."""
        values = list(self.cached_block_hash_to_block.values())
        blocks = [v for v in values if type(v) is KVCacheBlock]
        if len(blocks) < len(values):  # duplicates of a digest (a dict of blocks)
            blocks += [b for v in values if type(v) is not KVCacheBlock for b in v.values()]
        # This half runs on the engine's loop: one C loop per field, and no tuple per block. Here and in the build,
        # 64k tuples kept alive set off collections of every object of the process (30-100 ms, and a collection
        # in the build's thread stops the loop too); ones made and dropped one at a time do not.
        depth, block_id, event_hash, stored = (
            list(map(operator.attrgetter(f), blocks)) for f in ("depth", "block_id", "event_hash", "stored")
        )

        def build() -> list[KvEvent]:
            order = sorted(range(len(depth)), key=lambda i: (depth[i] << 32) | block_id[i])  # parents first
            return list(chain_stored(_as_cached_block(depth[i], event_hash[i], stored[i]) for i in order))

        return build


def _as_cached_block(depth: int, event_hash: int, stored: tuple[BlockStored, int] | None) -> CachedBlock:
    """A cached block's parent hash, token ids and LoRA, read from the event that stored it (`KVCacheBlock`'s
    properties, each read once)."""
    assert stored is not None  # set while cached
    ev, start = stored
    i, bs = depth - start, ev.block_size
    parent = ev.block_hashes[i - 1] if i > 0 else ev.parent_block_hash
    return event_hash, parent, ev.token_ids[i * bs : (i + 1) * bs], bs, ev.lora_name
