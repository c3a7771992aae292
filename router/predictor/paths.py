"""Where trained predictors and the saved data split live: outside git, in one cache directory.

($SWITCHYARD_DATA_DIR is another thing: the shared trace and profile data the simulator reads.)
"""

from __future__ import annotations

import os
from pathlib import Path

DEFAULT_PREDICTOR = "sharegpt-student-int8"
# What `switchyard predictor train` exports (teacher and distilled student, fp32 and int8).
PREDICTOR_NAMES = ("sharegpt-teacher", "sharegpt-teacher-int8", "sharegpt-student", "sharegpt-student-int8")


def cache_dir() -> Path:
    """$SWITCHYARD_CACHE_DIR, else $XDG_CACHE_HOME/switchyard, else ~/.cache/switchyard."""
    explicit = os.environ.get("SWITCHYARD_CACHE_DIR")
    if explicit:
        return Path(explicit)
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "switchyard"


def predictors_dir() -> Path:
    return cache_dir() / "predictor"


def predictor_path(name: str = DEFAULT_PREDICTOR) -> Path:
    """A predictor directory by name (or an explicit path when `name` contains a path separator)."""
    if os.sep in name or name.startswith("."):
        return Path(name)
    return predictors_dir() / name
