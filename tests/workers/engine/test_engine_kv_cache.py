"""KVCacheManager: vLLM's block-hash recipe, prefix hits (whole blocks, the num_tokens - 1 cap), caching and the
BlockStored/BlockRemoved sequence a vLLM worker would publish."""

from __future__ import annotations

import hashlib
import pickle

import xxhash
from engine_testlib import make_engine, make_request

from switchyard.ext.blockhash import block_digests, to_event_hash
from switchyard.workers.engine.kv_cache_manager import KVCacheManager
from switchyard.workers.engine.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from switchyard.workers.engine.request import Request
from switchyard.workers.engine.types import EngineRequest


def _req(rid: str, prompt: list[int], **kw) -> Request:
    return Request(EngineRequest(rid, tuple(prompt), 4, 0.0, ignore_eos=True, **kw), vocab_size=32000)


def _sha(obj) -> bytes:
    return hashlib.sha256(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def test_block_hashes_match_the_vllm_recipe_sha256() -> None:
    # shared/specs/vllm-and-peer-routers.md "Block hash": NONE = sha256(pickle("vllm-none-hash")),
    # h_i = sha256(pickle((h_{i-1} or NONE, tuple(block_tokens), None))), event id = low 64 bits.
    kv = KVCacheManager(num_blocks=16, block_size=4, hash_algo="sha256")
    r = _req("a", [0, 11, 12, 13, 14, 15, 16, 17, 18])  # 9 tokens: 2 full blocks of 4, 1 left over
    kv.ensure_block_hashes(r, 2)
    h0 = _sha((_sha("vllm-none-hash"), (0, 11, 12, 13), None))
    h1 = _sha((h0, (14, 15, 16, 17), None))  # chained on the FULL 32-byte digest
    assert r.block_digests == [h0, h1]
    assert r.block_event_hashes == [
        int.from_bytes(h0, "big") & (2**64 - 1),
        int.from_bytes(h1, "big") & (2**64 - 1),
    ]


def test_block_hashes_xxhash_lora_and_salt() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=2, hash_algo="xxhash")
    r = _req("a", [5, 6, 7, 8, 9], lora_name="ad", cache_salt="s1")
    kv.ensure_block_hashes(r, 2)

    def xx(o):
        return xxhash.xxh3_128_digest(pickle.dumps(o, protocol=pickle.HIGHEST_PROTOCOL))

    none = xx("vllm-none-hash")
    h0 = xx((none, (5, 6), ("ad", "s1")))  # LoRA name on every block, the salt on the first only
    h1 = xx((h0, (7, 8), ("ad",)))
    assert r.block_digests == [h0, h1]
    assert r.block_digests == block_digests([5, 6, 7, 8], 2, "xxhash", lora_name="ad", cache_salt="s1")


def test_prefix_hit_counts_whole_blocks_and_caps_at_num_tokens_minus_1() -> None:
    kv = KVCacheManager(num_blocks=32, block_size=4)
    a = _req("a", list(range(100, 112)))  # 12 tokens = 3 full blocks
    assert kv.get_computed_blocks(a) == ([], 0)
    kv.allocate_slots(a, 12)  # computes all 12 tokens: blocks [1, 2, 3] cached
    assert [b.block_id for b in kv.get_blocks("a")] == [1, 2, 3]
    # same 12 tokens again: at most 12 - 1 = 11 tokens may hit -> 11 // 4 = 2 whole blocks = 8 tokens
    b = _req("b", list(range(100, 112)))
    blocks, n = kv.get_computed_blocks(b)
    assert ([x.block_id for x in blocks], n) == ([1, 2], 8)
    # 12 shared + 1 more token: 13 - 1 = 12 -> all 3 blocks hit
    c = _req("c", list(range(100, 113)))
    blocks, n = kv.get_computed_blocks(c)
    assert ([x.block_id for x in blocks], n) == ([1, 2, 3], 12)
    # diverging in the 2nd block (token 6): only block 0 hits
    d = _req("d", list(range(100, 106)) + [0] + list(range(107, 113)))
    assert kv.get_computed_blocks(d)[1] == 4
    # a different LoRA never hits
    e = _req("e", list(range(100, 113)), lora_name="x")
    assert kv.get_computed_blocks(e)[1] == 0


def test_allocate_slots_returns_none_when_full_and_counts_evictable_hits() -> None:
    kv = KVCacheManager(num_blocks=5, block_size=4)  # 4 usable
    a = _req("a", list(range(8)))
    assert [x.block_id for x in kv.allocate_slots(a, 8)] == [1, 2]
    kv.free(a)  # free = [3, 4, 2, 1]: a's 2 blocks are cached and evictable
    b = _req("b", list(range(8)) + list(range(50, 62)))  # 20 tokens; hits 2 blocks (8 tokens)
    hits, n = kv.get_computed_blocks(b)
    assert n == 8
    # needs cdiv(20, 4) = 5 blocks: 2 hits + 3 new; 3 new + 2 evictable hits = 5 > 4 free -> None, nothing changes
    assert kv.allocate_slots(b, 12, n, hits) is None
    assert kv.block_pool.get_num_free_blocks() == 4
    # 8 new tokens: 2 hits + 2 new = 4 <= 4
    assert [x.block_id for x in kv.allocate_slots(b, 8, n, hits)] == [3, 4]


def test_kv_events_stored_on_compute_duplicate_on_full_hit_removed_on_eviction() -> None:
    eng = make_engine(block_size=4, num_kv_blocks=6, max_model_len=64)  # 5 usable blocks
    p = list(range(1, 9))  # 8 tokens = 2 full blocks
    h = block_digests(p, 4, "xxhash")
    e0, e1 = to_event_hash(h[0]), to_event_hash(h[1])
    eng.add_request(make_request("a", p, max_tokens=1))
    eng.step(0.0)  # prefill 8 tokens, 1 output, finishes (LENGTH)
    assert eng.take_kv_events() == [BlockStored((e0, e1), None, tuple(p), 4)]
    # the whole prompt is cached: 7 tokens can hit -> block 0 only; block 1 is recomputed in a new block and
    # announced again with the same hash (the duplicate vLLM emits)
    eng.add_request(make_request("b", p, max_tokens=1))
    r = eng.step(1.0)
    assert r.outputs[0].num_cached_tokens == 4
    assert eng.take_kv_events() == [BlockStored((e1,), e0, tuple(p[4:]), 4)]
    # a 20-token unrelated prompt needs all 5 blocks and evicts the 3 cached ones in free-queue order:
    # a took [1, 2] and freed them tail first -> free [3, 4, 5, 2, 1]; b hit 1 (touch) and took 3 -> [4, 5, 2];
    # b freed [3, 1] tail first -> free [4, 5, 2, 3, 1]
    q = list(range(100, 120))
    eng.add_request(make_request("c", q, max_tokens=1))
    eng.step(2.0)
    ev = eng.take_kv_events()
    # blocks 4, 5 were never cached; 2 (a's block 1 = e1), 3 (b's duplicate of e1), 1 (e0) are evicted in order
    # (one BlockRemoved for the allocation's evictions, in order; it precedes the store of the new blocks)
    assert ev[0] == BlockRemoved((e1, e1, e0))
    assert len(ev) == 2 and isinstance(ev[1], BlockStored) and len(ev[1].block_hashes) == 5
    assert [b.block_id for b in eng.kv_cache_manager.get_blocks("c")] == []  # finished: freed
    assert eng.stats().prefix_cache_queries == 8 + 8 + 20 and eng.stats().prefix_cache_hits == 4


def test_decode_filled_blocks_are_cached_one_per_event_and_reset_clears() -> None:
    eng = make_engine(block_size=4, num_kv_blocks=16, max_model_len=64)
    eng.add_request(make_request("a", [1, 2, 3, 4, 5, 6], max_tokens=7, seed=3))
    t = 0.0
    got = []
    while eng.has_unfinished():
        r = eng.step(t)
        t += r.duration_s
        got.append(eng.take_kv_events())
    # prefill 6 tokens -> block 0 full (tokens 0-3) stored; then tokens 6.. computed one per step. Computed tokens
    # after each step: 6, 7, 8 (block 1 full: stored), 9, 10, 11, 12 (block 2 full: stored); the 7th output (the
    # 13th token) is sampled but never computed.
    sizes = [[len(e.block_hashes) for e in evs] for evs in got]
    assert sizes == [[1], [], [1], [], [], [], [1]]
    assert got[2][0].parent_block_hash == got[0][0].block_hashes[0]
    assert eng.reset_prefix_cache() is True
    assert eng.take_kv_events() == [AllBlocksCleared()]
    assert eng.snapshot_kv_events() == []


def test_snapshot_reannounces_parents_before_children() -> None:
    eng = make_engine(block_size=2, num_kv_blocks=32, max_model_len=64)
    eng.add_request(make_request("a", [1, 2, 3, 4, 5, 6], max_tokens=1))
    eng.step(0.0)
    eng.add_request(make_request("b", [1, 2, 3, 4, 9, 9, 9], max_tokens=1))
    eng.step(1.0)
    snap = eng.snapshot_kv_events()
    seen: set[int | None] = {None}
    for ev in snap:
        assert ev.parent_block_hash in seen  # a fresh subscriber can rebuild every chain
        seen.update(ev.block_hashes)
    # a: 3 blocks; b: hits 2, stores 1 more ([9, 9]) -> 4 cached blocks, in two chains: a's, and b's block after
    # their shared two
    assert [len(ev.block_hashes) for ev in snap] == [3, 1]
    assert snap[1].parent_block_hash == snap[0].block_hashes[1] and snap[1].token_ids == (9, 9)


def test_a_captured_snapshot_is_the_cache_at_capture_even_when_built_after_it_changed() -> None:
    """The hub captures on the engine's loop and builds in a thread while the engine runs on: what the build
    returns must be the cache at capture, whatever happened to the pool since (blocks evicted and reused for
    other prompts, a cache reset)."""
    eng = make_engine(block_size=2, num_kv_blocks=8, max_model_len=64)
    eng.add_request(make_request("a", [1, 2, 3, 4, 5, 6], max_tokens=1))
    eng.step(0.0)
    before = eng.snapshot_kv_events()
    build = eng.capture_kv_snapshot()
    for i, prompt in enumerate(([7, 8, 9, 10, 11, 12], [13, 14, 15, 16, 17, 18])):  # evicts a's blocks
        eng.add_request(make_request(f"b{i}", prompt, max_tokens=1))
        eng.step(1.0 + i)
    assert eng.snapshot_kv_events() != before
    assert build() == before and [len(ev.block_hashes) for ev in before] == [3]
    assert eng.reset_prefix_cache() is True
    assert build() == before

