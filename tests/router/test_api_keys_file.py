"""API keys files (switchyard/auth.py): what a file may hold, a rotated file read at the next call, the keys' limits
and their isolated cache salts."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

from switchyard import keys_cli
from switchyard.auth import ApiKeys, AuthError, KeyLimits, KeySpec, cache_salt_for, read_keys

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
        (f"{KEY_A} rate=1 colour=blue\n", "'colour=blue' is not one of"),
        (f"{KEY_A} rate=1 rate=2\n", "'rate=2' is not one of .*each once"),
        (f"{KEY_A} name=has/slash\n", "name 'has/slash' is not"),
        (f"{KEY_A} max_in_flight=-1\n", "must be >= 0"),
        (f"{KEY_A} rate=nan\n", "must be >= 0"),
        (f"{KEY_A} tokens_per_min=-5\n", "tokens_per_min must be >= 0"),
        (f"{KEY_A} tokens_per_min=1.5\n", "invalid literal"),
        (f"{KEY_A} rate=fast\n", "could not convert"),
        (f"{KEY_A} burst=4\n", "burst= needs rate="),
        (f"{KEY_A} isolate=yes\n", "isolate must be true or false"),
        (f"{KEY_A} name=t\n{KEY_B} name=t\n", "key 2 of .* repeats a key or the name 't'"),
        (f"{KEY_A}\n{KEY_A}\n", "key 2 of .* repeats"),
        ("name=team-a\n", r"key 1 of .* is not 16\+ printable"),  # fields without the key
        ("max_in_flight=100000000 rate=1\n", "key 1 of .* starts with a field, not a key"),
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
    assert keys.find(bearer(KEY_A))
    assert not keys.find(bearer(KEY_B)) and not keys.find(None) and not keys.find([("authorization", KEY_A)])
    assert not keys.find(bearer(KEY_A + "x")) and not keys.find(bearer(KEY_A[:-1]))
    write(path, f"{KEY_A}\n{KEY_B}\n")  # a key added
    assert keys.find(bearer(KEY_B)) and keys.find(bearer(KEY_A))
    write(path, "")  # a broken edit keeps the previous keys, said once
    with caplog.at_level("WARNING", logger="switchyard.watched"):
        assert keys.find(bearer(KEY_B)) and keys.find(bearer(KEY_A))
    assert len([r for r in caplog.records if "do not load" in r.message]) == 1
    write(path, f"{KEY_B}\n")  # a key revoked
    assert keys.find(bearer(KEY_B)) and not keys.find(bearer(KEY_A))


def test_a_line_names_and_limits_its_key(tmp_path: Path) -> None:
    path = tmp_path / "keys"
    path.write_text(f"{KEY_A} name=team-a max_in_flight=8 rate=2.5 tokens_per_min=9000 isolate=true\n{KEY_B}\n")
    keys = ApiKeys(str(path))
    assert keys.find(bearer(KEY_A)) == KeySpec("team-a", max_in_flight=8, rate=2.5, burst=3, isolate=True,
                                               tokens_per_min=9000)
    b = keys.find(bearer(KEY_B))
    assert b == KeySpec(f"sha256:{hashlib.sha256(KEY_B.encode()).hexdigest()[:8]}")
    b64 = "c2VjcmV0LWtleS1vZi10ZWFtLWM="  # a base64 key keeps its '=' padding
    write(path, f"{b64} name=team-c\n")
    assert keys.find(bearer(b64)) == KeySpec("team-c")
    assert KEY_B not in b.name


class FakeClock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_max_in_flight_counts_calls_until_they_end() -> None:
    limits, key = KeyLimits(FakeClock()), KeySpec("t", max_in_flight=2)
    assert limits.acquire(key) is None and limits.acquire(key) is None
    refusal = limits.acquire(key)
    assert refusal is not None and refusal.limit == "max_in_flight" and refusal.retry_after_ms is None
    assert refusal.message == "max_in_flight: API key 't' has 2 calls in flight, its limit"
    limits.release(key)
    assert limits.in_flight("t") == 1 and limits.acquire(key) is None
    other = KeySpec("u", max_in_flight=1)  # keys are counted apart
    assert limits.acquire(other) is None and limits.acquire(other) is not None


def test_rate_is_a_token_bucket_refilled_by_the_clock() -> None:
    clock = FakeClock()
    limits, key = KeyLimits(clock), KeySpec("t", rate=2.0, burst=3)
    assert [limits.acquire(key) for _ in range(3)] == [None, None, None]  # the burst
    refusal = limits.acquire(key)
    assert refusal is not None and refusal.limit == "rate" and refusal.retry_after_ms == 500
    assert refusal.message.startswith("rate: API key 't' is over 2 calls/s (burst 3)")
    clock.t += 0.25  # half a token: still refused, and the refusal spent nothing
    refusal = limits.acquire(key)
    assert refusal is not None and refusal.retry_after_ms == 250 and refusal.message.endswith("retry in 0.250 s")
    clock.t += 0.25
    assert limits.acquire(key) is None and limits.acquire(key) is not None
    clock.t += 60  # a long pause refills the burst, no more
    assert [limits.acquire(key) is None for _ in range(4)] == [True, True, True, False]
    assert limits.in_flight("t") == 7  # every admitted call holds its slot until released


def test_tokens_per_min_reserves_refunds_and_refills() -> None:
    clock = FakeClock()
    limits, key = KeyLimits(clock), KeySpec("t", tokens_per_min=600)  # 10 tokens a second
    assert limits.tokens_left(KeySpec("u")) == float("inf")  # no limit, no bucket
    assert limits.reserve_tokens(key, 500) is None and limits.tokens_left(key) == 100
    refusal = limits.reserve_tokens(key, 150)
    assert refusal is not None and refusal.limit == "tokens_per_min" and refusal.retry_after_ms == 5000
    assert refusal.message == "tokens_per_min: API key 't' is over 600 tokens/min (150 asked, 100 left); retry in 5.000 s"
    limits.refund_tokens(key, 400)  # the request's output stopped 400 short of its max_tokens
    assert limits.tokens_left(key) == 500 and limits.reserve_tokens(key, 150) is None
    clock.t += 2.0
    assert limits.tokens_left(key) == 370  # refilled at 10 a second
    limits.refund_tokens(key, 10_000)
    clock.t += 600
    assert limits.tokens_left(key) == 600  # never more than a minute's worth
    big = limits.reserve_tokens(key, 601)
    assert big is not None and big.retry_after_ms is None and "lower max_tokens" in big.message
    assert limits.tokens_left(key) == 600  # a refusal takes nothing
    assert limits.reserve_tokens(KeySpec("u"), 10**9) is None
    assert limits.in_flight("t") == 0  # tokens and call slots are counted apart


def test_a_refused_call_holds_no_slot() -> None:
    limits, key = KeyLimits(FakeClock()), KeySpec("t", max_in_flight=5, rate=1.0, burst=1)
    assert limits.acquire(key) is None and limits.acquire(key) is not None
    assert limits.in_flight("t") == 1


def test_an_isolated_key_salts_its_requests_apart() -> None:
    iso = KeySpec("team-a", isolate=True)
    assert cache_salt_for("", iso) == "tenant:team-a:" and cache_salt_for("s", iso) == "tenant:team-a:s"
    assert cache_salt_for("s", KeySpec("team-b")) == "s" and cache_salt_for("s", None) == "s"
    # nobody else can name an isolated key's salt, so nobody else shares its cache
    with pytest.raises(ValueError, match="may not start with 'tenant:'"):
        cache_salt_for("tenant:team-a:", None)
    with pytest.raises(ValueError, match="may not start with 'tenant:'"):
        cache_salt_for("tenant:team-a:", KeySpec("team-b"))


def test_keys_new_makes_a_line_the_router_reads(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "keys"
    lines = []
    for argv in (["new", "--name", "team-a", "--max-in-flight", "4", "--rate", "2.5", "--tokens-per-min", "500",
                  "--isolate"], ["new"]):
        assert keys_cli.main(argv) == 0
        lines.append(capsys.readouterr().out.strip())
    assert lines[0] != lines[1] and all(len(line.split()[0]) == 2 * keys_cli.KEY_BYTES for line in lines)
    path.write_text("\n".join(lines) + "\n")
    keys = ApiKeys(str(path))
    assert keys.find(bearer(lines[0].split()[0])) == KeySpec("team-a", 4, 2.5, 3, True, 500)
    assert keys.find(bearer(lines[1].split()[0])) is not None
    assert keys_cli.main(["new", "--burst", "3"]) == 2  # a line the router would refuse is not printed
    out = capsys.readouterr()
    assert out.out == "" and "burst= needs rate=" in out.err


def test_keys_check_says_what_each_key_may_do_or_what_is_wrong(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "keys"
    path.write_text(f"{KEY_A} name=team-a max_in_flight=4 rate=2 tokens_per_min=900 isolate=true\n{KEY_B}\n")
    assert keys_cli.main(["check", str(path)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].endswith(": 2 keys")
    assert out[1].strip() == "team-a: max_in_flight=4, rate=2/s burst=2, tokens_per_min=900, isolated cache"
    assert out[2].strip().startswith("sha256:") and out[2].endswith(": no limits")
    path.write_text(f"{KEY_A} rate=fast\n")
    assert keys_cli.main(["check", str(path)]) == 2
    assert "key 1 of" in capsys.readouterr().err


def test_other_replicas_calls_count_toward_a_keys_limits() -> None:
    """Another router replica's requests of the key (heard from the workers) take its slots and bucket tokens here
    too, past empty if this replica spent the same token meanwhile, and give back their unused tokens at the end."""
    clock = FakeClock()
    limits = KeyLimits(clock)
    key = KeySpec("t", max_in_flight=2, rate=1.0, burst=2, tokens_per_min=600)
    assert limits.acquire(key) is None  # own call: 1 in flight, 1 call token left
    limits.note_peer_call(key, 500)  # a peer's: 2 in flight, 0 call tokens, 100 model tokens left
    refusal = limits.acquire(key)
    assert refusal is not None and refusal.limit == "max_in_flight" and "1 through other router replicas" in refusal.message
    assert limits.peer_in_flight("t") == 1 and limits.tokens_left(key) == 100
    limits.note_peer_call(key, 500)  # the two replicas raced for the same tokens: both buckets go below empty
    assert limits.tokens_left(key) == -400
    limits.note_peer_end(key, 0)  # one of them ended having used all it reserved
    limits.release(key)
    refusal = limits.acquire(key)
    assert refusal is not None and refusal.limit == "rate" and refusal.retry_after_ms == 2000  # 1 s to 0, 1 s to 1
    assert limits.reserve_tokens(key, 100) is not None  # paid back at 10 tokens/s first
    limits.note_peer_end(key, 450)  # the other used 50 of its 500: the rest comes back
    assert limits.peer_in_flight("t") == 0 and limits.tokens_left(key) == 50
    clock.t += 2.0
    assert limits.acquire(key) is None and limits.reserve_tokens(key, 70) is None
    for _ in range(5):  # a flood from other replicas owes at most one bucket's worth
        limits.note_peer_call(key, 0)
    assert limits.peer_in_flight("t") == 5
    limits.note_peer_call(key, 0, charge=False)  # re-announced after a snapshot: counted, not charged again
    assert limits.peer_in_flight("t") == 6
    refusal = limits.acquire(key)
    assert refusal is not None and refusal.limit == "max_in_flight"
    for _ in range(6):
        limits.note_peer_end(key, 0)
    refusal = limits.acquire(key)  # the bucket stopped at minus its size (2): 3 s to one call, not 6
    assert refusal is not None and refusal.limit == "rate" and refusal.retry_after_ms == 3000
