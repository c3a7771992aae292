"""`switchyard demo` (`make run`): which policies it replays (the end-to-end run itself is `make run`)."""

from __future__ import annotations

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
