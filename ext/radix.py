"""Selects the global prefix radix tree: the Cython build when present, else the Python reference.

SWITCHYARD_NO_EXTENSIONS=1 forces the reference. `IMPLEMENTATION` says which one loaded. The contract is the
docstring of `radix_py`.
"""

from __future__ import annotations

import os

from switchyard.ext.radix_py import MAX_WORKERS, BlockSet, MatchResult, Node, RadixTree, key_node

IMPLEMENTATION = "py"

if not os.environ.get("SWITCHYARD_NO_EXTENSIONS"):
    try:
        from switchyard.ext._radix_c import (  # type: ignore[no-redef]  # noqa: F811
            MAX_WORKERS,
            BlockSet,
            MatchResult,
            Node,
            RadixTree,
            key_node,
        )

        IMPLEMENTATION = "c"
    except ImportError:  # pragma: no cover - exercised by test_c_extension_loaded
        pass

__all__ = ["IMPLEMENTATION", "MAX_WORKERS", "BlockSet", "MatchResult", "Node", "RadixTree", "key_node"]
