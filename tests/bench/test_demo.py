"""`switchyard demo` (`make run`): which policies it replays (the end-to-end run itself is `make run`)."""

from __future__ import annotations

import json

import pytest

from switchyard.bench import demo
from switchyard.router.policies.registry import DEFAULT_POLICY


def test_replays_a_baseline_first_and_the_routers_default_policy() -> None:
    args = demo.build_parser().parse_args([])
    policies = args.policies.split(",")
    assert policies[0] == "round_robin" and DEFAULT_POLICY in policies and "e2" in policies


def test_unknown_policy_names_fail_before_anything_starts() -> None:
    with pytest.raises(SystemExit, match=r"unknown policies \['nope'\]"):
        demo.main(["--policies", "e2,nope"])


def test_a_bad_trace_selection_fails_before_anything_starts(tmp_path) -> None:
    f = tmp_path / "b.csv"
    f.write_text("Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n0,ChatGPT,5,2,7,x\n")
    with pytest.raises(SystemExit, match=r"demo: .*no row has Model in \['GPT-4'\].*'ChatGPT'"):
        demo.main(["--trace", str(f), "--where", "Model=GPT-4"])
    with pytest.raises(SystemExit, match=r"demo: trace .*missing.csv' is neither a file nor a known name"):
        demo.main(["--trace", str(tmp_path / "missing.csv")])


def test_spread_ties_spreads_the_slice_s_bursts() -> None:
    # the default trace (Mooncake's conversation trace) steps its clock by 3 s: as written a step's requests arrive
    # together; with --spread-ties each at its own time within the step
    plain = demo.demo_trace(demo.build_parser().parse_args(["--duration", "30"]))
    spread = demo.demo_trace(demo.build_parser().parse_args(["--duration", "30", "--spread-ties"]))
    assert len({r.arrival_s for r in plain.requests}) <= 11 < len(plain.requests)
    assert len({r.arrival_s for r in spread.requests}) == len(spread.requests) == len(plain.requests)


def test_a_batch_job_s_trace_is_refused_with_the_way_to_replay_it(tmp_path) -> None:
    # ACDC's offline jobs have no timestamps (and some no output lengths): the demo replays a clock, bench sim paces
    f = tmp_path / "trace_d.jsonl"
    rows = ({"request_id": i, "input_length": 50, "output_length": 9} for i in range(3))
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(SystemExit, match=r"trace-d has no timestamps .*bench sim --trace PATH --rate R"):
        demo.main(["--trace", str(f)])
    g = tmp_path / "trace_a.jsonl"
    g.write_text("".join(json.dumps({"timestamp": i, "input_length": 50, "hash_ids": []}) + "\n" for i in range(3)))
    with pytest.raises(SystemExit, match=r"trace-a has no output lengths"):
        demo.main(["--trace", str(g)])
