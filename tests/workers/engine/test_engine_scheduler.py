"""Scheduler, driven through schedule()/update_from_step() without the core: chunked prefill under the token
budget, recompute preemption (victim, front of waiting), priorities, aborts, deterministic sampling."""

from __future__ import annotations

import pytest
from engine_testlib import make_engine, make_request

from switchyard.workers.engine.request import Request, output_tokens, token_base
from switchyard.workers.engine.types import EngineRequest, FinishReason


def _plan_tokens(plan) -> list[tuple[str, int]]:
    return [(r.request_id, n) for r, n in plan.scheduled]


def test_chunked_prefill_splits_by_remaining_budget() -> None:
    eng = make_engine(block_size=16, num_kv_blocks=128, max_num_batched_tokens=100)
    s = eng.scheduler
    eng.add_request(make_request("a", list(range(1, 251)), max_tokens=2))  # 250 tokens
    eng.add_request(make_request("b", list(range(1000, 1030)), max_tokens=2))  # 30 tokens
    p1 = s.schedule()
    assert _plan_tokens(p1) == [("a", 100)]  # budget 100 all to a's first chunk
    s.update_from_step(p1)
    p2 = s.schedule()
    assert _plan_tokens(p2) == [("a", 100)]  # 250 - 100 = 150 left, budget 100
    s.update_from_step(p2)
    p3 = s.schedule()
    # a's last 50 tokens, then b admitted with the remaining 100 - 50 = 50 >= 30
    assert _plan_tokens(p3) == [("a", 50), ("b", 30)]
    assert (p3.num_prefill_tokens, p3.num_decode_reqs) == (80, 0)
    # query-key pairs: a: 50 * 200 + 50 * 51 / 2 = 11275; b: 30 * 31 / 2 = 465
    assert p3.prefill_attn_pairs == 11275 + 465
    outs = s.update_from_step(p3)
    assert [len(o.new_token_ids) for o in outs] == [1, 1]  # both sample their first token
    p4 = s.schedule()
    assert _plan_tokens(p4) == [("a", 1), ("b", 1)]
    assert (p4.num_decode_reqs, p4.decode_context_tokens) == (2, 251 + 31)


def test_preemption_recompute_victim_is_last_running_and_goes_to_front() -> None:
    # 5 usable blocks of 4 tokens; a and b each hold 2 blocks after prefill (8 tokens + decode)
    eng = make_engine(block_size=4, num_kv_blocks=6, max_model_len=64)
    s = eng.scheduler
    eng.add_request(make_request("a", list(range(1, 8)), max_tokens=10))  # 7 tokens -> 2 blocks
    eng.add_request(make_request("b", list(range(20, 27)), max_tokens=10))  # 7 tokens -> 2 blocks
    eng.add_request(make_request("c", list(range(40, 45)), max_tokens=10))  # 5 tokens -> 2 blocks: no room
    p = s.schedule()
    assert _plan_tokens(p) == [("a", 7), ("b", 7)] and p.admission_blocked == "blocks"
    s.update_from_step(p)  # a, b: 8 tokens each, 7 computed
    p = s.schedule()  # decode token 8 of each: still inside block 2
    assert _plan_tokens(p) == [("a", 1), ("b", 1)]
    s.update_from_step(p)  # 8 computed, 9 tokens: the next decode needs a 3rd block each
    p = s.schedule()
    # a takes the last free block; b cannot -> b (the last running) is preempted by recompute
    assert _plan_tokens(p) == [("a", 1)]
    assert p.preempted_req_ids == ("b",) and p.admission_blocked == "preempted"
    b = s.requests["b"]
    assert b.num_computed_tokens == 0 and b.num_preemptions == 1 and s.num_preemptions == 1
    assert [r.request_id for r in s.waiting] == ["b", "c"]  # b at the front, ahead of c
    assert eng.stats().num_waiting_uncached_tokens == 9 + 5  # b recomputes prompt + its 2 outputs
    s.update_from_step(p)
    # b (9 tokens) could hit 8 = its own 2 cached blocks, now free: 2 evictable hits + 1 new = 3 > 2 free
    p = s.schedule()
    assert _plan_tokens(p) == [("a", 1)] and p.admission_blocked == "blocks"
    s.update_from_step(p)
    # a decodes to its 10th output (16 tokens computed = 4 blocks); its 4th block evicts b's block 1 (b freed
    # tail first, so its tail goes first). When a finishes, b is readmitted with block 0 hit (4 tokens).
    while "a" in s.requests:
        s.update_from_step(s.schedule())
    p = s.schedule()
    assert _plan_tokens(p) == [("b", 5), ("c", 5)]  # b: 9 - 4 hit; c: 5 (3 + 2 blocks = 5 free)
    assert eng.stats().prefix_cache_hits == 4 and s.requests["b"].num_cached_tokens == 0
    while eng.has_unfinished():
        s.update_from_step(s.schedule())
    out_b = b.all_token_ids[7:]
    assert out_b == output_tokens(b.base, 0, 10, 32000)  # preemption does not change the sampled tokens


def test_priority_scheduling_admits_lowest_priority_value_first() -> None:
    eng = make_engine(scheduling="priority", max_num_seqs=1)
    eng.add_request(make_request("late", [1, 2, 3], priority=5, arrival_s=0.0))
    eng.add_request(make_request("urgent", [4, 5, 6], priority=0, arrival_s=1.0))
    p = eng.scheduler.schedule()
    assert _plan_tokens(p) == [("urgent", 3)] and p.admission_blocked == "max_num_seqs"


def test_abort_frees_blocks_immediately() -> None:
    eng = make_engine(block_size=4, num_kv_blocks=10)
    eng.add_request(make_request("a", list(range(1, 14)), max_tokens=5))  # 13 tokens -> 4 blocks
    eng.step(0.0)
    assert eng.stats().kv_blocks_used == 4
    assert eng.abort_request("a") is True
    assert eng.stats().kv_blocks_used == 0 and not eng.has_unfinished()
    assert eng.abort_request("a") is False
    eng.add_request(make_request("w", [1, 2], max_tokens=5))
    assert eng.abort_request("w") is True and eng.stats().num_waiting == 0
    assert eng.stats().num_waiting_uncached_tokens == 0


def test_tokens_deterministic_and_stop_points() -> None:
    base = token_base("r1", None)
    assert output_tokens(base, 0, 5, 32000) == output_tokens(token_base("r1", None), 0, 5, 32000)
    assert output_tokens(token_base("x", 7), 0, 50, 32000) == output_tokens(token_base("y", 7), 0, 50, 32000)
    toks = output_tokens(base, 0, 2000, 100)
    assert min(toks) >= 3 and max(toks) < 100  # never BOS/EOS/pad

    def run(**kw) -> tuple[list[int], FinishReason | None]:
        eng = make_engine()
        eng.add_request(make_request("r1", [1, 2, 3], **kw))
        out: list[int] = []
        reason = None
        t = 0.0
        while eng.has_unfinished():
            r = eng.step(t)
            t += r.duration_s
            for o in r.outputs:
                out.extend(o.new_token_ids)
                reason = o.finish_reason or reason
        return out, reason

    toks8, why = run(max_tokens=8)
    assert why == FinishReason.LENGTH and toks8 == output_tokens(base, 0, 8, 32000)
    t3, why = run(max_tokens=8, ignore_eos=False, target_output_tokens=3)
    assert why == FinishReason.STOP and t3 == toks8[:2] + [2]  # EOS (2) is the 3rd token
    t8, why = run(max_tokens=8, ignore_eos=False, target_output_tokens=8)
    assert why == FinishReason.LENGTH and t8 == toks8  # the length cap wins at max_tokens
    # seeded stop points: uniform on [1, max_tokens], mean ~ max_tokens / 2
    stops = [
        Request(EngineRequest(f"q{i}", (1,), 100, 0.0), vocab_size=32000).stop_len or 100 for i in range(2000)
    ]
    assert min(stops) == 1 and max(stops) == 100 and 45 < sum(stops) / len(stops) < 56


def test_a_budget_below_max_model_len_needs_chunked_prefill() -> None:
    """Without chunked prefill a prompt longer than one iteration's budget could never start (it would wait
    forever): the engine refuses the configuration, as vLLM does; with chunked prefill it is fine."""
    with pytest.raises(ValueError, match="without chunked prefill"):
        make_engine(enable_chunked_prefill=False, max_num_batched_tokens=512, max_model_len=1024)
    make_engine(enable_chunked_prefill=False, max_num_batched_tokens=1024, max_model_len=1024)
    make_engine(enable_chunked_prefill=True, max_num_batched_tokens=512, max_model_len=1024)
