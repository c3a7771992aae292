"""The router's view of which worker holds which KV blocks, rebuilt purely from the workers' KV events.

One index per model. Block hashes are chained, so a hash identifies its whole prefix: a worker's cached prefix
for a request is the longest run of leading hashes resident on it. Duplicate BlockStored events are expected
(vLLM re-announces recomputed blocks) and are idempotent here.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from switchyard.workers.engine.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KvEvent


class PrefixIndex:
    """hash -> set of workers holding it, and worker -> its hashes (for O(own blocks) removal)."""

    def __init__(self) -> None:
        self._hash_to_workers: dict[int, set[str]] = {}
        self._worker_to_hashes: dict[str, set[int]] = {}

    def apply(self, worker_id: str, events: Iterable[KvEvent]) -> None:
        """Ingest one worker's events in order."""
        for event in events:
            if isinstance(event, BlockStored):
                held = self._worker_to_hashes.setdefault(worker_id, set())
                for h in event.block_hashes:
                    if h not in held:
                        held.add(h)
                        self._hash_to_workers.setdefault(h, set()).add(worker_id)
            elif isinstance(event, BlockRemoved):
                held = self._worker_to_hashes.get(worker_id)
                if held is None:
                    continue
                for h in event.block_hashes:
                    if h in held:
                        held.discard(h)
                        self._discard(h, worker_id)
            elif isinstance(event, AllBlocksCleared):
                self.remove_worker(worker_id)

    def remove_worker(self, worker_id: str) -> None:
        """Forget everything a worker holds (it left, restarted, or cleared its cache)."""
        for h in self._worker_to_hashes.pop(worker_id, ()):
            self._discard(h, worker_id)

    def _discard(self, h: int, worker_id: str) -> None:
        workers = self._hash_to_workers.get(h)
        if workers is not None:
            workers.discard(worker_id)
            if not workers:
                del self._hash_to_workers[h]

    def match(self, block_hashes: Sequence[int]) -> dict[str, int]:
        """Per worker, the number of leading blocks of `block_hashes` it holds (workers with 0 are omitted)."""
        matched: dict[str, int] = {}
        alive: set[str] | None = None
        for i, h in enumerate(block_hashes):
            holders = self._hash_to_workers.get(h)
            if not holders:
                break
            alive = set(holders) if alive is None else alive & holders
            if not alive:
                break
            for w in alive:
                matched[w] = i + 1
        return matched

    def num_blocks(self, worker_id: str) -> int:
        return len(self._worker_to_hashes.get(worker_id, ()))

    def holds(self, worker_id: str, block_hash: int) -> bool:
        return block_hash in self._worker_to_hashes.get(worker_id, ())
