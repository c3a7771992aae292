"""Selects E2's per-select loops and the default policy's bound pass, fill level and per-worker terms: the Cython
build when present, else the Python reference.

SWITCHYARD_NO_EXTENSIONS=1 forces the reference. `IMPLEMENTATION` says which one loaded. The contract is the
docstring of `e2_select_py`.
"""

from __future__ import annotations

import os

from switchyard.ext.e2_select_py import (
    ArgminEnv,
    BoundsEnv,
    HeadTerms,
    Outstanding,
    Priced,
    SelectEnv,
    argmin_bounds,
    argmin_order,
    cheapest,
    co_residency,
    decode,
    decode_marginal,
    exploit_set,
    fill_level,
    head_terms,
    m_is_zero,
    prefill,
    raw_bounds,
    select_e2,
    water_level,
)

IMPLEMENTATION = "py"

if not os.environ.get("SWITCHYARD_NO_EXTENSIONS"):
    try:
        from switchyard.ext._e2_select_c import (  # type: ignore[no-redef]  # noqa: F811
            ArgminEnv,
            BoundsEnv,
            Outstanding,
            SelectEnv,
            argmin_bounds,
            argmin_order,
            cheapest,
            co_residency,
            decode,
            decode_marginal,
            exploit_set,
            fill_level,
            head_terms,
            m_is_zero,
            prefill,
            raw_bounds,
            select_e2,
            water_level,
        )

        IMPLEMENTATION = "c"
    except ImportError:  # pragma: no cover - exercised by test_c_extension_loaded
        pass

__all__ = [
    "IMPLEMENTATION", "ArgminEnv", "BoundsEnv", "HeadTerms", "Outstanding", "Priced", "SelectEnv", "argmin_bounds",
    "argmin_order", "cheapest", "co_residency", "decode", "decode_marginal", "exploit_set", "fill_level", "head_terms",
    "m_is_zero", "prefill", "raw_bounds", "select_e2", "water_level",
]
