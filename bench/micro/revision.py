"""A routing policy as an earlier git revision wrote it, beside today's in one process (`NAME@REV`).

A change to a policy's hot path is measured against the code it replaces in the same run
(`switchyard bench decisions --policies e2@e81af29,e2 --paired`): this VM's timings drift by up to ±30% between
runs, and paired ratios repeat to the third digit. The revision's `router/policies/` package is copied from git
into a private package (its `switchyard.router.policies` imports renamed to it) and imported next to the
current one. Everything it imports from outside that package, the compiled `ext/` structures included, is the
current tree's: the pair differs only in the policy modules.
"""

from __future__ import annotations

import atexit
import importlib
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import switchyard.router.policies as current

PACKAGE = "switchyard.router.policies"
_DIR = "router/policies"
_root: Path | None = None  # the folder on sys.path that holds the copied packages (one per process)


def _git(repo: Path, *args: str) -> str:
    try:
        done = subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True)
    except FileNotFoundError as e:
        raise ValueError("NAME@REV needs git on PATH") from e
    except subprocess.CalledProcessError as e:
        raise ValueError(f"git {' '.join(args)}: {e.stderr.strip() or e}") from e
    return done.stdout


def package_at(rev: str) -> str:
    """The importable name of `router/policies/` at `rev` (copied once per process and revision)."""
    global _root
    repo = Path(current.__file__).resolve().parents[2]  # router/policies/__init__.py -> the checkout
    sha = _git(repo, "rev-parse", "--verify", f"{rev}^{{commit}}").strip()
    name = f"_switchyard_policies_{sha[:12]}"
    if _root is None:
        _root = Path(tempfile.mkdtemp(prefix="switchyard-rev-"))
        atexit.register(shutil.rmtree, _root, ignore_errors=True)
        sys.path.insert(0, str(_root))
    dest = _root / name
    if not dest.exists():
        files = _git(repo, "ls-tree", "-r", "--name-only", sha, "--", _DIR).split()
        if not any(f.endswith("/__init__.py") for f in files):
            raise ValueError(f"{rev} has no {_DIR} package")
        tmp = _root / f".{name}.part"
        tmp.mkdir()
        for f in files:
            if not f.endswith(".py"):
                continue
            text = _git(repo, "show", f"{sha}:{f}")
            target = tmp / Path(f).relative_to(_DIR)
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(re.sub(rf"\b{re.escape(PACKAGE)}\b", name, text))
        tmp.rename(dest)
    return name


def policy_at(name: str, rev: str) -> Any:
    """Registry policy `name` built by `router/policies/` as it was at git revision `rev`."""
    try:
        registry = importlib.import_module(f"{package_at(rev)}.registry")
    except ImportError as e:  # e.g. a name that revision imports from `ext/`, which today's no longer has
        raise ValueError(
            f"router/policies at {rev!r} does not import beside today's tree (only router/policies is copied; "
            f"ext/ and the rest are today's): {e}"
        ) from e
    return registry.make_policy(name)
