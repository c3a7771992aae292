"""Selects E2's per-node samples (`Samples`, `RecentMedian`, `NodeStats`): the Cython build when present, else the
Python reference.

SWITCHYARD_NO_EXTENSIONS=1 forces the reference. `IMPLEMENTATION` says which one loaded. The contract is the
docstring of `samples_py`.
"""

from __future__ import annotations

import os

from switchyard.ext.samples_py import NodeStats, RecentMedian, Samples

IMPLEMENTATION = "py"

if not os.environ.get("SWITCHYARD_NO_EXTENSIONS"):
    try:
        from switchyard.ext._samples_c import (  # type: ignore[no-redef]  # noqa: F811
            NodeStats,
            RecentMedian,
            Samples,
        )

        IMPLEMENTATION = "c"
    except ImportError:  # pragma: no cover - exercised by test_c_extension_loaded
        pass

__all__ = ["IMPLEMENTATION", "NodeStats", "RecentMedian", "Samples"]
