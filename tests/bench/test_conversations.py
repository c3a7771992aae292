"""Synthetic multi-turn conversations (`bench/conversations.py`): each follow-up carries a whole earlier prompt as
its prefix, the draws are deterministic, the rows read back through the Bailian parser as a file would, and
`bench sim --trace conversations` routes them: prefix affinity finds the history a follow-up brings back."""

from __future__ import annotations

import json

import pytest

from switchyard.bench import sim
from switchyard.bench.conversations import (
    FIRST_BLOCKS,
    TURN_BLOCKS,
    ConversationSpec,
    conversation_rows,
    make_conversations,
)
from switchyard.bench.traces import NS_MOONCAKE, load_trace


@pytest.mark.parametrize("recent", [0, 40])
def test_follow_ups_extend_an_earlier_prompt(recent: int) -> None:
    spec = ConversationSpec(num_requests=3000, follow_frac=0.6, recent=recent, output_max=300)
    rows = list(conversation_rows(spec, seed=5))
    seen: set[int] = set()
    follows = 0
    for i, row in enumerate(rows):
        ids = row["hash_ids"]
        fresh = [h for h in ids if h not in seen]
        base = ids[: len(ids) - len(fresh)]
        assert ids[len(base):] == fresh  # the old blocks lead, the new ones follow
        if base:
            follows += 1
            window = rows[max(0, i - recent):i] if recent else rows[:i]
            assert any(r["hash_ids"] == base for r in window)  # a whole earlier prompt (within the window)
            assert TURN_BLOCKS[0] <= len(fresh) < TURN_BLOCKS[1]
        else:
            assert FIRST_BLOCKS[0] <= len(fresh) < FIRST_BLOCKS[1]
        seen.update(fresh)
        assert len(ids) * 16 - 16 < row["input_length"] <= len(ids) * 16
        assert 1 <= row["output_length"] < 300
        assert i == 0 or row["timestamp"] >= rows[i - 1]["timestamp"]
    assert 0.55 < follows / len(rows) < 0.65
    assert abs(len(rows) / rows[-1]["timestamp"] - 8.0) < 0.5  # Poisson at 8 req/s


def test_rows_are_deterministic_and_a_prefix_of_a_longer_trace() -> None:
    spec = ConversationSpec(num_requests=400, follow_frac=0.5)
    rows = list(conversation_rows(spec, seed=1))
    assert rows == list(conversation_rows(spec, seed=1))
    assert rows != list(conversation_rows(spec, seed=2))
    longer = ConversationSpec(num_requests=900, follow_frac=0.5)
    assert list(conversation_rows(longer, seed=1))[:400] == rows  # --max-requests slices the same trace
    with pytest.raises(ValueError):
        ConversationSpec(follow_frac=1.5)


def test_the_trace_is_the_bailian_file_it_would_be(tmp_path) -> None:  # type: ignore[no-untyped-def]
    spec = ConversationSpec(num_requests=200, follow_frac=0.7, recent=50, output_max=800)
    f = tmp_path / "conv_blksz_16.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in conversation_rows(spec, seed=4)))
    got = make_conversations(spec, seed=4)
    assert got.requests == load_trace(str(f)).requests and got.has_prefix_identity
    # every block is 16 tokens (the last cut short), and follow-ups carry an earlier prompt's blocks as their prefix
    reqs = got.requests
    assert all(seg[0] == NS_MOONCAKE and seg[2] == 16 for x in reqs for seg in x.segments[:-1])
    whole = {tuple(x.segments[:-1]) for x in reqs}  # every prompt's full blocks
    carried = [x for x in reqs if any(tuple(x.segments[:k]) in whole for k in range(1, len(x.segments) - 4))]
    assert len(carried) > 100


def test_sim_routes_conversations_to_their_history(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """`bench sim --trace conversations`: the flags reach the generator, and a prefix-aware policy finds more of
    the history the follow-ups bring back than round robin does."""
    p = sim.build_parser()
    args = p.parse_args(["--trace", "conversations", "--max-requests", "300", "--follow-frac", "0.8",
                         "--recent", "30", "--output-max", "40", "--seed", "2"])
    t = sim.load_workload(args)
    assert len(t.requests) == 300
    assert t.requests == make_conversations(
        ConversationSpec(num_requests=300, follow_frac=0.8, recent=30, output_max=40), seed=2).requests
    out = tmp_path / "o"
    assert sim.main(["--trace", "conversations", "--max-requests", "300", "--follow-frac", "0.8", "--recent", "30",
                     "--output-max", "40", "--workers", "4", "--policies", "round_robin,smg_cache_aware",
                     "--out", str(out), "--no-plots"]) == 0
    runs = {r["policy"]: r["metrics"] for r in json.loads((out / "results.json").read_text())["runs"]}
    hit = {k: m["prefix_cache_hit_ratio"] for k, m in runs.items()}
    assert hit["smg_cache_aware"] > hit["round_robin"] + 0.1, hit
