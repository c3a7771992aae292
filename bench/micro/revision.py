"""A routing policy as an earlier git revision wrote it, beside today's in one process (`NAME@REV`).

A change to a policy's hot path is measured against the code it replaces in the same run
(`switchyard bench decisions --policies e2@e81af29,e2 --paired`): this VM's timings drift by up to ±30% between
runs, and paired ratios repeat to the third digit. The revision's `router/policies/` package is copied from git
into a private package (its `switchyard.router.policies` imports renamed to it) and imported next to the
current one.

`ext/` too, when its sources at the revision differ from the working tree's (`git diff REV -- ext/`): its
Python modules are copied into a second private package, and each `.pyx` that differs is compiled there with
Cython (the `test` extra installs it; the build is cached per revision under `~/.cache/switchyard`), so a change
to a compiled structure is measured against the build it replaces. A `.pyx` the revision shares with the
working tree stays today's build (imported under its own name: both copies would be the same code). Everything
else the copies import is the current tree's.
"""

from __future__ import annotations

import atexit
import importlib
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from types import ModuleType
from typing import Any

import switchyard.router.policies as current

PACKAGE = "switchyard.router.policies"
_DIR = "router/policies"
EXT_PACKAGE = "switchyard.ext"
_EXT_DIR = "ext"
COMPILE_ARGS = ["-O3", "-ffp-contract=off"]  # setup.py's
_root: Path | None = None  # the folder on sys.path that holds the copied packages (one per process)


def _git(repo: Path, *args: str) -> str:
    try:
        done = subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True)
    except FileNotFoundError as e:
        raise ValueError("NAME@REV needs git on PATH") from e
    except subprocess.CalledProcessError as e:
        raise ValueError(f"git {' '.join(args)}: {e.stderr.strip() or e}") from e
    return done.stdout


def _copy(repo: Path, sha: str, src_dir: str, dest: Path, renames: Callable[[str], str], suffixes: tuple[str, ...]
          ) -> None:
    """Write the files of `src_dir` at `sha` with these suffixes under `dest` (created whole or not at all),
    imports renamed by `renames`."""
    if not dest.exists():
        files = [f for f in _git(repo, "ls-tree", "-r", "--name-only", sha, "--", src_dir).split()
                 if f.endswith(suffixes)]
        tmp = dest.parent / f".{dest.name}.part"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        for f in files:
            target = tmp / Path(f).relative_to(src_dir)
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(renames(_git(repo, "show", f"{sha}:{f}")))
        tmp.rename(dest)


def _ext_at(repo: Path, sha: str) -> Callable[[str], str]:
    """The rename of `switchyard.ext` imports for code of revision `sha`: identity when ext/'s sources there are
    the working tree's, else to a private copy of that ext/ with its changed `.pyx` compiled."""
    changed = {Path(f).name for f in _git(repo, "diff", "--name-only", sha, "--", _EXT_DIR).split()
               if f.endswith((".py", ".pyx", ".pxd", ".pxi"))}  # (not its README)
    if not changed:
        return lambda text: text
    name = f"_switchyard_ext_{sha[:12]}"
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "switchyard" / "revisions"
    root = cache / f"{sha}-{sysconfig.get_config_var('SOABI')}"
    pyx = {Path(f).stem for f in _git(repo, "ls-tree", "--name-only", sha, f"{_EXT_DIR}/").split() if f.endswith(".pyx")}
    # compiled modules the working tree has too: the same .pyx, including no .pxi that differs
    pxi = {f for f in changed if f.endswith(".pxi")}
    shared = {m for m in pyx if f"{m}.pyx" not in changed and not (pxi and pxi & _includes(repo, sha, m))}

    def rename(text: str) -> str:
        def one(m: re.Match[str]) -> str:
            mod = m.group(1)
            return m.group(0) if mod in shared else f"{name}{m.group(0)[len(EXT_PACKAGE):]}"

        return re.sub(rf"\b{re.escape(EXT_PACKAGE)}(?:\.(\w+))?\b", one, text)

    dest = root / name
    done = root / f".{name}.built"
    if not done.exists():
        shutil.rmtree(dest, ignore_errors=True)
        _copy(repo, sha, _EXT_DIR, dest, rename, (".py", ".pyx", ".pxd", ".pxi"))
        _compile(dest, name, sorted(pyx - shared))
        done.touch()
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    return rename


def _includes(repo: Path, sha: str, module: str) -> set[str]:
    """The files `module`.pyx `include`s at revision `sha`."""
    return set(re.findall(r'^include\s+"([^"]+)"', _git(repo, "show", f"{sha}:{_EXT_DIR}/{module}.pyx"), re.M))


def _compile(pkg_dir: Path, pkg: str, modules: list[str]) -> None:
    """Build `pkg.<module>` in place from `pkg_dir/<module>.pyx` for each module, as setup.py builds ext/."""
    if not modules:
        return
    try:
        from Cython.Build import cythonize
        from setuptools import Distribution, Extension
    except ImportError as e:
        raise ValueError(f"NAME@REV needs Cython to build that revision's ext/ ({', '.join(modules)}): "
                         f"pip install cython ({e})") from e
    exts = cythonize(
        [Extension(f"{pkg}.{m}", [str(pkg_dir / f"{m}.pyx")], extra_compile_args=COMPILE_ARGS) for m in modules],
        compiler_directives={"language_level": "3", "boundscheck": False, "wraparound": False}, quiet=True,
    )
    cmd = Distribution({"ext_modules": exts, "script_name": "setup.py"}).get_command_obj("build_ext")
    cmd.build_lib = str(pkg_dir.parent)  # type: ignore[attr-defined]
    cmd.build_temp = str(pkg_dir / "build")  # type: ignore[attr-defined]
    cmd.ensure_finalized()
    cmd.run()


def _checkout_and_sha(rev: str) -> tuple[Path, str]:
    repo = Path(current.__file__).resolve().parents[2]  # router/policies/__init__.py -> the checkout
    return repo, _git(repo, "rev-parse", "--verify", f"{rev}^{{commit}}").strip()


def ext_module_at(module: str, rev: str) -> ModuleType:
    """`switchyard.ext.<module>` as git revision `rev` built it (today's own when ext/ has not changed since)."""
    repo, sha = _checkout_and_sha(rev)
    return importlib.import_module(_ext_at(repo, sha)(f"{EXT_PACKAGE}.{module}"))


def package_at(rev: str) -> str:
    """The importable name of `router/policies/` at `rev` (copied once per process and revision; its `ext/` as
    `_ext_at` provides it)."""
    global _root
    repo, sha = _checkout_and_sha(rev)
    name = f"_switchyard_policies_{sha[:12]}"
    if _root is None:
        _root = Path(tempfile.mkdtemp(prefix="switchyard-rev-"))
        atexit.register(shutil.rmtree, _root, ignore_errors=True)
        sys.path.insert(0, str(_root))
    dest = _root / name
    if not dest.exists():
        if f"{_DIR}/__init__.py" not in _git(repo, "ls-tree", "-r", "--name-only", sha, "--", _DIR).split():
            raise ValueError(f"{rev} has no {_DIR} package")
        ext = _ext_at(repo, sha)
        _copy(repo, sha, _DIR, dest, lambda text: ext(re.sub(rf"\b{re.escape(PACKAGE)}\b", name, text)), (".py",))
    return name


def policy_at(name: str, rev: str, params: Mapping[str, Any] | None = None) -> Any:
    """Registry policy `name` built by `router/policies/` as it was at git revision `rev`, its config's fields
    overridden by `params` (that revision's `make_policy`)."""
    try:
        registry = importlib.import_module(f"{package_at(rev)}.registry")
    except ImportError as e:  # e.g. a name that revision imports from outside router/policies and ext/
        raise ValueError(
            f"router/policies at {rev!r} does not import beside today's tree (router/policies and ext/ are that "
            f"revision's, the rest today's): {e}"
        ) from e
    return registry.make_policy(name, params) if params else registry.make_policy(name)
