"""PrefixIndex: the router's KV view from workers' events, checked against a plain reference model (per worker,
the set of hashes it holds), including coalesced multi-hash BlockRemoved events and real engine event streams."""

from __future__ import annotations

import random

import pytest

from switchyard.ext.radix import BlockSet
from switchyard.router.prefix_index import PrefixIndex
from switchyard.workers.engine.core import EngineConfig, EngineCore
from switchyard.workers.engine.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KvEvent
from switchyard.workers.engine.profiles import get_profile
from switchyard.workers.engine.types import EngineRequest


class RefIndex:
    """The obvious model: worker -> set of held hashes; match counts leading hashes per worker."""

    def __init__(self) -> None:
        self.held: dict[str, set[int]] = {}

    def apply(self, worker_id: str, events) -> None:
        for e in events:
            if isinstance(e, BlockStored):
                self.held.setdefault(worker_id, set()).update(e.block_hashes)
            elif isinstance(e, BlockRemoved):
                for h in e.block_hashes:
                    self.held.get(worker_id, set()).discard(h)
            elif isinstance(e, AllBlocksCleared):
                self.held.pop(worker_id, None)

    def remove_worker(self, worker_id: str) -> None:
        self.held.pop(worker_id, None)

    def match(self, hashes) -> dict[str, int]:
        out = {}
        for w, held in self.held.items():
            n = 0
            for h in hashes:
                if h not in held:
                    break
                n += 1
            if n:
                out[w] = n
        return out


def _stored(*hashes: int, parent: int | None = None) -> BlockStored:
    return BlockStored(tuple(hashes), parent, tuple(range(2 * len(hashes))), 2)


def _split_removals(events) -> list[KvEvent]:
    return [
        BlockRemoved((h,)) if isinstance(e, BlockRemoved) else e
        for e in events
        for h in (e.block_hashes if isinstance(e, BlockRemoved) else (None,))
    ]


def _check(idx: PrefixIndex, ref: RefIndex, workers, probes) -> None:
    for w in workers:
        held = ref.held.get(w, set())
        assert idx.num_blocks(w) == len(held)
        for h in range(40):
            assert idx.holds(w, h) == (h in held)
    for p in probes:
        assert idx.match(p) == ref.match(p)


def test_match_counts_leading_blocks_per_worker() -> None:
    idx = PrefixIndex()
    idx.apply("a", [_stored(1, 2, 3, 4)])
    idx.apply("b", [_stored(1, 2)])
    idx.apply("c", [_stored(2, 3)])  # holds no prefix starting at 1
    assert idx.match([1, 2, 3, 4, 5]) == {"a": 4, "b": 2}
    assert idx.match([1]) == {"a": 1, "b": 1}
    assert idx.match([9, 1]) == {}
    assert idx.match([]) == {}
    idx.apply("a", [BlockRemoved((2,))])  # a hole: a's prefix stops at 1
    assert idx.match([1, 2, 3]) == {"a": 1, "b": 2}
    idx.apply("b", [AllBlocksCleared()])
    assert idx.match([1, 2]) == {"a": 1}
    assert idx.num_blocks("b") == 0


def test_duplicates_and_unknown_removals_are_idempotent() -> None:
    idx = PrefixIndex()
    idx.apply("a", [_stored(1, 2), _stored(2, parent=1), BlockRemoved((7,)), BlockRemoved((9, 9, 1))])
    assert idx.num_blocks("a") == 1 and idx.holds("a", 2) and not idx.holds("a", 1)
    idx.apply("z", [BlockRemoved((2,))])  # a worker never seen
    assert idx.match([2]) == {"a": 1}


def test_remove_worker_frees_its_slot_for_a_new_worker() -> None:
    idx = PrefixIndex()
    for i in range(5):
        idx.apply(f"w{i}", [_stored(1, 2 + i)])
    idx.remove_worker("w1")
    idx.remove_worker("never-seen")
    idx.apply("late", [_stored(1, 50)])  # may reuse w1's slot: must not inherit w1's blocks
    assert idx.match([1, 3]) == {"w0": 1, "w2": 1, "w3": 1, "w4": 1, "late": 1}
    assert idx.match([1, 50]) == {"w0": 1, "w2": 1, "w3": 1, "w4": 1, "late": 2}
    assert idx.num_blocks("w1") == 0


@pytest.mark.parametrize("block_set", [BlockSet, set], ids=["build", "set"])
@pytest.mark.parametrize("seed", range(20))
def test_random_streams_match_the_reference_and_coalescing_is_transparent(seed: int, block_set: type) -> None:
    """Both per-worker set types (the ext build's `BlockSet`, and `set`) against the reference."""
    rng = random.Random(seed)
    workers = [f"w{i}" for i in range(rng.randrange(1, 10))]
    idx, ref, per_block = PrefixIndex(block_set), RefIndex(), PrefixIndex(block_set)
    probes = [[rng.randrange(40) for _ in range(rng.randrange(1, 8))] for _ in range(30)]
    probes += [list(range(k, k + 6)) for k in range(0, 30, 3)]
    for _ in range(300):
        w = rng.choice(workers)
        batch: list[KvEvent] = []
        for _ in range(rng.randrange(1, 5)):
            x = rng.random()
            if x < 0.5:
                start = rng.randrange(40)
                batch.append(_stored(*range(start, min(40, start + rng.randrange(1, 8)))))
            elif x < 0.95:
                batch.append(BlockRemoved(tuple(rng.randrange(40) for _ in range(rng.randrange(1, 10)))))
            else:
                batch.append(AllBlocksCleared())
        if rng.random() < 0.03:
            idx.remove_worker(w)
            ref.remove_worker(w)
            per_block.remove_worker(w)
            continue
        idx.apply(w, batch)
        ref.apply(w, batch)
        # the same stream with every removal split into single-hash events (what vLLM publishes)
        per_block.apply(w, _split_removals(batch))
        _check(idx, ref, workers, probes[:5])
    _check(idx, ref, workers, probes)
    _check(per_block, ref, workers, probes)


def _engine_events(seed: int) -> list[list[KvEvent]]:
    """Per-step event batches of a small engine under block pressure (evictions, duplicates, preemptions)."""
    rng = random.Random(seed)
    eng = EngineCore(
        EngineConfig(block_size=4, num_kv_blocks=24, max_model_len=64, max_num_batched_tokens=32),
        get_profile("llama3-8b-a100"),
    )
    prefixes = [[rng.randrange(3, 200) for _ in range(rng.randrange(0, 24))] for _ in range(3)]
    batches = []
    t = 0.0
    for i in range(40):
        prompt = rng.choice(prefixes) + [rng.randrange(3, 200) for _ in range(rng.randrange(1, 20))]
        eng.add_request(EngineRequest(f"r{i}", tuple(prompt), rng.randrange(1, 20), t, ignore_eos=True))
        for _ in range(rng.randrange(0, 4)):
            r = eng.step(t)
            if r is not None:
                t += r.duration_s
            batches.append(eng.take_kv_events())
    while eng.has_unfinished():
        t += eng.step(t).duration_s
        batches.append(eng.take_kv_events())
    # the cache as a multiset of hashes: the event stream must describe it exactly
    held: dict[int, int] = {}
    for b in eng.kv_cache_manager.block_pool.iter_cached_blocks():
        held[b.event_hash] = held.get(b.event_hash, 0) + 1
    counts: dict[int, int] = {}
    for batch in batches:
        for e in batch:
            sign = 1 if isinstance(e, BlockStored) else -1
            for h in e.block_hashes:
                counts[h] = counts.get(h, 0) + sign
                assert counts[h] >= 0, "a removal before its store"
    assert {h: c for h, c in counts.items() if c} == held
    return batches


@pytest.mark.parametrize("seed", range(5))
def test_engine_event_stream_gives_the_same_index_as_per_block_events(seed: int) -> None:
    batches = _engine_events(seed)
    assert any(isinstance(e, BlockRemoved) and len(e.block_hashes) > 1 for b in batches for e in b)
    idx, per_block, ref = PrefixIndex(), PrefixIndex(), RefIndex()
    for batch in batches:
        idx.apply("w", batch)
        ref.apply("w", batch)
        per_block.apply("w", _split_removals(batch))
    hashes = sorted(ref.held.get("w", set()))
    assert idx.num_blocks("w") == per_block.num_blocks("w") == len(hashes)
    assert all(idx.holds("w", h) and per_block.holds("w", h) for h in hashes)


@pytest.mark.parametrize("seed", range(10))
def test_the_mask_map_built_late_equals_the_one_kept_from_the_start(seed: int) -> None:
    """The worker-mask map is built on the first match: an index first asked after a random stretch of events
    (stores, coalesced removals, clears, departures) answers as one asked after every event, and keeps doing so."""
    rng = random.Random(seed)
    workers = [f"w{i}" for i in range(rng.randrange(2, 8))]
    eager, lazy, ref = PrefixIndex(), PrefixIndex(), RefIndex()
    probes = [list(range(k, k + 6)) for k in range(0, 36, 2)] + [[rng.randrange(40) for _ in range(4)]]
    eager.match([0])
    first_ask = rng.randrange(50, 250)
    for step in range(300):
        w = rng.choice(workers)
        x = rng.random()
        if x < 0.03:  # a departure is checked like an event (the first ask may come right after one)
            for idx in (eager, lazy, ref):
                idx.remove_worker(w)
        else:
            if x < 0.55:
                start = rng.randrange(40)
                batch: list[KvEvent] = [_stored(*range(start, min(40, start + rng.randrange(1, 8))))]
            elif x < 0.97:
                batch = [BlockRemoved(tuple(rng.randrange(40) for _ in range(rng.randrange(1, 10))))]
            else:
                batch = [AllBlocksCleared()]
            for idx in (eager, lazy, ref):
                idx.apply(w, batch)
        assert (lazy._hash_to_mask is None) == (step < first_ask)  # nobody asked yet: no map kept
        assert lazy.num_hashes() == len(set().union(*ref.held.values()))
        if step >= first_ask:
            _check(lazy, ref, workers, probes)
        if step + 1 == first_ask:
            assert [lazy.match(p) for p in probes] == [eager.match(p) for p in probes]
    _check(lazy, ref, workers, probes)
    _check(eager, ref, workers, probes)
