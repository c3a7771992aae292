"""Selects the LRU index and its eviction order: the Cython build when present, else the Python reference.

SWITCHYARD_NO_EXTENSIONS=1 forces the reference. `IMPLEMENTATION` says which one loaded. The contract is the
docstring of `lru_order_py`.
"""

from __future__ import annotations

import os

from switchyard.ext.lru_order_py import EvictionOrder, LruIndexCore, touch_holders

IMPLEMENTATION = "py"

if not os.environ.get("SWITCHYARD_NO_EXTENSIONS"):
    try:
        from switchyard.ext._lru_order_c import (  # type: ignore[no-redef]  # noqa: F811
            EvictionOrder,
            LruIndexCore,
            touch_holders,
        )

        IMPLEMENTATION = "c"
    except ImportError:  # pragma: no cover - exercised by test_c_extension_loaded
        pass

__all__ = ["IMPLEMENTATION", "EvictionOrder", "LruIndexCore", "touch_holders"]
