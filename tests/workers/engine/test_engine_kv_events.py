"""Snapshot events: `chain_stored` re-announces a cache as maximal BlockStored chains, `split_stored` cuts them into
bounded batches; expanded back to blocks, both give exactly the blocks they were given."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from switchyard.workers.engine.kv_events import BlockStored, CachedBlock, KvEvent, chain_stored, split_stored


def _blocks(draw_parents: list[int | None], loras: list[str | None], block_size: int) -> list[CachedBlock]:
    """Block i (hash 1000 + i) under block draw_parents[i] (an earlier index) or at a sequence start."""
    out: list[CachedBlock] = []
    for i, p in enumerate(draw_parents):
        tokens = tuple(range(i * block_size, (i + 1) * block_size))
        out.append((1000 + i, None if p is None else 1000 + p, tokens, block_size, loras[i]))
    return out


@st.composite
def forests(draw: st.DrawFn) -> list[CachedBlock]:
    n = draw(st.integers(1, 60))
    parents = [draw(st.one_of(st.none(), st.integers(0, i - 1))) if i else None for i in range(n)]
    loras = [draw(st.sampled_from([None, None, None, "a"])) for _ in range(n)]
    blocks = _blocks(parents, loras, block_size=2)
    dups = draw(st.lists(st.integers(0, n - 1), max_size=3))  # a digest the pool holds twice: later, same block
    return blocks + [blocks[i] for i in sorted(dups)]


def _expand(events: list[KvEvent]) -> list[CachedBlock]:
    out: list[CachedBlock] = []
    for ev in events:
        assert isinstance(ev, BlockStored)
        parent, bs = ev.parent_block_hash, ev.block_size
        assert len(ev.token_ids) == bs * len(ev.block_hashes)
        for i, h in enumerate(ev.block_hashes):
            out.append((h, parent, ev.token_ids[i * bs : (i + 1) * bs], bs, ev.lora_name))
            parent = h
    return out


@settings(max_examples=200, deadline=None)
@given(forests())
def test_chain_stored_announces_each_block_once_in_maximal_chains(blocks: list[CachedBlock]) -> None:
    events: list[KvEvent] = list(chain_stored(blocks))
    first: dict[int, CachedBlock] = {}
    for b in blocks:
        first.setdefault(b[0], b)
    unique = list(first.values())  # the first announcement of each hash, in order
    assert sorted(_expand(events)) == sorted(unique)
    announced: set[int] = set()
    for ev in events:  # parents before children: a fresh subscriber can hang every chain
        assert isinstance(ev, BlockStored)
        assert ev.parent_block_hash is None or ev.parent_block_hash in announced
        announced.update(ev.block_hashes)
    # a block continues its parent's chain exactly when it is the parent's first child and shares its LoRA
    by_hash = {b[0]: b for b in unique}
    first_child: dict[int, int] = {}
    for h, p, _, _, _ in unique:
        if p is not None:
            first_child.setdefault(p, h)
    starts = [
        h for h, p, _, _, lora in unique if p is None or first_child[p] != h or by_hash[p][4] != lora
    ]
    assert [ev.block_hashes[0] for ev in events if isinstance(ev, BlockStored)] == starts


def test_a_sequence_is_one_event_and_a_branch_starts_another() -> None:
    blocks = _blocks([None, 0, 1, 1, 3], [None] * 5, block_size=1)  # 0-1-2 and 1-3-4
    assert chain_stored(blocks) == [
        BlockStored((1000, 1001, 1002), None, (0, 1, 2), 1),
        BlockStored((1003, 1004), 1001, (3, 4), 1),
    ]


@settings(max_examples=200, deadline=None)
@given(forests(), st.integers(1, 7))
def test_split_stored_bounds_every_part_and_keeps_the_blocks_in_order(blocks: list[CachedBlock], limit: int) -> None:
    events: list[KvEvent] = list(chain_stored(blocks))
    parts = split_stored(events, limit)
    sizes = [[len(ev.block_hashes) for ev in part if isinstance(ev, BlockStored)] for part in parts]
    assert all(sizes) and all(sum(s) <= limit for s in sizes)
    assert _expand([ev for part in parts for ev in part]) == _expand(events)
    # a part ends only where the next event would not fit
    assert all(sum(s) + nxt[0] > limit for s, nxt in zip(sizes, sizes[1:], strict=False))
