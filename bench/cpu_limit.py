"""A CPU limit on a process, as a container's (a Kubernetes pod's `limits.cpu`): the kernel's CFS quota, in a cgroup
of its own. Why: on this benchmark box the client and the workers share the router's cores, so the box saturates
before the router does; a router given less CPU than it needs is the case where its own event loop is the
bottleneck (`bench live --router-cpu-limit`). Needs root and a writable cgroup cpu controller (v2 or v1).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

PERIOD_US = 100_000  # the kernel's default CFS period
V2_ROOT = Path("/sys/fs/cgroup")
V1_CPU = Path("/sys/fs/cgroup/cpu")


def _controller() -> tuple[Path, str] | None:
    """(The directory to create cgroups in, "v2" | "v1"), or None where no cpu controller can be written."""
    control = V2_ROOT / "cgroup.subtree_control"
    if control.exists() and "cpu" in control.read_text().split():
        return V2_ROOT, "v2"
    if (V1_CPU / "cpu.cfs_quota_us").exists():
        return V1_CPU, "v1"
    return None


@contextlib.contextmanager
def cpu_limited(pid: int, cores: float, name: str) -> Iterator[None]:
    """Process `pid` (all its threads) may use `cores` CPUs' time per period while the block runs; then it goes back
    to the root cgroup and the cgroup is removed."""
    found = _controller()
    if found is None or not os.access(found[0], os.W_OK):
        raise SystemExit("a CPU limit needs root and a writable cgroup cpu controller (/sys/fs/cgroup)")
    root, version = found
    group = root / f"switchyard-bench-{name}-{os.getpid()}"
    group.mkdir()
    quota = max(1_000, int(cores * PERIOD_US))
    try:
        if version == "v2":
            (group / "cpu.max").write_text(f"{quota} {PERIOD_US}")
        else:
            (group / "cpu.cfs_period_us").write_text(str(PERIOD_US))
            (group / "cpu.cfs_quota_us").write_text(str(quota))
        (group / "cgroup.procs").write_text(str(pid))
        yield
    finally:
        for line in (group / "cgroup.procs").read_text().split():
            with contextlib.suppress(OSError):  # gone meanwhile
                (root / "cgroup.procs").write_text(line)
        group.rmdir()
