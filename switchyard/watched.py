"""Files a server keeps watching: what it loaded from them, loaded again once they change, so certificates and API
keys rotate without a restart.

Why one class: the TLS servers, the router's client certificate and the API keys all need the same three rules. A
change is seen by the files' stamps (mtime, size, inode: a rename over a file, as rotation tools write, changes the
inode), checked when the value is about to be used, not by a timer. Files that do not load (a rotation
half-written: a new certificate beside the old key) keep the previous value, with a warning logged once per state
of the files. The stamps are taken before a load, so a change during it is loaded again.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")
Stamps = tuple[tuple[int, int, int] | None, ...]

log = logging.getLogger(__name__)


def file_stamps(paths: tuple[str, ...]) -> Stamps:
    """Per file (mtime_ns, size, inode); None for one missing (gone for a moment, mid-rotation)."""
    out: list[tuple[int, int, int] | None] = []
    for path in paths:
        try:
            st = os.stat(path)
        except OSError:
            out.append(None)
        else:
            out.append((st.st_mtime_ns, st.st_size, st.st_ino))
    return tuple(out)


class Watched(Generic[T]):
    """`load()` of `files`, now (its error raised: a bad file stops startup) and again at each `refresh` that finds
    a file changed; `errors` are the exceptions that mean "these files do not load"."""

    def __init__(self, files: tuple[str, ...], load: Callable[[], T], what: str,
                 errors: tuple[type[Exception], ...]) -> None:
        self._files, self._load, self._what, self._errors = files, load, what, errors
        self._stamp = file_stamps(files)
        self.value: T = load()
        self.generation = 1  # counts the loads: what was built from an older value predates a rotation
        self._logged: Stamps | None = None

    def refresh(self) -> bool:
        """True when a file changed and `value` is now the new load."""
        stamp = file_stamps(self._files)
        if stamp == self._stamp:
            return False
        try:
            value = self._load()
        except self._errors as e:
            if stamp != self._logged:
                self._logged = stamp
                log.warning("%s changed but do not load (the previous ones stay): %s", self._what, e)
            return False
        self._stamp, self.value, self.generation = stamp, value, self.generation + 1
        log.info("%s reloaded", self._what)
        return True
