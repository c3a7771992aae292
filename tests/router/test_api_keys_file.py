"""API keys files (switchyard/auth.py): what a file may hold, and a rotated file read at the next call."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from switchyard.auth import ApiKeys, AuthError, read_keys

KEY_A = "a" * 24
KEY_B = "b" * 24


def write(path: Path, text: str) -> None:
    """As an operator's tool writes it: whole, then renamed over the old file."""
    tmp = path.with_suffix(".new")
    tmp.write_text(text)
    os.replace(tmp, path)


def bearer(key: str) -> list[tuple[str, str]]:
    return [("user-agent", "test"), ("authorization", f"Bearer {key}")]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "holds no key"),
        ("# only a comment\n\n", "holds no key"),
        ("short\n", r"key 1 of .* is not 16\+ printable ASCII"),
        (f"{KEY_A}\nwith a space in it here\n", "key 2 of"),
    ],
)
def test_a_bad_keys_file_is_refused(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "keys"
    path.write_text(text)
    with pytest.raises(AuthError, match=message):
        read_keys(str(path))


def test_a_missing_keys_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(AuthError, match="cannot read the API keys file .*missing"):
        ApiKeys(str(tmp_path / "missing"))


def test_keys_are_checked_and_reloaded_when_the_file_changes(tmp_path: Path, caplog) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "keys"
    write(path, f"# team a\n{KEY_A}\n")
    keys = ApiKeys(str(path))
    assert keys.allows(bearer(KEY_A))
    assert not keys.allows(bearer(KEY_B)) and not keys.allows(None) and not keys.allows([("authorization", KEY_A)])
    assert not keys.allows(bearer(KEY_A + "x")) and not keys.allows(bearer(KEY_A[:-1]))
    write(path, f"{KEY_A}\n{KEY_B}\n")  # a key added
    assert keys.allows(bearer(KEY_B)) and keys.allows(bearer(KEY_A))
    write(path, "")  # a broken edit keeps the previous keys, said once
    with caplog.at_level("WARNING", logger="switchyard.watched"):
        assert keys.allows(bearer(KEY_B)) and keys.allows(bearer(KEY_A))
    assert len([r for r in caplog.records if "do not load" in r.message]) == 1
    write(path, f"{KEY_B}\n")  # a key revoked
    assert keys.allows(bearer(KEY_B)) and not keys.allows(bearer(KEY_A))
