"""The router's view of which worker holds which KV blocks, rebuilt purely from the workers' KV events.

One index per model. Block hashes are chained, so a hash identifies its whole prefix: a worker's cached prefix
for a request is the longest run of leading hashes resident on it. Duplicate BlockStored events are expected
(vLLM re-announces recomputed blocks) and are idempotent here, as are removals of hashes a worker does not hold.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Sequence
from itertools import compress, repeat
from typing import Any

from switchyard.ext.radix import BlockSet
from switchyard.workers.engine.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KvEvent


class PrefixIndex:
    """hash -> bitmask of the workers holding it, and worker -> its hashes (for O(own blocks) removal).

    Each worker seen gets a bit (the lowest free one; freed again by remove_worker). The masks keep ingestion
    to a dict read and write per stored hash, done in C for a whole event (this runs once per KV event of every
    worker, ~1.5M hashes per simulated Mooncake run), and make match() a running AND.

    NOTE: the mask map is built on the first `match` and kept from then on. Until a policy asks (E2 and the
    default policy keep their own tree; only `dynamo_kv` reads this one), ingestion keeps only the per-worker sets
    that `num_blocks` and `holds` read, half the dict work per event; the map built later equals the one kept
    from the start.
    """

    def __init__(self, block_set: Callable[[], Any] = BlockSet) -> None:
        """`block_set`: the per-worker set type (the ext build's `BlockSet`; `set` for a side-by-side bench)."""
        self._block_set = block_set
        self._hash_to_mask: dict[int, int] | None = None  # `_masks`: built on the first match
        self._worker_to_hashes: dict[str, set[int]] = {}  # `BlockSet`s (uint64 in C in the Cython build)
        self._worker_bit: dict[str, int] = {}
        self._bit_worker: dict[int, str] = {}  # bit -> worker

    def _bit(self, worker_id: str) -> int:
        bit = self._worker_bit.get(worker_id)
        if bit is None:
            bit = 1
            while bit in self._bit_worker:
                bit <<= 1
            self._worker_bit[worker_id] = bit
            self._bit_worker[bit] = worker_id
            self._worker_to_hashes[worker_id] = self._block_set()
        return bit

    def apply(self, worker_id: str, events: Iterable[KvEvent]) -> None:
        """Ingest one worker's events in order."""
        h2m = self._hash_to_mask
        for event in events:
            if isinstance(event, BlockStored):
                hashes = event.block_hashes
                bit = self._bit(worker_id)
                self._worker_to_hashes[worker_id].update(hashes)
                if h2m is not None:
                    _or_bit(h2m, hashes, bit)  # idempotent: no held check
            elif isinstance(event, BlockRemoved):
                held = self._worker_to_hashes.get(worker_id)
                if not held:
                    continue
                hashes = event.block_hashes
                if h2m is None:
                    held.difference_update(hashes)
                    continue
                if len(hashes) == 1:
                    h = hashes[0]
                    if h in held:
                        held.discard(h)
                        m = h2m.pop(h) & ~self._worker_bit[worker_id]
                        if m:
                            h2m[h] = m
                    continue
                gone = list(held.intersection(hashes))
                if not gone:
                    continue
                held.difference_update(gone)
                self._drop(gone, ~self._worker_bit[worker_id])
            elif isinstance(event, AllBlocksCleared):
                self.remove_worker(worker_id)

    def remove_worker(self, worker_id: str) -> None:
        """Forget everything a worker holds (it left, restarted, or cleared its cache)."""
        bit = self._worker_bit.pop(worker_id, None)
        held = self._worker_to_hashes.pop(worker_id, None)
        if bit is None:
            return
        del self._bit_worker[bit]
        if held and self._hash_to_mask is not None:
            self._drop(list(held), ~bit)

    def _drop(self, hashes: list[int], keep: int) -> None:
        """Clear the bits outside `keep` from held hashes: pop them all, put back those another worker still
        holds (iterated in C)."""
        h2m = self._masks()
        masks = list(map(keep.__and__, map(h2m.pop, hashes)))
        h2m.update(compress(zip(hashes, masks), masks))  # noqa: B905 - same lengths

    def _masks(self) -> dict[int, int]:
        """The hash -> worker-mask map, built from the per-worker sets on first use."""
        h2m = self._hash_to_mask
        if h2m is None:
            h2m = self._hash_to_mask = {}
            for worker_id, hashes in self._worker_to_hashes.items():
                _or_bit(h2m, hashes, self._worker_bit[worker_id])
        return h2m

    def match(self, block_hashes: Sequence[int]) -> dict[str, int]:
        """Per worker, the number of leading blocks of `block_hashes` it holds (workers with 0 are omitted)."""
        matched: dict[str, int] = {}
        get = self._masks().get
        alive = -1  # every worker
        n = 0
        for h in block_hashes:
            m = get(h, 0) & alive
            if m != alive:
                if n:
                    self._record(matched, alive & ~m, n)
                alive = m
                if not m:
                    return matched
            n += 1
        if n and alive:
            self._record(matched, alive, n)
        return matched

    def _record(self, matched: dict[str, int], mask: int, n: int) -> None:
        bit_worker = self._bit_worker
        while mask:
            low = mask & -mask
            matched[bit_worker[low]] = n
            mask ^= low

    def num_hashes(self) -> int:
        """Distinct hashes held by any worker (without building the mask map when nobody asked for it yet)."""
        if self._hash_to_mask is not None:
            return len(self._hash_to_mask)
        return len(set().union(*self._worker_to_hashes.values()))

    def num_blocks(self, worker_id: str) -> int:
        return len(self._worker_to_hashes.get(worker_id, ()))

    def holds(self, worker_id: str, block_hash: int) -> bool:
        return block_hash in self._worker_to_hashes.get(worker_id, ())


def _or_bit(h2m: dict[int, int], hashes: Collection[int], bit: int) -> None:
    """h2m[h] = h2m.get(h, 0) | bit for each h, iterated in C (`hashes` is read twice, in the same order)."""
    h2m.update(zip(hashes, map(bit.__or__, map(h2m.get, hashes, repeat(0))), strict=True))
