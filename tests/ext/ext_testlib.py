"""Shared by the ext/ tests: every hot path is tested as the Python reference and as the Cython twin."""

from __future__ import annotations

import os
from types import ModuleType

import pytest

NO_EXTENSIONS = bool(os.environ.get("SWITCHYARD_NO_EXTENSIONS"))


def impl_params(c_module: ModuleType | None) -> list:  # type: ignore[type-arg]
    """Fixture params "py" and "c" (marked c_extension; skipped when the extension did not build)."""
    return [
        pytest.param("py"),
        pytest.param(
            "c",
            marks=[
                pytest.mark.c_extension,
                pytest.mark.skipif(c_module is None, reason="Cython extension not built"),
            ],
        ),
    ]
