"""Per-request block tables over the block pool (vLLM `vllm/v1/core/kv_cache_manager.py` plus its single
full-attention manager): prefix-cache lookups, slot allocation, caching of newly full blocks, freeing.
"""

from __future__ import annotations

from switchyard.ext.blockhash import block_digests, event_hashes, none_hash
from switchyard.workers.engine.block_pool import BlockPool, KVCacheBlock
from switchyard.workers.engine.request import Request


class KVCacheManager:
    """Block tables of running requests.

    Args:
        num_blocks: total KV blocks (the null block included).
        block_size: tokens per block.
        enable_caching: prefix caching on/off.
        hash_algo, hash_seed: vLLM's `--prefix-caching-hash-algo` and the NONE_HASH seed ("" = vLLM's default).
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool = True,
        hash_algo: str = "xxhash",
        hash_seed: str = "",
    ) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.hash_algo = hash_algo
        self.hash_seed = hash_seed
        none_hash(hash_algo, hash_seed)  # validates the algorithm name early
        self.block_pool = BlockPool(num_blocks, enable_caching, block_size)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self.num_cached_block: dict[str, int] = {}  # blocks of the request already in the cache

    # -- hashes --------------------------------------------------------------------------------------------
    def ensure_block_hashes(self, req: Request, num_full_blocks: int) -> None:
        """Extend the request's memoised hash chain to its first num_full_blocks full blocks."""
        have = len(req.block_digests)
        if have >= num_full_blocks:
            return
        bs = self.block_size
        new = block_digests(
            req.all_token_ids[have * bs : num_full_blocks * bs],
            bs,
            self.hash_algo,
            parent=req.block_digests[-1] if have else None,
            start_block=have,
            lora_name=req.lora_name,
            cache_salt=req.cache_salt,
            seed=self.hash_seed,
        )
        req.block_digests.extend(new)
        req.block_event_hashes.extend(event_hashes(new))

    # -- lookups -------------------------------------------------------------------------------------------
    def get_computed_blocks(self, req: Request) -> tuple[list[KVCacheBlock], int]:
        """The longest cached prefix of full blocks, as (blocks, num_computed_tokens).

        At most num_tokens - 1 tokens can hit, so the last token is always computed (to get logits): a prompt of
        exactly k full cached blocks hits only k - 1 of them and recomputes (and re-announces) the last.
        """
        if not self.enable_caching:
            return [], 0
        max_hit_blocks = (req.num_tokens - 1) // self.block_size
        self.ensure_block_hashes(req, max_hit_blocks)
        get = self.block_pool.cached_block_hash_to_block.get
        hits: list[KVCacheBlock] = []
        append = hits.append
        digests = req.block_digests
        for i in range(min(max_hit_blocks, len(digests))):
            b = get(digests[i])
            if b is None:
                break
            if type(b) is dict:  # several blocks hold this digest: the earliest cached, as get_cached_block
                b = next(iter(b.values()))
            append(b)
        return hits, len(hits) * self.block_size

    def num_cached_prefix_tokens(self, req: Request) -> int:
        """The hit get_computed_blocks would return now (no side effects beyond hashing)."""
        return self.get_computed_blocks(req)[1]

    # -- allocation ----------------------------------------------------------------------------------------
    def allocate_slots(
        self,
        req: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: list[KVCacheBlock] | None = None,
    ) -> list[KVCacheBlock] | None:
        """Blocks for num_new_tokens more tokens; None (and no change) when the pool cannot supply them.

        Layout of the request's tokens after this call:

            | num_computed_tokens | num_new_computed_tokens (prefix hits) | num_new_tokens (this step) |
            |<------------------------ cdiv(total, block_size) blocks ------------------------------>|

        Hit blocks that sit in the free queue (ref 0) count against the free blocks too: touching them takes
        them out of the queue. Full blocks among the ones computed this step are cached right away and a
        BlockStored queued (vLLM caches at allocation; the owner takes the events at the end of the step).
        """
        new_computed_blocks = new_computed_blocks or []
        rid = req.request_id
        req_blocks = self.req_to_blocks.get(rid)
        if req_blocks is None:
            req_blocks = self.req_to_blocks[rid] = []
        num_computed = req.num_computed_tokens + num_new_computed_tokens
        total = num_computed + num_new_tokens
        bs = self.block_size
        num_new_blocks = (total + bs - 1) // bs - len(req_blocks) - len(new_computed_blocks)
        pool = self.block_pool
        num_evictable = 0
        for b in new_computed_blocks:
            if b.ref_cnt == 0:
                num_evictable += 1
        if num_new_blocks + num_evictable > pool.free_block_queue.num_free_blocks:
            return None
        if new_computed_blocks:
            pool.touch(new_computed_blocks)
            req_blocks.extend(new_computed_blocks)
        if rid not in self.num_cached_block:
            self.num_cached_block[rid] = len(new_computed_blocks)
        new_blocks = pool.get_new_blocks(num_new_blocks) if num_new_blocks > 0 else []
        req_blocks.extend(new_blocks)
        if self.enable_caching:
            self.cache_blocks(req, min(total, req.num_tokens))
        return new_blocks

    def cache_blocks(self, req: Request, num_tokens: int) -> None:
        """Cache the request's blocks that the first num_tokens tokens fill."""
        rid = req.request_id
        num_cached = self.num_cached_block[rid]
        num_full = num_tokens // self.block_size
        if num_full <= num_cached:
            return
        self.ensure_block_hashes(req, num_full)
        self.block_pool.cache_full_blocks(
            self.req_to_blocks[rid],
            req.block_digests,
            req.block_event_hashes,
            req.all_token_ids,
            num_cached,
            num_full,
            req.lora_name,
        )
        self.num_cached_block[rid] = num_full

    def free(self, req: Request) -> None:
        """Release the request's blocks, tail first: its last blocks become the first eviction candidates."""
        rid = req.request_id
        blocks = self.req_to_blocks.pop(rid, None)
        self.num_cached_block.pop(rid, None)
        if blocks:
            self.block_pool.free_blocks(reversed(blocks))

    def get_blocks(self, request_id: str) -> list[KVCacheBlock]:
        return self.req_to_blocks.get(request_id, [])

    def usage(self) -> float:
        pool = self.block_pool
        return pool.get_num_used_blocks() / (pool.num_blocks - 1)

    def reset_prefix_cache(self) -> bool:
        return self.block_pool.reset_prefix_cache()

    def take_events(self):  # noqa: ANN201 - list[KvEvent]
        return self.block_pool.take_events()
