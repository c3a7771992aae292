"""Selects the per-worker load anticipator and its iteration clock: the Cython build when present, else the
Python reference.

SWITCHYARD_NO_EXTENSIONS=1 forces the reference. `IMPLEMENTATION` says which one loaded. The contract is the
docstring of `anticipator_py`.
"""

from __future__ import annotations

import os

from switchyard.ext.anticipator_py import (
    MAX_CAPACITY,
    MAX_ITERATION,
    MAX_LEN,
    MAX_TOKENS,
    Anticipator,
    IterationClock,
    sync_known,
)

IMPLEMENTATION = "py"

if not os.environ.get("SWITCHYARD_NO_EXTENSIONS"):
    try:
        from switchyard.ext._anticipator_c import (  # type: ignore[no-redef]  # noqa: F811
            Anticipator,
            IterationClock,
            sync_known,
        )

        IMPLEMENTATION = "c"
    except ImportError:  # pragma: no cover - exercised by test_c_extension_loaded
        pass

__all__ = [
    "IMPLEMENTATION", "MAX_CAPACITY", "MAX_ITERATION", "MAX_LEN", "MAX_TOKENS", "Anticipator", "IterationClock",
    "sync_known",
]
