# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""Fast vLLM chained block hash: the pickle bytes are written by hand into a C buffer, then hashed.

Same signature and results as `blockhash_py.block_digests`. The common case (parent = bytes, tokens = exact
ints, extra keys None or a tuple of str) is encoded here byte for byte as `pickle.dumps(obj, protocol=5)` would;
anything else (a non-list/tuple sequence, bools, ints beyond int64, long strings, ...) goes to the reference.

Layout of one block's pickle (protocol 5, one frame):

    80 05                     PROTO 5
    95 <u64 LE>               FRAME, length of everything after it (STOP included)
    43 <u8 n> <parent> 94     SHORT_BINBYTES parent digest, MEMOIZE
    28 <ints...> 74 94        MARK ints TUPLE MEMOIZE  (len >= 4; TUPLE1..3 = 85..87 without MARK; () = 29)
    4e | <extra keys> 94      NONE, or SHORT_BINUNICODE (8c <u8 n> <utf-8> 94)... TUPLE1/2 MEMOIZE
    87 94 2e                  TUPLE3 MEMOIZE STOP
"""

import hashlib

import xxhash

from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_CheckExact, PyBytes_FromStringAndSize, PyBytes_GET_SIZE
from cpython.list cimport PyList_CheckExact
from cpython.long cimport PyLong_CheckExact, PyLong_FromUnsignedLongLong
from cpython.mem cimport PyMem_Free, PyMem_Malloc
from cpython.object cimport PyObject
from cpython.tuple cimport PyTuple_CheckExact
from cpython.unicode cimport PyUnicode_CheckExact
from libc.stdint cimport int64_t, uint8_t, uint64_t
from libc.string cimport memcpy

from switchyard.ext import blockhash_py as _ref


cdef extern from "Python.h":
    long long PyLong_AsLongLongAndOverflow(object obj, int* overflow) except? -1
    const char* PyUnicode_AsUTF8AndSize(object s, Py_ssize_t* size) except NULL
    Py_ssize_t PySequence_Fast_GET_SIZE(object o)
    PyObject** PySequence_Fast_ITEMS(object o)


# Pickle opcodes (Lib/pickle.py).
cdef enum:
    OP_PROTO = 0x80
    OP_FRAME = 0x95
    OP_SHORT_BINBYTES = 0x43
    OP_MEMOIZE = 0x94
    OP_MARK = 0x28
    OP_TUPLE = 0x74
    OP_EMPTY_TUPLE = 0x29
    OP_TUPLE1 = 0x85
    OP_TUPLE3 = 0x87
    OP_NONE = 0x4E
    OP_SHORT_BINUNICODE = 0x8C
    OP_BININT1 = 0x4B
    OP_BININT2 = 0x4D
    OP_BININT = 0x4A
    OP_LONG1 = 0x8A
    OP_STOP = 0x2E
    HEADER_LEN = 11  # PROTO 5 + FRAME + 8-byte length
    MAX_INT_LEN = 10  # LONG1 + length byte + 8 bytes
    # NOTE: the pickler starts a new frame once one reaches 64 KiB; a block that large goes to the reference.
    FRAME_SIZE_TARGET = 65536

cdef dict _none_hash_cache = {}
_sha256 = hashlib.sha256
_xxh3_128_digest = xxhash.xxh3_128_digest


cdef inline Py_ssize_t _put_int(uint8_t* p, long long v) noexcept nogil:
    """Write one int as the pickler does (BININT1 / BININT2 / BININT / LONG1); returns the bytes written."""
    cdef uint64_t u
    cdef uint8_t le[8]
    cdef int n, i
    if 0 <= v < 256:
        p[0] = OP_BININT1
        p[1] = <uint8_t>v
        return 2
    if 0 <= v < 65536:
        p[0] = OP_BININT2
        p[1] = <uint8_t>(v & 0xFF)
        p[2] = <uint8_t>(v >> 8)
        return 3
    if -2147483648 <= v <= 2147483647:
        u = <uint64_t>(<int64_t>v)
        p[0] = OP_BININT
        p[1] = <uint8_t>(u & 0xFF)
        p[2] = <uint8_t>((u >> 8) & 0xFF)
        p[3] = <uint8_t>((u >> 16) & 0xFF)
        p[4] = <uint8_t>((u >> 24) & 0xFF)
        return 5
    # LONG1: minimal two's complement, little-endian (pickle.encode_long).
    u = <uint64_t>(<int64_t>v)
    for i in range(8):
        le[i] = <uint8_t>((u >> (8 * i)) & 0xFF)
    n = 8
    while n > 1 and ((le[n - 1] == 0x00 and not (le[n - 2] & 0x80)) or (le[n - 1] == 0xFF and (le[n - 2] & 0x80))):
        n -= 1
    p[0] = OP_LONG1
    p[1] = <uint8_t>n
    memcpy(p + 2, le, n)
    return 2 + n


cdef inline Py_ssize_t _put_str(uint8_t* p, const char* s, Py_ssize_t n) noexcept nogil:
    p[0] = OP_SHORT_BINUNICODE
    p[1] = <uint8_t>n
    memcpy(p + 2, s, n)
    p[2 + n] = OP_MEMOIZE
    return n + 3


cdef Py_ssize_t _encode_block(
    uint8_t* buf,
    const uint8_t* parent,
    Py_ssize_t parent_len,
    PyObject** items,
    Py_ssize_t count,
    const char* key1,
    Py_ssize_t key1_len,
    const char* key2,
    Py_ssize_t key2_len,
) except? -2:
    """Pickle (parent, tuple(items[:count]), extra) into buf; -1 when a token is not an exact int64 int.

    extra is None when key1 is NULL, else (key1,) or (key1, key2).
    """
    cdef uint8_t* p = buf + HEADER_LEN
    cdef Py_ssize_t j, frame_len
    cdef long long v
    cdef int overflow = 0
    cdef object item
    p[0] = OP_SHORT_BINBYTES
    p[1] = <uint8_t>parent_len
    memcpy(p + 2, parent, parent_len)
    p += 2 + parent_len
    p[0] = OP_MEMOIZE
    p += 1
    if count == 0:
        p[0] = OP_EMPTY_TUPLE  # the empty tuple is a singleton: never memoized
        p += 1
    else:
        if count > 3:
            p[0] = OP_MARK
            p += 1
        for j in range(count):
            item = <object>items[j]
            if not PyLong_CheckExact(item):
                return -1
            v = PyLong_AsLongLongAndOverflow(item, &overflow)
            if overflow:
                return -1
            p += _put_int(p, v)
        p[0] = OP_TUPLE if count > 3 else <uint8_t>(OP_TUPLE1 + count - 1)
        p[1] = OP_MEMOIZE
        p += 2
    if key1 == NULL:
        p[0] = OP_NONE
        p += 1
    else:
        p += _put_str(p, key1, key1_len)
        if key2 != NULL:
            p += _put_str(p, key2, key2_len)
            p[0] = OP_TUPLE1 + 1
        else:
            p[0] = OP_TUPLE1
        p[1] = OP_MEMOIZE
        p += 2
    p[0] = OP_TUPLE3
    p[1] = OP_MEMOIZE
    p[2] = OP_STOP
    p += 3
    frame_len = (p - buf) - HEADER_LEN
    if frame_len >= FRAME_SIZE_TARGET:
        return -1
    buf[0] = OP_PROTO
    buf[1] = 5
    buf[2] = OP_FRAME
    for j in range(8):
        buf[3 + j] = <uint8_t>((<uint64_t>frame_len >> (8 * j)) & 0xFF)
    return p - buf


cdef bint _short_str(object s, const char** out, Py_ssize_t* out_len) except -1:
    """UTF-8 of an exact str that SHORT_BINUNICODE can carry; False otherwise (surrogates, >= 256 bytes)."""
    if not PyUnicode_CheckExact(s):
        return False
    try:
        out[0] = PyUnicode_AsUTF8AndSize(s, out_len)
    except UnicodeEncodeError:
        return False
    return out_len[0] < 256


def pickle_block(parent, tokens, lora_name=None, cache_salt=None, bint first_block=False):
    """The exact bytes `block_digests` hashes for one block (exposed for tests); None if it would fall back."""
    cdef const char* k1 = NULL
    cdef const char* k2 = NULL
    cdef Py_ssize_t k1_len = 0, k2_len = 0, n
    if not PyBytes_CheckExact(parent) or PyBytes_GET_SIZE(parent) >= 256:
        return None
    seq = tuple(tokens)
    if lora_name and not _short_str(lora_name, &k1, &k1_len):
        return None
    if cache_salt and first_block:
        if (lora_name and lora_name is cache_salt) or not _short_str(cache_salt, &k2, &k2_len):
            return None
        if k1 == NULL:
            k1, k1_len, k2 = k2, k2_len, NULL
    cdef Py_ssize_t count = PySequence_Fast_GET_SIZE(seq)
    cdef uint8_t* buf = <uint8_t*>PyMem_Malloc(HEADER_LEN + 2 * 256 + 2 * 260 + 16 + MAX_INT_LEN * count)
    if buf == NULL:
        raise MemoryError()
    try:
        n = _encode_block(buf, <const uint8_t*>PyBytes_AS_STRING(parent), PyBytes_GET_SIZE(parent),
                          PySequence_Fast_ITEMS(seq), count, k1, k1_len, k2, k2_len)
        return None if n < 0 else PyBytes_FromStringAndSize(<char*>buf, n)
    finally:
        PyMem_Free(buf)


cdef bytes _none_hash(str algo, seed):
    key = (algo, seed)
    h = _none_hash_cache.get(key)
    if h is None:
        h = _ref.none_hash(algo, seed)
        if len(_none_hash_cache) < 64:
            _none_hash_cache[key] = h
    return h


def block_digests(
    token_ids,
    block_size,
    algo="xxhash",
    *,
    parent=None,
    start_block=0,
    lora_name=None,
    cache_salt=None,
    seed="",
):
    """Full digests of every full block of `token_ids`, chained from `parent` (NONE_HASH when None).

    See `blockhash_py.block_digests`; results are identical.
    """
    cdef const char* lora_s = NULL
    cdef const char* salt_s = NULL
    cdef Py_ssize_t lora_len = 0, salt_len = 0, num_blocks, i, n, total, bs, sb
    cdef bint is_sha
    cdef uint8_t* buf
    cdef PyObject** items
    cdef const char* k1
    cdef const char* k2
    cdef Py_ssize_t k1_len, k2_len
    if (
        not (PyList_CheckExact(token_ids) or PyTuple_CheckExact(token_ids))
        or not PyLong_CheckExact(block_size)
        or not PyLong_CheckExact(start_block)
        or not (algo == "sha256" or algo == "xxhash")
        or block_size <= 0
        or block_size > 100_000
        or not (-(1 << 40) < start_block < (1 << 40))
        or (parent is not None and (not PyBytes_CheckExact(parent) or PyBytes_GET_SIZE(parent) >= 256))
        or (lora_name and not _short_str(lora_name, &lora_s, &lora_len))
        or (cache_salt and not _short_str(cache_salt, &salt_s, &salt_len))
        or (lora_name and cache_salt and lora_name is cache_salt)  # the pickler would memoize: BINGET
    ):
        return _ref.block_digests(
            token_ids, block_size, algo, parent=parent, start_block=start_block,
            lora_name=lora_name, cache_salt=cache_salt, seed=seed,
        )
    is_sha = algo == "sha256"
    prev = parent if parent is not None else _none_hash(algo, seed)
    bs = block_size
    sb = start_block
    total = len(token_ids)
    num_blocks = total // bs
    out = []
    if num_blocks == 0:
        return out
    seq = token_ids  # keeps the list alive while we hold its item pointers
    buf = <uint8_t*>PyMem_Malloc(HEADER_LEN + 2 * 256 + 2 * 260 + 16 + MAX_INT_LEN * bs)
    if buf == NULL:
        raise MemoryError()
    try:
        for i in range(num_blocks):
            # NOTE: re-read the item array each block; hashlib/xxhash run no Python code that could resize it,
            # but this keeps the pointer valid even if they did.
            if PySequence_Fast_GET_SIZE(seq) < (i + 1) * bs:
                raise RuntimeError("token_ids changed size during hashing")
            items = PySequence_Fast_ITEMS(seq) + i * bs
            k1 = lora_s
            k1_len = lora_len
            k2 = NULL
            k2_len = 0
            if salt_s != NULL and sb + i == 0:
                if k1 == NULL:
                    k1, k1_len = salt_s, salt_len
                else:
                    k2, k2_len = salt_s, salt_len
            n = _encode_block(buf, <const uint8_t*>PyBytes_AS_STRING(prev), PyBytes_GET_SIZE(prev),
                              items, bs, k1, k1_len, k2, k2_len)
            if n < 0:  # an unusual token: this block goes through the reference pickler
                prev = _ref.hash_fn(algo)(
                    (prev, tuple(seq[i * bs : (i + 1) * bs]), _ref.extra_keys(sb + i, lora_name, cache_salt))
                )
            elif is_sha:
                prev = _sha256(PyBytes_FromStringAndSize(<char*>buf, n)).digest()
            else:
                prev = _xxh3_128_digest(PyBytes_FromStringAndSize(<char*>buf, n))
            out.append(prev)
    finally:
        PyMem_Free(buf)
    return out


def event_hashes(digests):
    """See `blockhash_py.event_hashes`: each digest's low 64 bits (big-endian), read in C."""
    cdef list out
    cdef Py_ssize_t n, k
    cdef const uint8_t* b
    cdef uint64_t v
    if not (PyList_CheckExact(digests) or PyTuple_CheckExact(digests)):
        return _ref.event_hashes(digests)
    for d in digests:
        if not PyBytes_CheckExact(d):
            return _ref.event_hashes(digests)
    out = []
    for d in digests:
        n = PyBytes_GET_SIZE(d)
        b = <const uint8_t*>PyBytes_AS_STRING(d)
        v = 0
        for k in range(n - 8 if n > 8 else 0, n):
            v = (v << 8) | b[k]
        out.append(PyLong_FromUnsignedLongLong(v))
    return out
