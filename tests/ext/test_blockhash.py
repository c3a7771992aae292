"""The block hash: the Cython build and the Python reference give vLLM's digests, identically."""

from __future__ import annotations

import hashlib
import pickle

import pytest
from ext_testlib import NO_EXTENSIONS, impl_params
from hypothesis import given, settings
from hypothesis import strategies as st

from switchyard.ext import blockhash, blockhash_py

try:
    from switchyard.ext import _blockhash_c
except ImportError:  # pragma: no cover - test_c_extension_loaded reports it
    _blockhash_c = None



@pytest.fixture(params=impl_params(_blockhash_c))
def impl(request: pytest.FixtureRequest):  # type: ignore[no-untyped-def]
    return blockhash_py.block_digests if request.param == "py" else _blockhash_c.block_digests


@pytest.mark.skip_in_ci_ok  # skipping is right when the opt-out is set on purpose
def test_c_extension_loaded() -> None:
    if NO_EXTENSIONS:
        pytest.skip("SWITCHYARD_NO_EXTENSIONS is set")
    assert _blockhash_c is not None, "switchyard.ext._blockhash_c did not build or import"
    assert blockhash.IMPLEMENTATION == "c"
    assert blockhash.block_digests is _blockhash_c.block_digests
    assert blockhash.event_hashes is _blockhash_c.event_hashes


# vLLM's sha256 chain, written out literally from the spec (shared/specs/vllm-and-peer-routers.md, "Block hash"):
#   NONE = sha256(pickle.dumps("vllm-none-hash", protocol=5)).digest()
#   h_0  = sha256(pickle.dumps((NONE, tuple(tokens[0:16]), None), protocol=5)).digest()
# The hex values are pinned so a change in either the formula or the pickler is caught.
NONE_HASH_SHA256 = "066b1e8987e027138e98701c46128929378935f9b6cd1549105ae6b4f0d71198"
BLOCK0_SHA256 = "fe8fa5dda3210d0ca2031e37cbe3b001186773cd1c710beb2d45fcb51d434798"  # tokens 0..15


def test_known_vllm_sha256_chain(impl) -> None:  # type: ignore[no-untyped-def]
    none = hashlib.sha256(pickle.dumps("vllm-none-hash", protocol=pickle.HIGHEST_PROTOCOL)).digest()
    assert none.hex() == NONE_HASH_SHA256
    assert blockhash_py.none_hash("sha256") == none
    tokens = list(range(40))  # 2 full blocks of 16 + 8 leftover tokens (not hashed)
    h0 = hashlib.sha256(pickle.dumps((none, tuple(range(16)), None), protocol=5)).digest()
    h1 = hashlib.sha256(pickle.dumps((h0, tuple(range(16, 32)), None), protocol=5)).digest()
    assert h0.hex() == BLOCK0_SHA256
    assert impl(tokens, 16, "sha256") == [h0, h1]
    # the event id is the low 64 bits of the full digest
    assert blockhash_py.to_event_hash(h0) == int(BLOCK0_SHA256[-16:], 16) == 3262291359910021016


def test_extra_keys_lora_every_block_salt_first_only(impl) -> None:  # type: ignore[no-untyped-def]
    tokens = list(range(100, 132))
    none = blockhash_py.none_hash("xxhash")
    h0 = blockhash_py.hash_fn("xxhash")((none, tuple(tokens[:16]), ("lora-a", "tenant-1")))
    h1 = blockhash_py.hash_fn("xxhash")((h0, tuple(tokens[16:]), ("lora-a",)))
    assert impl(tokens, 16, "xxhash", lora_name="lora-a", cache_salt="tenant-1") == [h0, h1]
    # resuming the chain at block 1 with parent h0 gives h1 (no salt there)
    resumed = impl(tokens[16:], 16, "xxhash", parent=h0, start_block=1, lora_name="lora-a", cache_salt="t")
    assert resumed == [h1]


def test_seed_changes_the_chain(impl) -> None:  # type: ignore[no-untyped-def]
    tokens = list(range(16))
    assert impl(tokens, 16, "sha256", seed="other") != impl(tokens, 16, "sha256")
    expected = blockhash_py.block_digests(tokens, 16, "sha256", seed="other")
    assert impl(tokens, 16, "sha256", seed="other") == expected


@pytest.mark.parametrize(
    "tokens",
    [
        [0, 255, 256, 65535, 65536, 2**31 - 1],  # BININT1 / BININT2 / BININT boundaries
        [2**31, 2**32, 2**39, 2**63 - 1],  # LONG1
        [-1, -(2**31), -(2**31) - 1, -(2**63)],  # negatives: BININT then LONG1
        [2**64, -(2**64) - 5, 7, 8],  # beyond int64: reference fallback for this block
        [True, 1, 2, 3],  # bool pickles as NEWTRUE: reference fallback
    ],
)
def test_unusual_ints_match_reference(impl, tokens: list[int]) -> None:  # type: ignore[no-untyped-def]
    for algo in blockhash_py.HASH_ALGOS:
        expected = blockhash_py.block_digests(tokens * 2, len(tokens), algo)
        assert impl(tokens * 2, len(tokens), algo) == expected


@pytest.mark.parametrize(
    ("kwargs", "tokens"),
    [
        ({"lora_name": "x" * 300}, list(range(8))),  # too long for SHORT_BINUNICODE
        ({"lora_name": "same", "cache_salt": "same"}, list(range(8))),  # one object twice: pickle's BINGET
        ({"lora_name": "caf\u00e9 \U0001f600"}, list(range(8))),  # multi-byte UTF-8
        ({"parent": b"\x07" * 300}, list(range(8))),  # BINBYTES parent
        ({}, range(8)),  # not a list/tuple
        ({}, tuple(range(8))),
        ({"start_block": -1, "cache_salt": "s"}, list(range(8))),  # salt lands on the 2nd block
    ],
)
def test_fallback_paths_match_reference(impl, kwargs: dict, tokens) -> None:  # type: ignore[no-untyped-def]
    expected = blockhash_py.block_digests(tokens, 4, "sha256", **kwargs)
    assert impl(tokens, 4, "sha256", **kwargs) == expected


def test_errors_match_reference(impl) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match="unsupported block hash algorithm"):
        impl([1, 2], 1, "md5")
    with pytest.raises(ZeroDivisionError):
        impl([1, 2], 0, "sha256")
    assert impl([1, 2, 3], 4, "sha256") == []


@settings(max_examples=150, deadline=None)
@given(
    tokens=st.lists(st.integers(min_value=0, max_value=2**17), max_size=200),
    block_size=st.integers(min_value=1, max_value=40),
    lora=st.sampled_from([None, "", "lora-a", "l\u00f6ra"]),
    salt=st.sampled_from([None, "", "tenant-1", "s" * 255]),
    algo=st.sampled_from(blockhash_py.HASH_ALGOS),
    start_block=st.integers(min_value=0, max_value=3),
)
def test_property_identical_to_reference(tokens, block_size, lora, salt, algo, start_block) -> None:  # type: ignore[no-untyped-def]
    expected = blockhash_py.block_digests(
        tokens, block_size, algo, start_block=start_block, lora_name=lora, cache_salt=salt
    )
    assert len(expected) == len(tokens) // block_size
    for fn in _impls():
        got = fn(tokens, block_size, algo, start_block=start_block, lora_name=lora, cache_salt=salt)
        assert got == expected


@settings(max_examples=200, deadline=None)
@given(
    parent=st.binary(min_size=0, max_size=255),
    tokens=st.lists(st.integers(min_value=-(2**63), max_value=2**63 - 1), max_size=12),
    lora=st.one_of(st.none(), st.text(max_size=20)),
    salt=st.one_of(st.none(), st.text(max_size=20)),
    first_block=st.booleans(),
)
def test_property_pickle_bytes_exact(parent, tokens, lora, salt, first_block) -> None:  # type: ignore[no-untyped-def]
    if _blockhash_c is None:
        pytest.skip("Cython extension not built")
    extra = blockhash_py.extra_keys(0 if first_block else 1, lora, salt)
    got = _blockhash_c.pickle_block(parent, tokens, lora, salt, first_block)
    if got is None:  # only strings the pickler cannot put in SHORT_BINUNICODE, or one object used twice
        assert extra is not None
        return
    assert got == pickle.dumps((parent, tuple(tokens), extra), protocol=5)


def _impls() -> list:
    fns = [blockhash_py.block_digests]
    if _blockhash_c is not None:
        fns.append(_blockhash_c.block_digests)
    return fns


@pytest.mark.parametrize("which", impl_params(_blockhash_c))
def test_event_hashes_are_each_digests_low_64_bits(which: str) -> None:
    """The uint64 ids vLLM's KV events carry, for a whole prompt at once: the Cython build reads each digest's last
    8 bytes in C, the reference unpacks them in one call; both equal `to_event_hash` of each digest."""
    event_hashes = blockhash_py.event_hashes if which == "py" else _blockhash_c.event_hashes
    toks = list(range(3, 3 + 16 * 9))
    for algo in ("xxhash", "sha256"):
        ds = blockhash_py.block_digests(toks, 16, algo)
        for n in range(len(ds) + 1):
            assert event_hashes(ds[:n]) == [blockhash_py.to_event_hash(d) for d in ds[:n]]
        assert event_hashes(tuple(ds)) == event_hashes(ds)
    odd = [b"\x01" * 16, b"\x02" * 8, b"\x03" * 24, b"\x04" * 5, b"", b"\xff" * 9]  # lengths mixed, short, empty
    assert event_hashes(odd) == [blockhash_py.to_event_hash(d) for d in odd]
    assert event_hashes([bytearray(b"\x07" * 16)]) == [0x0707070707070707]
