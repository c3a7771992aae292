"""`NAME@REV` in `bench decisions`: a policy as an earlier git revision wrote it, imported beside today's."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import switchyard.router.policies as current
from switchyard.bench.micro import decisions
from switchyard.bench.micro.revision import package_at, policy_at
from switchyard.router.policies.preble_e2 import PrebleE2

REPO = Path(current.__file__).resolve().parents[2]


def test_a_revision_s_policy_is_its_own_copy_of_that_revision_s_modules() -> None:
    p = policy_at("e2", "HEAD")
    pkg = package_at("HEAD")
    assert type(p).__name__ == "PrebleE2" and type(p) is not PrebleE2  # not today's class
    assert type(p).__module__ == f"{pkg}.preble_e2"
    # a module that imports nothing from ext/ (whose imports are renamed too when ext/ differs from HEAD's)
    head = subprocess.run(["git", "-C", str(REPO), "show", "HEAD:router/policies/round_robin.py"],
                          check=True, capture_output=True, text=True).stdout
    copied = (Path(sys.modules[f"{pkg}.preble_e2"].__file__ or "").parent / "round_robin.py").read_text()
    assert copied == head.replace("switchyard.router.policies", pkg)  # that revision's text, imports renamed
    assert "switchyard.router.policies" in head  # so the rename was exercised
    assert policy_at("e2", "HEAD") is not p  # a fresh policy per call, from the one copy
    assert package_at("HEAD") == pkg


def test_decisions_runs_a_revision_beside_today_s_policy(tmp_path: Path) -> None:
    rc = decisions.main(["--num-requests", "30", "--workloads", "toolbench-200", "--workers", "4", "--paired",
                         "--policies", "e2@HEAD,e2", "--out", str(tmp_path), "--no-plot"])
    assert rc == 0
    rows = json.loads((tmp_path / "decisions.json").read_text())["rows"]
    assert [(r["policy"], r["paired_with"]) for r in rows] == [("e2@HEAD", "e2@HEAD"), ("e2", "e2@HEAD")]


def test_an_unknown_revision_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="no-such-revision"):
        policy_at("e2", "no-such-revision")


@pytest.mark.c_extension
@pytest.mark.skip_in_ci_ok  # skipping is right when the opt-out is set on purpose
@pytest.mark.skipif(bool(os.environ.get("SWITCHYARD_NO_EXTENSIONS")),
                    reason="SWITCHYARD_NO_EXTENSIONS is set: a revision's selectors load its Python references")
def test_a_revision_with_another_ext_gets_that_revision_s_build(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    # 6c2da1b's E2 imports `ordered_bounds` from ext/e2_select, which the next commit folded into `cheapest`:
    # its ext/ is copied, the .pyx that differ from the working tree's compiled, the others stay today's build
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # a cold cache: the build runs here

    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(REPO), *args], check=True, capture_output=True, text=True).stdout

    sha = git("rev-parse", "6c2da1b").strip()
    changed = {Path(f).stem for f in git("diff", "--name-only", sha, "--", "ext/").split() if f.endswith(".pyx")}
    p = policy_at("e2", "6c2da1b")
    ext = f"_switchyard_ext_{sha[:12]}"
    kernel = sys.modules[f"{ext}._e2_select_c"]
    assert Path(kernel.__file__ or "").is_relative_to(tmp_path) and hasattr(kernel, "ordered_bounds")
    assert sys.modules[f"{ext}.e2_select"].IMPLEMENTATION == "c"
    for selector, cls, pyx in (("radix", "RadixTree", "_radix_c"), ("anticipator", "Anticipator", "_anticipator_c")):
        theirs = getattr(sys.modules[f"{ext}.{selector}"], cls)
        assert (theirs is getattr(importlib.import_module(f"switchyard.ext.{selector}"), cls)) == (pyx not in changed)
        if pyx in changed:
            assert Path(sys.modules[f"{ext}.{pyx}"].__file__ or "").is_relative_to(tmp_path)
    assert type(p.tree) is sys.modules[f"{ext}.radix"].RadixTree
    rc = decisions.main(["--num-requests", "30", "--workloads", "toolbench-200", "--workers", "4", "--paired",
                         "--policies", "e2@6c2da1b,e2", "--out", str(tmp_path / "out"), "--no-plot"])
    assert rc == 0
