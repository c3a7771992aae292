"""Selects the block-hash implementation: the Cython build when present, else the Python reference.

SWITCHYARD_NO_EXTENSIONS=1 forces the reference. `IMPLEMENTATION` says which one loaded.
"""

from __future__ import annotations

import os

from switchyard.ext.blockhash_py import HASH_ALGOS, extra_keys, hash_fn, none_hash, to_event_hash

IMPLEMENTATION = "py"
from switchyard.ext.blockhash_py import block_digests, event_hashes  # noqa: E402

if not os.environ.get("SWITCHYARD_NO_EXTENSIONS"):
    try:
        from switchyard.ext._blockhash_c import block_digests, event_hashes  # type: ignore[no-redef]  # noqa: F811

        IMPLEMENTATION = "c"
    except ImportError:  # pragma: no cover - exercised by test_c_extension_loaded
        pass

__all__ = [
    "HASH_ALGOS", "IMPLEMENTATION", "block_digests", "event_hashes", "extra_keys", "hash_fn", "none_hash",
    "to_event_hash",
]
