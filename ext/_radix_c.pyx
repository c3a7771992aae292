# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""Fast global prefix radix tree: the same API and results as `radix_py` (see its docstring for the contract).

Layout, chosen for `match` (the routing hot path):

    Node._blocks   uint64_t[_n]      the run of block hashes, compared in C against the query
    Node._children dict              first block hash (Python int) -> child Node
    Node._res_mask uint64_t[_NW]     bit s set = worker slot s has a leading resident run on this node
    Node._runs     uint32_t[popcnt]  those runs, in slot order: run of s = _runs[its rank: set bits below s]
    Node._asg_mask uint64_t[_NW]     bit s set = worker slot s is assigned through this node
    Node._evf_mask uint64_t[_NW]     bit s set = slot s noted evicting blocks of this node since (within _asg_mask)

Worker ids are interned into at most 256 slots (`MAX_WORKERS`, masks of _NW = 4 words); a slot is freed as soon
as no node refers to it (`_slot_refs` counts the (node, resident|assigned) memberships), so the limit is on
workers that hold state in the tree at the same time. With masks, `match` carries the set of workers whose leading
run is still unbroken down the path as a mask over the words in use (one up to 64 workers) and touches Python
objects only to build the result dicts.

The block index is a C open-addressing table block hash (uint64) -> Node (linear probing, backward-shift
deletion, one 16-byte slot per block): no Python int per block, one cache line per lookup, where a dict of ints
costs an int object, its hash and two arrays. It holds borrowed references: only attached nodes are indexed, and
an attached node is held by its parent's `_children`. The offset inside the node is found by a scan of the
node's C array (a few ns per block), with an O(1) fast path for the consecutive blocks of one event.

The index grows without stopping the world. At load 0.6 the next table (twice the size) is mapped, lazily zeroed,
and a thread (`_PageToucher`, without the GIL) faults its pages in; at load 0.7 the full table hands its entries to
it a few slots per new key (`_MIGRATE_PER_PUT`), behind a cursor, while lookups read both and deletions leave
tombstones in the old one. A one-shot rehash stalled the event loop for the whole table in the dispatch that
crossed the line (12.8 ms at 1.5M blocks, 27-246 ms at 3M, on this VM); the page faults alone, a huge page each
2 MiB, cost ~1-4 ms each here, so they are not taken on the caller's thread either.

It shrinks the same way, after collection (`gc`, `_settle`): a grow's next table is unmapped once the load falls
below 0.3, and below 0.1 the smallest table holding the entries at load 0.25 or less is mapped (its pages faulted
in by the thread) and, at a later collection, moved into, `_MIGRATE_PER_GC` old slots per collection. A daemon
that took a burst of prompts gives their index back once the burst's nodes are collected, rather than keeping
its peak size (and the table mapped for the next doubling) for good.
"""

cimport cython
from cpython.list cimport PyList_GET_ITEM, PyList_GET_SIZE
from cpython.long cimport PyLong_Check, PyLong_FromUnsignedLongLong
from cpython.mem cimport PyMem_Free, PyMem_Malloc, PyMem_Realloc
from cpython.object cimport PyObject
from libc.stdint cimport int64_t, uint32_t, uint64_t
from libc.math cimport floor
from libc.string cimport memcpy, memmove, memset

import os
import threading


cdef extern from "Python.h":
    void* PyMem_Calloc(size_t nelem, size_t elsize)
    Py_ssize_t PySequence_Fast_GET_SIZE(object o)
    PyObject** PySequence_Fast_ITEMS(object o)
    bint PyList_CheckExact(object o)
    bint PyTuple_CheckExact(object o)
    unsigned long long PyLong_AsUnsignedLongLongMask(object o)  # never fails on an int: the low 64 bits
    int _PyLong_Sign(object o)
    size_t _PyLong_NumBits(object o)
    PyObject* PyErr_Occurred()
    void PyErr_Clear()


cdef extern from *:
    int _popcount "__builtin_popcountll"(unsigned long long x) nogil
    int _ctz "__builtin_ctzll"(unsigned long long x) nogil
    void _prefetch "__builtin_prefetch"(const void* addr) nogil

# blocks ahead whose index slots a run of puts prefetches (`_reserve`): a cold slot costs a cache miss, and the
# misses of one run's puts, independent of each other, then overlap instead of queueing
cdef Py_ssize_t _PREFETCH_AHEAD = 16

# old-table slots a growing index moves per new key: the move ends before the new table reaches the old's load
# (it starts at 0.35 and needs old_cap / 8 new keys, 1/16 of the new capacity), and costs ~6 live entries per put
cdef size_t _MIGRATE_PER_PUT = 8
# old-table slots each `gc` call moves (a shrinking tree has few puts to carry a move): 256 KiB of the old table
# scanned; with E2's collections those calls' p99 was ~0.4 ms (`bench radix`'s growth runs, ext/README.md)
cdef size_t _MIGRATE_PER_GC = 1 << 14
cdef size_t _MIN_SLOTS = 1024  # the index's first and smallest table
cdef size_t _PAGE = 4096


cdef enum:
    _NW = 4  # words of a worker mask
    _MAX_SLOTS = 256  # _NW * 64
MAX_WORKERS = _MAX_SLOTS


cdef extern from *:
    """
    #if PY_VERSION_HEX < 0x030C0000 && PYLONG_BITS_IN_DIGIT == 30
    /* An exact int of at most 64 bits, read from its digits: 1 when it fits, 0 when it does not, -1 when the
       caller must take the general path (not an exact int). */
    static inline int sy_digits_u64(PyObject* o, uint64_t* out) {
        if (!PyLong_CheckExact(o)) return -1;
        Py_ssize_t size = Py_SIZE(o);
        const digit* d = ((PyLongObject*)o)->ob_digit;
        switch (size) {
        case 0: *out = 0; return 1;
        case 1: *out = d[0]; return 1;
        case 2: *out = (uint64_t)d[0] | ((uint64_t)d[1] << 30); return 1;
        case 3:
            if (d[2] >> 4) return 0;
            *out = (uint64_t)d[0] | ((uint64_t)d[1] << 30) | ((uint64_t)d[2] << 60); return 1;
        default: return 0;  /* negative, or past 90 bits */
        }
    }
    #else
    static inline int sy_digits_u64(PyObject* o, uint64_t* out) { (void)o; (void)out; return -1; }
    #endif
    """
    int sy_digits_u64(PyObject* o, uint64_t* out) noexcept


cdef inline bint _as_u64(object o, uint64_t* out) noexcept:
    """True and *out when o is an int in [0, 2**64); False otherwise (no exception left set).

    NOTE: a walk converts every block hash of the prompt (~600 on video QA, per select, dispatch and history
    entry rebalancing reads), so an exact int is read from its 30-bit digits inline (CPython 3.11's layout;
    `sy_digits_u64`, ~1 ns); anything else takes the API: sign and bit length range-check it (O(1)), then the
    masked read (PyLong_AsUnsignedLongLong takes a byte-array conversion for every int past one digit).
    """
    cdef int got = sy_digits_u64(<PyObject*>o, out)
    if got >= 0:
        return got
    if not PyLong_Check(o) or _PyLong_Sign(o) < 0 or _PyLong_NumBits(o) > 64:
        return False
    out[0] = PyLong_AsUnsignedLongLongMask(o)
    return True


cdef inline Py_ssize_t _chain_run(PyObject** items, const uint64_t* blocks, Py_ssize_t span) noexcept:
    """How many of `blocks[:span]` the hashes at `items` agree with, the first agreeing, for chained hashes
    (agreeing at an offset means agreeing at every offset before it): the last offset, else a bisection for the
    first disagreement. A walk of a fresh prompt reads a node's blocks cold, ~600 of them on video QA: this reads
    one, or ~log2(span), instead."""
    cdef Py_ssize_t lo = 1, hi = span - 1, mid
    cdef uint64_t v
    if span <= 1:
        return span
    if _as_u64(<object>items[hi], &v) and v == blocks[hi]:
        return span
    while lo < hi:  # items agree at lo - 1 and not at hi
        mid = (lo + hi) >> 1
        if _as_u64(<object>items[mid], &v) and v == blocks[mid]:
            lo = mid + 1
        else:
            hi = mid
    return lo


cdef extern from *:
    """
    #include <stdint.h>
    #include <stdlib.h>
    #if defined(__linux__)
    #include <sys/mman.h>
    #endif
    #define SY_HUGE ((size_t)2 << 20)
    /* A zeroed table of n bytes; free it with sy_table_free(p, n). From 2 MiB up (Linux): an anonymous mapping,
       2 MiB-aligned and advised to transparent huge pages, so its random probes (one per block: every dispatch
       puts ~600 on video QA) do not each miss the TLB; its pages are zeroed by the kernel when first touched, not
       here (a grow must not stall on zeroing the whole table). */
    static void* sy_table_alloc(size_t n) {
    #if defined(__linux__)
        if (n >= SY_HUGE) {
            size_t len = (n + SY_HUGE - 1) / SY_HUGE * SY_HUGE;
            char* raw = (char*)mmap(NULL, len + SY_HUGE, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
            if (raw == (char*)MAP_FAILED) return NULL;
            char* p = (char*)(((uintptr_t)raw + SY_HUGE - 1) & ~(uintptr_t)(SY_HUGE - 1));
            if (p > raw) munmap(raw, (size_t)(p - raw));
            if (raw + len + SY_HUGE > p + len) munmap(p + len, (size_t)(raw + len + SY_HUGE - (p + len)));
    #if defined(MADV_HUGEPAGE)
            madvise(p, len, MADV_HUGEPAGE);
    #endif
            return p;
        }
    #endif
        return calloc(n ? n : 1, 1);
    }
    static void sy_table_free(void* p, size_t n) {
        if (p == NULL) return;
    #if defined(__linux__)
        if (n >= SY_HUGE) { munmap(p, (n + SY_HUGE - 1) / SY_HUGE * SY_HUGE); return; }
    #endif
        free(p);
    }
    """
    void* sy_table_alloc(size_t n) nogil
    void sy_table_free(void* p, size_t n) nogil
    size_t _HUGE "SY_HUGE"


cdef extern from *:
    """
    /* A flag one thread sets and another reads: the setter's writes before it are seen by the reader after it. */
    static inline void sy_flag_set(int* p) { __atomic_store_n(p, 1, __ATOMIC_RELEASE); }
    static inline int sy_flag_get(const int* p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }
    """
    void sy_flag_set(int* p) nogil
    int sy_flag_get(const int* p) nogil


cdef inline uint64_t _bit(int s) noexcept nogil:
    return (<uint64_t>1) << s


# Worker masks: _NW words, slot s at bit s & 63 of word s >> 6. Iterate one as
#     for wi in range(_NW): bits = m[wi]; while bits: s = (wi << 6) | _ctz(bits); bits &= bits - 1
cdef inline bint _mtest(const uint64_t* m, int s) noexcept nogil:
    return (m[s >> 6] >> (s & 63)) & 1


cdef inline void _mset(uint64_t* m, int s) noexcept nogil:
    m[s >> 6] |= _bit(s & 63)


cdef inline void _mclear(uint64_t* m, int s) noexcept nogil:
    m[s >> 6] &= ~_bit(s & 63)


cdef inline bint _many(const uint64_t* m) noexcept nogil:
    cdef int i
    for i in range(_NW):
        if m[i]:
            return True
    return False


cdef inline int _mrank(const uint64_t* m, int s) noexcept nogil:
    """The set bits of m below slot s: the index of s's entry in a per-slot array kept in slot order."""
    cdef int i, n = 0
    for i in range(s >> 6):
        n += _popcount(m[i])
    return n + _popcount(m[s >> 6] & (_bit(s & 63) - 1))


cdef inline int _mcount(const uint64_t* m) noexcept nogil:
    cdef int i, n = 0
    for i in range(_NW):
        n += _popcount(m[i])
    return n


cdef struct _Slot:
    uint64_t key
    PyObject* node  # NULL: an empty slot; _TOMB: moved or deleted (the old table of a grow only); else borrowed


# the old table's mark for a slot whose entry left it (moved to the new table, or deleted) during a grow: a probe
# goes on past it, as the entries of its run behind it stay where they are
cdef PyObject* _TOMB = <PyObject*>1


cdef inline size_t _home(uint64_t key, size_t mask) noexcept nogil:
    """splitmix64's finalizer: block hashes are uniform already, but tests and callers may use small ints."""
    key ^= key >> 30
    key *= <uint64_t>0xbf58476d1ce4e5b9ULL
    key ^= key >> 27
    key *= <uint64_t>0x94d049bb133111ebULL
    key ^= key >> 31
    return <size_t>key & mask


cdef inline void _prefetch_key(
    const _Slot* slots, size_t cap, const _Slot* old, size_t old_cap, uint64_t key
) noexcept nogil:
    """Prefetch key's home slot (in both tables while the index grows): a put or delete a few keys ahead. A
    function, inlined: as a method (called through the class's vtable, or not inlined) the prefetches lost most of
    their effect (a 470-block insert took 30 µs instead of 18; not understood further)."""
    _prefetch(&slots[_home(key, cap - 1)])
    if old != NULL:
        _prefetch(&old[_home(key, old_cap - 1)])


cdef Py_ssize_t _live_nodes = 0  # Node objects alive, tree roots included (`live_nodes`: the leak test's count)


def live_nodes():
    """Node objects alive in this process: what the tests check for leaks, as Node is invisible to the collector."""
    return _live_nodes


@cython.no_gc
cdef class Node:
    """One run of consecutive blocks. Fields are read-only properties, except `stats` (the policy's slot).

    NOTE: `no_gc`: a node is not tracked by Python's cyclic collector. Tracked, a 100k-node tree was ~126k tracked
    objects (the nodes and their children dicts), the policies' tuples that hold nodes (an LRU entry and heap item
    per resident node) stayed tracked with them, and every full collection, which the daemon runs on its event
    loop, walked them all with nothing to collect: the tree alone added 57-72 ms to a collection (`switchyard bench
    radix`, 100k nodes, two runs). The only cycles through nodes are parent <-> child, which the tree breaks itself:
    a node leaves the tree as a leaf, its parent link cleared (`gc`), and a dropped tree unlinks every node
    (`RadixTree.__dealloc__`). Whatever a policy keeps in `stats` must not refer back to nodes or trees.
    """

    cdef uint64_t* _blocks
    cdef Py_ssize_t _n
    cdef readonly Py_ssize_t context_blocks
    cdef Node _parent  # the tree's root for a top-level node; None once detached
    cdef dict _children
    cdef uint64_t _res_mask[_NW]
    cdef uint32_t* _runs
    cdef int _runs_cap
    cdef uint64_t _asg_mask[_NW]
    cdef uint64_t _evf_mask[_NW]  # `evictions`: a subset of _asg_mask (cleared with it)
    cdef list _names  # the tree's slot -> worker table (shared, mutated in place)
    cdef readonly double last_access
    cdef public object stats
    cdef readonly bint is_attached
    cdef readonly long long seq  # creation order in its tree (see radix_py)
    cdef bint _gc_queued  # in its tree's gc candidates

    def __cinit__(self):
        global _live_nodes
        _live_nodes += 1

    def __dealloc__(self):
        global _live_nodes
        _live_nodes -= 1
        PyMem_Free(self._blocks)
        PyMem_Free(self._runs)

    @property
    def blocks(self):
        return tuple([PyLong_FromUnsignedLongLong(self._blocks[i]) for i in range(self._n)])

    @property
    def num_blocks(self):
        return self._n

    @property
    def first_block(self):
        if self._n == 0:
            raise IndexError("the root holds no blocks")
        return PyLong_FromUnsignedLongLong(self._blocks[0])

    @property
    def parent(self):
        if self._parent is None or self._parent._n == 0:
            return None
        return self._parent

    @property
    def children(self):
        return dict(self._children)

    @property
    def resident(self):
        cdef dict out = {}
        cdef uint64_t bits
        cdef int s, wi, k = 0
        for wi in range(_NW):
            bits = self._res_mask[wi]
            while bits:
                s = (wi << 6) | _ctz(bits)
                bits &= bits - 1
                out[self._names[s]] = self._runs[k]
                k += 1
        return out

    def resident_on(self, worker):
        """`resident.get(worker, 0)` without building the dict (the eviction order asks once per step)."""
        cdef uint64_t bits
        cdef int s, wi, k = 0
        for wi in range(_NW):
            bits = self._res_mask[wi]
            while bits:
                s = (wi << 6) | _ctz(bits)
                bits &= bits - 1
                if self._names[s] == worker:
                    return self._runs[k]
                k += 1
        return 0

    @property
    def assigned(self):
        return _mask_names(self._asg_mask, self._names)

    @property
    def evictions(self):
        return _mask_names(self._evf_mask, self._names)

    def has_evictions(self, worker):
        """`worker in evictions` without building the set."""
        cdef uint64_t bits
        cdef int wi
        for wi in range(_NW):
            bits = self._evf_mask[wi]
            while bits:
                if self._names[(wi << 6) | _ctz(bits)] == worker:
                    return True
                bits &= bits - 1
        return False

    def __repr__(self):
        return f"Node(blocks={self._n}, context_blocks={self.context_blocks})"


cdef set _mask_names(const uint64_t* m, list names):
    """The workers of a slot mask."""
    cdef set out = set()
    cdef uint64_t bits
    cdef int wi
    for wi in range(_NW):
        bits = m[wi]
        while bits:
            out.add(names[(wi << 6) | _ctz(bits)])
            bits &= bits - 1
    return out


cdef inline uint32_t _run(Node node, int s) noexcept:
    if not _mtest(node._res_mask, s):
        return 0
    return node._runs[_mrank(node._res_mask, s)]


cdef int _set_run(Node node, int s, uint32_t d) except -2:
    """Set slot s's run on node (0 removes it); returns the change in membership (-1, 0, +1)."""
    cdef int idx = _mrank(node._res_mask, s)
    cdef int cnt = _mcount(node._res_mask)
    cdef uint32_t* grown
    if _mtest(node._res_mask, s):
        if d:
            node._runs[idx] = d
            return 0
        memmove(node._runs + idx, node._runs + idx + 1, (cnt - idx - 1) * sizeof(uint32_t))
        _mclear(node._res_mask, s)
        return -1
    if not d:
        return 0
    if cnt + 1 > node._runs_cap:
        grown = <uint32_t*>PyMem_Realloc(node._runs, (node._runs_cap * 2 + 4) * sizeof(uint32_t))
        if grown == NULL:
            raise MemoryError()
        node._runs = grown
        node._runs_cap = node._runs_cap * 2 + 4
    memmove(node._runs + idx + 1, node._runs + idx, (cnt - idx) * sizeof(uint32_t))
    node._runs[idx] = d
    _mset(node._res_mask, s)
    return 1


cdef inline Py_ssize_t _offset(Node node, uint64_t h) noexcept:
    cdef Py_ssize_t i
    for i in range(node._n):
        if node._blocks[i] == h:
            return i
    return -1


cdef class MatchResult:
    """What `RadixTree.match` found (see `radix_py.MatchResult`)."""

    cdef readonly list path
    cdef readonly Py_ssize_t matched_blocks
    cdef readonly dict resident_blocks
    cdef readonly dict assigned_blocks
    cdef readonly object key_node

    def __repr__(self):
        return (
            f"MatchResult(path={self.path!r}, matched_blocks={self.matched_blocks}, "
            f"resident_blocks={self.resident_blocks!r}, assigned_blocks={self.assigned_blocks!r}, "
            f"key_node={self.key_node!r})"
        )


def key_node(path):
    """Preble's key portion of a path: the deepest node with more blocks than all its predecessors together."""
    found = None
    for node in path:
        if node.num_blocks > node.context_blocks:
            found = node
    return found


cdef inline object _fast_seq(object seq):
    if PyList_CheckExact(seq) or PyTuple_CheckExact(seq):
        return seq
    return list(seq)


cdef size_t _BLOCKSET_SHRINK_FROM = 1024  # slots: smaller tables never shrink (9 KiB)
# slots from which `update` and `difference_update` prefetch ahead (288 KiB, past a core's L2): a smaller table is
# mostly cached (prefetching in every table, E2's evicted sets too, read on_dispatch ~3% slower in two runs)
cdef size_t _BLOCKSET_PREFETCH_FROM = 1 << 15


cdef class BlockSet:
    """A set of block hashes (ints in [0, 2**64)): the operations of `set` that E2's evicted blocks and the fleet's
    `PrefixIndex` use (add, discard, update, difference_update, intersection, in, len, iteration), kept in a C
    open-addressing table of uint64 (linear probing at load <= 0.7, backward-shift deletion, a smaller table below
    load 0.1: `_shrink`) with no Python int per member. `update` and `add` refuse anything else (ValueError);
    `discard`, `difference_update` and `in` treat it as absent. The tree's `gc` and `match_cached` read and prune
    it in C (`RadixTree.block_set`).

    NOTE: not the block index's table (16-byte key + node slots), on purpose: most reads here are of absent
    hashes (`match_cached` asks each block of an assigned run), and an absent key ends at the first empty slot,
    which the dense occupancy bytes answer from a table 16x smaller. Measured with the index's slot layout in
    their place (600 absent lookups per call, 20k / 200k / 2M members): 20.6 / 24.6 / 69.2 ns per lookup
    against 17.2 / 16.3 / 36.0, and videoqa's select ×1.02-1.09 paired. The probing and the backward shift are
    the index's (`_del`).
    """

    cdef uint64_t* _keys
    cdef unsigned char* _used
    cdef size_t _cap
    cdef Py_ssize_t _n

    def __cinit__(self, *args):
        self._cap = 16
        self._n = 0
        self._keys = <uint64_t*>PyMem_Calloc(self._cap, sizeof(uint64_t))
        self._used = <unsigned char*>PyMem_Calloc(self._cap, 1)
        if self._keys == NULL or self._used == NULL:
            raise MemoryError()

    def __init__(self, iterable=()):
        self.update(iterable)

    def __dealloc__(self):
        PyMem_Free(self._keys)
        PyMem_Free(self._used)

    cdef inline Py_ssize_t _find(self, uint64_t key) noexcept:
        cdef size_t mask = self._cap - 1
        cdef size_t i = _home(key, mask)
        while self._used[i]:
            if self._keys[i] == key:
                return <Py_ssize_t>i
            i = (i + 1) & mask
        return -1

    cdef int _grow(self) except -1:
        if self._rehash(self._cap * 2) < 0:
            raise MemoryError()
        return 0

    cdef int _rehash(self, size_t cap) noexcept:
        """Move the members into a table of `cap` slots (a power of two that holds them); -1 (nothing changed)
        where it cannot be allocated."""
        cdef size_t old_cap = self._cap, mask = cap - 1, i, j
        cdef uint64_t* old_keys = self._keys
        cdef unsigned char* old_used = self._used
        cdef uint64_t* keys = <uint64_t*>PyMem_Calloc(cap, sizeof(uint64_t))
        cdef unsigned char* used = <unsigned char*>PyMem_Calloc(cap, 1)
        if keys == NULL or used == NULL:
            PyMem_Free(keys)
            PyMem_Free(used)
            return -1
        for i in range(old_cap):
            if old_used[i]:
                j = _home(old_keys[i], mask)
                while used[j]:
                    j = (j + 1) & mask
                keys[j] = old_keys[i]
                used[j] = 1
        self._keys, self._used, self._cap = keys, used, cap
        PyMem_Free(old_keys)
        PyMem_Free(old_used)
        return 0

    cdef int _add(self, uint64_t key) except -1:
        cdef size_t mask, i
        if (self._n + 1) * 10 > <Py_ssize_t>self._cap * 7:
            self._grow()
        mask = self._cap - 1
        i = _home(key, mask)
        while self._used[i]:
            if self._keys[i] == key:
                return 0
            i = (i + 1) & mask
        self._keys[i] = key
        self._used[i] = 1
        self._n += 1
        return 0

    cdef inline void _prefetch_next(self, PyObject** items, Py_ssize_t n, Py_ssize_t i) noexcept:
        """Before member i of a run of n: prefetch both arrays' lines where the probe of member i +
        `_PREFETCH_AHEAD` starts (at i = 0, of the members before it too); nothing for anything but a uint64."""
        cdef Py_ssize_t j = i + _PREFETCH_AHEAD if i else 0
        cdef Py_ssize_t end = i + _PREFETCH_AHEAD + 1
        cdef uint64_t k
        cdef size_t at
        if end > n:
            end = n
        while j < end:
            if _as_u64(<object>items[j], &k):
                at = _home(k, self._cap - 1)
                _prefetch(&self._used[at])
                _prefetch(&self._keys[at])
            j += 1

    cdef void _remove(self, uint64_t key) noexcept:
        """As the block index's `_del`: shift back the entries of the probe run (no tombstones)."""
        cdef size_t mask = self._cap - 1
        cdef Py_ssize_t at = self._find(key)
        cdef size_t i, j, k
        if at < 0:
            return
        i = <size_t>at
        j = i
        while True:
            j = (j + 1) & mask
            if not self._used[j]:
                break
            k = _home(self._keys[j], mask)
            if (i <= j and i < k <= j) or (i > j and (k > i or k <= j)):
                continue
            self._keys[i] = self._keys[j]
            i = j
        self._used[i] = 0
        self._n -= 1
        if self._n * 10 < <Py_ssize_t>self._cap and self._cap > _BLOCKSET_SHRINK_FROM:
            self._shrink()

    cdef void _shrink(self) noexcept:
        """Below load 0.1, move into the smallest table at load <= 0.35 (a grow leaves 0.35): a set emptied after
        a burst gives its memory back, and a set must halve again, or grow 2x, before the next resize. A failed
        allocation keeps the larger table."""
        cdef size_t cap = _BLOCKSET_SHRINK_FROM
        while <Py_ssize_t>cap * 35 < self._n * 100:
            cap *= 2
        if cap < self._cap:
            self._rehash(cap)

    def __sizeof__(self):
        """The object and its table (`sys.getsizeof`): 9 bytes a slot."""
        return sizeof(BlockSet) + self._cap * (sizeof(uint64_t) + 1)

    def add(self, h):
        cdef uint64_t k
        if not _as_u64(h, &k):
            raise ValueError(f"block hash {h!r} is not a uint64")
        self._add(k)

    def discard(self, h):
        cdef uint64_t k
        if _as_u64(h, &k):
            self._remove(k)

    def update(self, iterable):
        """`set.update`; each member's slots prefetched `_PREFETCH_AHEAD` members ahead (a KV event's run of
        ~600 random hashes in a table past the caches: the misses overlap instead of queueing)."""
        cdef object seq = _fast_seq(iterable)
        cdef Py_ssize_t n = PySequence_Fast_GET_SIZE(seq), i
        cdef PyObject** items = PySequence_Fast_ITEMS(seq)
        cdef uint64_t k
        cdef bint ahead = self._cap >= _BLOCKSET_PREFETCH_FROM
        for i in range(n):
            if ahead:
                self._prefetch_next(items, n, i)
            if not _as_u64(<object>items[i], &k):
                raise ValueError(f"block hash {<object>items[i]!r} is not a uint64")
            self._add(k)

    def difference_update(self, iterable):
        """`set.difference_update`, prefetching as `update`."""
        cdef object seq
        cdef Py_ssize_t n, i
        cdef PyObject** items
        cdef uint64_t k
        if not self._n:
            return
        seq = _fast_seq(iterable)
        n = PySequence_Fast_GET_SIZE(seq)
        items = PySequence_Fast_ITEMS(seq)
        cdef bint ahead = self._cap >= _BLOCKSET_PREFETCH_FROM
        for i in range(n):
            if ahead:
                self._prefetch_next(items, n, i)
            if _as_u64(<object>items[i], &k):
                self._remove(k)

    def intersection(self, iterable):
        """The members among `iterable`, as a `set` (what `set.intersection` gives for ints)."""
        cdef object seq = _fast_seq(iterable)
        cdef Py_ssize_t n = PySequence_Fast_GET_SIZE(seq), i
        cdef PyObject** items = PySequence_Fast_ITEMS(seq)
        cdef uint64_t k
        cdef set out = set()
        if self._n:
            for i in range(n):
                if _as_u64(<object>items[i], &k) and self._find(k) >= 0:
                    out.add(<object>items[i])
        return out

    def __contains__(self, h):
        cdef uint64_t k
        return _as_u64(h, &k) and self._find(k) >= 0

    def __len__(self):
        return self._n

    def __iter__(self):
        cdef size_t i
        return iter([PyLong_FromUnsignedLongLong(self._keys[i]) for i in range(self._cap) if self._used[i]])

    def __eq__(self, other):
        if isinstance(other, (BlockSet, set, frozenset)):
            return len(other) == self._n and all(h in other for h in self)
        return NotImplemented

    __hash__ = None  # mutable, as `set`

    def __repr__(self):
        return f"BlockSet({sorted(self)!r})"


cdef set _running_touchers = set()


def _after_fork_in_child():
    """A forked child has none of its parent's threads: a toucher running at the fork never finishes there (and
    `stop` would spin forever). Its pages fault in on the child's own writes."""
    cdef _PageToucher t
    for t in _running_touchers:
        sy_flag_set(&t._done)
    _running_touchers.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)


@cython.final
cdef class _PageToucher:
    """Writes a byte to every page of a fresh mapping on a thread of its own, without the GIL: the page faults (the
    kernel zeroing each page) off the tree's thread. The tree uses or frees the mapping only once `_done` is set,
    which `stop` hastens."""

    cdef char* _mem
    cdef size_t _size
    cdef int _done, _stop

    @staticmethod
    cdef _PageToucher start(char* mem, size_t size):
        cdef _PageToucher t = _PageToucher.__new__(_PageToucher)
        t._mem, t._size = mem, size
        _running_touchers.add(t)
        threading.Thread(target=t._run, name="switchyard-radix-grow", daemon=True).start()
        return t

    def _run(self):
        cdef size_t at = 0
        with nogil:
            while at < self._size and not sy_flag_get(&self._stop):
                (<volatile char*>self._mem)[at] = 0
                at += _PAGE
            sy_flag_set(&self._done)
        _running_touchers.discard(self)

    cdef inline bint done(self) noexcept:
        return sy_flag_get(&self._done)

    cdef void stop(self) noexcept:
        """Stop early and wait until it has (at most one page fault: a spin, as the thread never needs the GIL to
        set `_done`); the pages it did not touch fault in on the tree's thread, when first written."""
        sy_flag_set(&self._stop)
        while not sy_flag_get(&self._done):
            pass


@cython.no_gc_clear
cdef class RadixTree:
    """The global prefix tree over chained block hashes; see `radix_py` for the contract.

    `no_gc_clear`: `__dealloc__` needs `_root` to unlink the nodes, which the collector must not clear first.
    """

    cdef Node _root
    cdef _Slot* _slots  # the block index: block hash -> Node (see the module docstring)
    cdef size_t _cap  # slots, a power of two
    cdef Py_ssize_t _nidx  # entries, in both tables while one grows
    cdef _Slot* _old  # a grow's table being emptied into _slots (NULL: none); its slots below _mig are moved
    cdef size_t _old_cap, _mig
    cdef Py_ssize_t _old_n  # entries still in _old
    cdef _Slot* _next  # the next table: a grow's, mapped at load 0.6, or a shrink's (NULL: none yet)
    cdef size_t _next_cap  # its slots (0: none)
    cdef _PageToucher _toucher  # faulting _next's pages in (None: none, or done)
    cdef Py_ssize_t _num_nodes
    cdef long long _next_seq
    cdef dict _worker_to_slot
    cdef list _slot_names
    cdef int64_t _slot_refs[_MAX_SLOTS]
    cdef uint64_t _used_mask[_NW]
    cdef int _nw  # the mask words in use: 1 + the highest word of _used_mask with a bit set (0: none)
    cdef dict _dead  # gc's candidates: whole second of last_access -> [node] (see radix_py)
    cdef readonly long long gc_visits  # as the reference's
    # The last walk of a tuple of hashes (`_walk`): the tuple itself (held, so its identity cannot be reused), the
    # shape version it walked, its path, matched blocks, last node's matched blocks, and whether it was strict.
    cdef uint64_t _shape  # bumped by every change to the nodes' spans or links (`_reshaped`)
    cdef object _walk_seq
    cdef uint64_t _walk_shape
    cdef list _walk_path
    cdef Py_ssize_t _walk_matched, _walk_last_m
    cdef bint _walk_strict
    cdef readonly bint chained  # see __init__

    def __cinit__(self, *args, **kwargs):
        cdef int s
        self._dead = {}
        self._slot_names = [None] * _MAX_SLOTS
        self._worker_to_slot = {}
        self._cap = _MIN_SLOTS
        self._nidx = 0
        self._old = NULL
        self._old_cap = self._mig = 0
        self._old_n = 0
        self._next = NULL
        self._next_cap = 0
        self._toucher = None
        self._slots = <_Slot*>sy_table_alloc(self._cap * sizeof(_Slot))
        if self._slots == NULL:
            raise MemoryError()
        self._num_nodes = 0
        self.gc_visits = 0
        self._shape = 0
        self._walk_seq = None
        self._next_seq = 0  # the root takes 0, as in the reference
        for s in range(_NW):
            self._used_mask[s] = 0
        self._nw = 0
        for s in range(_MAX_SLOTS):
            self._slot_refs[s] = 0
        self._root = self._new_node(NULL, 0, 0, None, 0.0)

    def __init__(self, bint chained=False):
        """`chained`: the caller promises every sequence of hashes it passes is a chain of uint64 block hashes
        (equal hashes at an offset mean equal prefixes, as with `router.admission`'s and vLLM's KV events), so a
        walk compares a node's last covered block first and bisects only on a mismatch (`_chain_run`). Under the
        promise the answers are the reference's. Past it, a node may match through a block where the reference
        stops: a broken chain in a query, or a value that is not a uint64 inside a node's span (insert refuses
        one at a node's start or in what it stores, as without the flag, not one that a walk skips)."""
        self.chained = chained
        self._walk_seq = None  # a walk of the other kind is no memo for this one
        self._walk_path = None

    key_node = staticmethod(key_node)

    @staticmethod
    def block_set():
        """An empty set of block hashes for `gc(evicted=...)` and `match_cached` (this build: a `BlockSet`)."""
        return BlockSet()

    def __dealloc__(self):
        sy_table_free(self._slots, self._cap * sizeof(_Slot))
        sy_table_free(self._old, self._old_cap * sizeof(_Slot))
        self._drop_next()
        self._unlink_all()

    cdef void _unlink_all(self) noexcept:
        """Break every parent <-> child link, as the collector does not see nodes (`Node`); iterative, so a deep
        tree does not recurse in the deallocations. A node still held elsewhere stays, detached."""
        cdef list stack
        cdef Node node
        if self._root is None:
            return
        stack = [self._root]
        while stack:
            node = <Node>stack.pop()
            if node._children:
                stack.extend(node._children.values())
                node._children.clear()
            node._parent = None
            node.is_attached = False

    # ---- the block index -----------------------------------------------------------------------------------

    cdef inline PyObject* _get(self, uint64_t key) noexcept:
        cdef size_t mask = self._cap - 1
        cdef size_t i = _home(key, mask)
        while self._slots[i].node != NULL:
            if self._slots[i].key == key:
                return self._slots[i].node
            i = (i + 1) & mask
        if self._old != NULL:
            i = self._find_old(key)
            if i != <size_t>-1:
                return self._old[i].node
        return NULL

    cdef inline size_t _find_old(self, uint64_t key) noexcept:
        """The old table's slot of key, or (size_t)-1; the caller checks there is an old table."""
        cdef size_t mask = self._old_cap - 1
        cdef size_t i = _home(key, mask)
        cdef PyObject* p = self._old[i].node
        while p != NULL:
            if p != _TOMB and self._old[i].key == key:
                return i
            i = (i + 1) & mask
            p = self._old[i].node
        return <size_t>-1

    cdef PyObject* _put(self, uint64_t key, Node node, bint replace) except? NULL:
        """Index key -> node; returns the node it had (replaced when `replace`, else kept), or NULL if new."""
        cdef size_t mask, i
        cdef PyObject* old
        if self._old != NULL:
            i = self._find_old(key)
            if i != <size_t>-1:
                old = self._old[i].node
                if replace:
                    self._old[i].node = <PyObject*>node
                return old
        if self._must_grow(1):
            self._grow()
        mask = self._cap - 1
        i = _home(key, mask)
        while self._slots[i].node != NULL:
            if self._slots[i].key == key:
                old = self._slots[i].node
                if replace:
                    self._slots[i].node = <PyObject*>node
                return old
            i = (i + 1) & mask
        self._slots[i].key = key
        self._slots[i].node = <PyObject*>node
        self._nidx += 1
        if self._old != NULL:
            self._migrate(_MIGRATE_PER_PUT)
        elif self._nidx * 10 > <Py_ssize_t>self._cap * 6 and self._next_cap <= self._cap:
            self._drop_next()  # a shrink's table, if any: the tree grew back
            self._prepare(self._cap * 2, True)
        return NULL

    cdef void _reserve(self, uint64_t* keys, Py_ssize_t n, bint adding) except *:
        """Before a run of n puts: when `adding` (new keys), grow the index now if the run would take it past its
        bound (`_must_grow`); prefetch the first keys' slots (`_prefetch_key` the rest, `_PREFETCH_AHEAD` ahead)."""
        cdef Py_ssize_t i
        while adding and self._must_grow(n + 1):
            self._grow()
        for i in range(n if n < _PREFETCH_AHEAD else _PREFETCH_AHEAD):
            _prefetch_key(self._slots, self._cap, self._old, self._old_cap, keys[i])

    cdef inline bint _must_grow(self, Py_ssize_t adding) noexcept:
        """Whether `adding` more entries take the index past load 0.7 (0.85 while the next table's pages are still
        being faulted in: inserts then probe a little longer, rather than wait for the pages)."""
        cdef Py_ssize_t n = self._nidx + adding
        if n * 10 <= <Py_ssize_t>self._cap * 7:
            return False
        return (self._toucher is None or self._next_cap <= self._cap or self._toucher.done()
                or n * 20 > <Py_ssize_t>self._cap * 17)

    cdef int _prepare(self, size_t cap, bint touch) except -1:
        """Map the next table, of `cap` slots; from 2 MiB up and when `touch`, start a thread faulting its pages in
        (the kernel zeroes each)."""
        cdef size_t size = cap * sizeof(_Slot)
        self._next = <_Slot*>sy_table_alloc(size)
        if self._next == NULL:
            raise MemoryError()
        self._next_cap = cap
        if touch and size >= _HUGE:
            self._toucher = _PageToucher.start(<char*>self._next, size)
        return 0

    cdef void _drop_next(self) noexcept:
        """Unmap the next table, if any (its page-faulting thread stopped first: it writes to it)."""
        if self._toucher is not None:
            self._toucher.stop()
            self._toucher = None
        sy_table_free(self._next, self._next_cap * sizeof(_Slot))
        self._next, self._next_cap = NULL, 0

    cdef int _switch(self) except -1:
        """Start moving the index into the next table: finish a move still under way, wait for the next table's
        pages, then read both tables until `_migrate` has emptied the old one."""
        if self._old != NULL:
            self._migrate(self._old_cap)
        if self._toucher is not None:
            self._toucher.stop()
            self._toucher = None
        self._old, self._old_cap, self._mig, self._old_n = self._slots, self._cap, 0, self._nidx
        self._slots, self._cap = self._next, self._next_cap
        self._next, self._next_cap = NULL, 0
        return 0

    cdef int _grow(self) except -1:
        """Move into a table twice the size (`_switch`): the one mapped at load 0.6, its pages faulted in long
        before unless puts came faster than the faults; mapped here if not (or if the next one was a shrink's)."""
        if self._next_cap <= self._cap:
            self._drop_next()
            self._prepare(self._cap * 2, False)
        return self._switch()

    cdef void _migrate(self, size_t budget) noexcept:
        """Move the old table's next `budget` slots into the new one (freeing it once empty), prefetching the new
        homes of the entries `_PREFETCH_AHEAD` slots on (this call's or the next's)."""
        cdef size_t mask = self._cap - 1, end = self._mig + budget, i, j, k
        cdef _Slot* old = self._old
        if end > self._old_cap or end < self._mig:
            end = self._old_cap
        for i in range(self._mig, end):
            k = i + <size_t>_PREFETCH_AHEAD
            if k < self._old_cap and old[k].node != NULL and old[k].node != _TOMB:
                _prefetch(&self._slots[_home(old[k].key, mask)])
            if old[i].node != NULL and old[i].node != _TOMB:
                j = _home(old[i].key, mask)
                while self._slots[j].node != NULL:
                    j = (j + 1) & mask
                self._slots[j] = old[i]
                old[i].node = _TOMB
                self._old_n -= 1
        self._mig = end
        if self._mig == self._old_cap or self._old_n == 0:
            sy_table_free(old, self._old_cap * sizeof(_Slot))
            self._old, self._old_cap, self._mig, self._old_n = NULL, 0, 0, 0

    cdef void _del(self, uint64_t key) noexcept:
        """Remove key (absent: nothing): in the new table, shifting back the entries of its probe run (no
        tombstones); in the old one, a tombstone (its slots below the cursor are moved already)."""
        cdef size_t mask = self._cap - 1
        cdef size_t i = _home(key, mask), j, k
        if self._old != NULL:
            j = self._find_old(key)
            if j != <size_t>-1:
                self._old[j].node = _TOMB
                self._old_n -= 1
                self._nidx -= 1
                return
        while self._slots[i].node != NULL and self._slots[i].key != key:
            i = (i + 1) & mask
        if self._slots[i].node == NULL:
            return
        j = i
        while True:
            j = (j + 1) & mask
            if self._slots[j].node == NULL:
                break
            k = _home(self._slots[j].key, mask)
            # the entry at j may move to the hole at i unless its home lies cyclically in (i, j]
            if (i <= j and i < k <= j) or (i > j and (k > i or k <= j)):
                continue
            self._slots[i] = self._slots[j]
            i = j
        self._slots[i].node = NULL
        self._nidx -= 1

    # ---- slots ---------------------------------------------------------------------------------------------

    cdef int _slot(self, object worker, bint create) except -2:
        cdef object s = self._worker_to_slot.get(worker)
        cdef int i
        if s is not None:
            return <int>s
        if not create:
            return -1
        for i in range(_NW + 1):
            if i == _NW:
                raise RuntimeError(f"more than {<int>_MAX_SLOTS} workers hold state in the radix tree")
            if self._used_mask[i] != <uint64_t>-1:
                break
        if i >= self._nw:
            self._nw = i + 1
        i = (i << 6) | _ctz(~self._used_mask[i])
        _mset(self._used_mask, i)
        self._slot_names[i] = worker
        self._worker_to_slot[worker] = i
        return i

    cdef int _release_if_unused(self, int s) except -1:
        if s >= 0 and self._slot_refs[s] == 0 and _mtest(self._used_mask, s):
            del self._worker_to_slot[self._slot_names[s]]
            self._slot_names[s] = None
            _mclear(self._used_mask, s)
            while self._nw and not self._used_mask[self._nw - 1]:
                self._nw -= 1
        return 0

    cdef int _set_resident(self, Node node, int s, uint32_t d) except -1:
        cdef int delta = _set_run(node, s, d)
        if delta:
            self._slot_refs[s] += delta
            if delta < 0 and not _many(node._res_mask):
                self._candidate(node)
        return 0

    cdef int _candidate(self, Node node) except -1:
        """`node` may have become one with no children and no resident worker: queue it for gc."""
        cdef object b
        cdef list got
        if not node._gc_queued:
            node._gc_queued = True
            b = <long long>floor(node.last_access)
            got = self._dead.get(b)
            if got is None:
                self._dead[b] = [node]
            else:
                got.append(node)
        return 0

    # ---- nodes ---------------------------------------------------------------------------------------------

    cdef Node _new_node(self, uint64_t* blocks, Py_ssize_t n, Py_ssize_t context, Node parent, double now):
        cdef Node node = Node.__new__(Node)
        if n:
            node._blocks = <uint64_t*>PyMem_Malloc(n * sizeof(uint64_t))
            if node._blocks == NULL:
                raise MemoryError()
            if blocks != NULL:
                memcpy(node._blocks, blocks, n * sizeof(uint64_t))
        node._n = n
        node.context_blocks = context
        node._parent = parent
        node._children = {}
        node._names = self._slot_names
        node.last_access = now
        node.stats = None
        node.is_attached = True
        node.seq = self._next_seq
        self._next_seq += 1
        return node

    cpdef list nodes(self):
        """Every node, pre-order (a parent before its children; children in insertion order)."""
        cdef list out = []
        cdef list stack = list(reversed(list(self._root._children.values())))
        cdef Node node
        while stack:
            node = <Node>stack.pop()
            out.append(node)
            if node._children:
                stack.extend(reversed(list(node._children.values())))
        return out

    @property
    def num_nodes(self):
        return self._num_nodes

    @property
    def num_blocks(self):
        return self._nidx

    @property
    def growing(self):
        """Whether the block index is moving into another table, larger or smaller (this build only, for tests)."""
        return self._old != NULL

    @property
    def index_bytes(self):
        """The block index's tables as mapped now: the current one, a table being emptied into it, the next one."""
        return (self._cap + self._old_cap + self._next_cap) * sizeof(_Slot)

    def node_of(self, block_hash):
        cdef uint64_t h
        cdef PyObject* p
        if not _as_u64(block_hash, &h):
            return None
        p = self._get(h)
        if p == NULL:
            return None
        return (<object>p, _offset(<Node>p, h))

    def runs_of(self, block_hashes):
        """See radix_py: (node, i, j) per maximal run of positions in one node. A block next to the previous one
        in its node (a KV event's chain, tail or head first) costs two compares, not a dict lookup."""
        cdef object seq = _fast_seq(block_hashes)
        cdef Py_ssize_t n = PySequence_Fast_GET_SIZE(seq), i, start = 0, end = -1
        cdef PyObject** items = PySequence_Fast_ITEMS(seq)
        cdef list out = []
        cdef object last = None, p
        cdef uint64_t h
        cdef Py_ssize_t off = -1
        cdef PyObject* q
        for i in range(n):
            if not _as_u64(<object>items[i], &h):
                continue
            if end == i:  # the block next to the previous one in its node: a chain, tail or head first
                if off > 0 and (<Node>last)._blocks[off - 1] == h:
                    off -= 1
                    end = i + 1
                    continue
                if off + 1 < (<Node>last)._n and (<Node>last)._blocks[off + 1] == h:
                    off += 1
                    end = i + 1
                    continue
            q = self._get(h)
            if q == NULL:
                continue
            p = <object>q
            if p is last and end == i:
                end = i + 1
            else:
                if last is not None:
                    out.append((last, start, end))
                last, start, end = p, i, i + 1
            off = _offset(<Node>p, h)
        if last is not None:
            out.append((last, start, end))
        return out

    cdef inline void _reshaped(self) noexcept:
        """A node's span or links changed: no earlier walk holds (`_walk`'s memo)."""
        self._shape += 1
        self._walk_seq = None
        self._walk_path = None

    cdef Py_ssize_t _walk(self, object seq, list path, Py_ssize_t* last_m, bint strict=False) except -1:
        """Append the matched nodes of `seq` (`_fast_seq`'s) to path; returns the matched blocks, *last_m = those of
        the last node. `strict`: also stop at a child's first hash that is not a uint64 (a float equal to an int
        finds its child), so `insert` converts, and refuses, every hash it did not walk.

        NOTE: a dispatch walks the prompt its select walked (E2: `match_cached`, then `insert`; a video-QA prompt
        is ~1,500 blocks: 2.7 µs a warm walk, 0.1 µs from the memo), so the last walk of a tuple is kept and
        answers a walk of the same tuple object until the tree's shape changes (`_reshaped`). Exact: a tuple and
        its ints are immutable, the memo holds the tuple (its address is not reused), and a walk reads only spans
        and links. A non-strict walk answers a strict one once each path node's first hash is checked (the only
        hashes the strict test adds; `chained`, the hashes inside a node that a walk does not read are the
        promise's); a strict walk answers only strict ones (it may stop where a non-strict one goes on).
        """
        cdef PyObject** items = PySequence_Fast_ITEMS(seq)
        cdef Py_ssize_t n = PySequence_Fast_GET_SIZE(seq)
        cdef Node node = self._root
        cdef Node child
        cdef Py_ssize_t i = 0, m = 0, j, pos
        cdef uint64_t v
        cdef bint memo = PyTuple_CheckExact(seq)
        if memo and seq is self._walk_seq and self._walk_shape == self._shape and (strict or not self._walk_strict):
            if strict and not self._walk_strict:
                pos = 0
                for j in range(PyList_GET_SIZE(self._walk_path)):
                    if not _as_u64(<object>items[pos], &v):
                        memo = False  # walk it, strictly
                        break
                    pos += (<Node>PyList_GET_ITEM(self._walk_path, j))._n
            if memo:
                path.extend(self._walk_path)
                last_m[0] = self._walk_last_m
                return self._walk_matched
        while i < n:
            if strict and not _as_u64(<object>items[i], &v):
                break
            c = node._children.get(<object>items[i])
            if c is None:
                break
            child = <Node>c
            if self.chained:
                m = _chain_run(items + i, child._blocks, child._n if child._n < n - i else n - i)
            else:
                m = 1
                while m < child._n and i + m < n:
                    if not _as_u64(<object>items[i + m], &v) or v != child._blocks[m]:
                        break
                    m += 1
            path.append(child)
            i += m
            if m < child._n:
                break
            node = child
        last_m[0] = m
        if memo:
            self._walk_seq = seq
            self._walk_shape = self._shape
            self._walk_path = list(path)
            self._walk_matched = i
            self._walk_last_m = m
            self._walk_strict = strict
        return i

    # ---- match ---------------------------------------------------------------------------------------------

    cdef void _runs(self, list path, Py_ssize_t last_m, Py_ssize_t* res_run, Py_ssize_t* asg_run):
        """Per slot in use, the leading run of the matched path's blocks it holds resident and assigned (0: none; a
        run, when recorded, is > 0): a run ends where its worker drops out of a node, or holds fewer of its blocks.
        Entries of slots not in use are left as they were (no caller reads them)."""
        cdef Py_ssize_t m, cum = 0, j, num_path = PyList_GET_SIZE(path)
        cdef uint64_t res_alive[_NW]
        cdef uint64_t asg_alive[_NW]
        cdef uint64_t bits, live
        cdef uint32_t d
        cdef int s, wi, nw = self._nw  # words past it are empty: every loop stops there
        cdef Node node
        for wi in range(nw):
            res_alive[wi] = asg_alive[wi] = bits = self._used_mask[wi]
            while bits:
                s = (wi << 6) | _ctz(bits)
                bits &= bits - 1
                res_run[s] = asg_run[s] = 0
        for j in range(num_path):
            node = <Node>PyList_GET_ITEM(path, j)
            m = last_m if j == num_path - 1 else node._n
            for wi in range(nw):
                if cum:
                    bits = res_alive[wi] & ~node._res_mask[wi]
                    while bits:
                        s = (wi << 6) | _ctz(bits)
                        bits &= bits - 1
                        res_run[s] = cum
                res_alive[wi] &= node._res_mask[wi]
                live = res_alive[wi]
                while live:
                    s = (wi << 6) | _ctz(live)
                    live &= live - 1
                    d = _run(node, s)
                    if d < m:
                        res_alive[wi] &= ~_bit(s & 63)
                        res_run[s] = cum + d  # d > 0: the bit is set only for runs > 0
                # Assigned: all-or-nothing per node.
                if cum:
                    bits = asg_alive[wi] & ~node._asg_mask[wi]
                    while bits:
                        s = (wi << 6) | _ctz(bits)
                        bits &= bits - 1
                        asg_run[s] = cum
                asg_alive[wi] &= node._asg_mask[wi]
            cum += m
        if cum:
            for wi in range(nw):
                bits = res_alive[wi]
                while bits:
                    s = (wi << 6) | _ctz(bits)
                    bits &= bits - 1
                    res_run[s] = cum
                bits = asg_alive[wi]
                while bits:
                    s = (wi << 6) | _ctz(bits)
                    bits &= bits - 1
                    asg_run[s] = cum

    def walk(self, block_hashes):
        """See radix_py."""
        cdef object seq = _fast_seq(block_hashes)
        cdef Py_ssize_t last_m = 0
        cdef list path = []
        cdef Py_ssize_t matched = self._walk(seq, path, &last_m)
        return path, matched

    def match(self, block_hashes):
        cdef object seq = _fast_seq(block_hashes)
        cdef Py_ssize_t n = PySequence_Fast_GET_SIZE(seq)
        cdef Py_ssize_t last_m = 0, j
        cdef list path = []
        cdef MatchResult res = MatchResult.__new__(MatchResult)
        cdef dict resident = {}
        cdef dict assigned = {}
        cdef list names = self._slot_names
        cdef Py_ssize_t res_run[_MAX_SLOTS]
        cdef Py_ssize_t asg_run[_MAX_SLOTS]
        cdef uint64_t used
        cdef int s, wi
        cdef Node node
        cdef object key = None
        res.matched_blocks = self._walk(seq, path, &last_m)
        for j in range(PyList_GET_SIZE(path)):
            node = <Node>PyList_GET_ITEM(path, j)
            if node._n > node.context_blocks:
                key = node
        self._runs(path, last_m, res_run, asg_run)
        for wi in range(self._nw):
            used = self._used_mask[wi]
            while used:
                s = (wi << 6) | _ctz(used)
                used &= used - 1
                if res_run[s]:
                    resident[names[s]] = res_run[s]
                if asg_run[s]:
                    assigned[names[s]] = asg_run[s]
        res.path = path
        res.resident_blocks = resident
        res.assigned_blocks = assigned
        res.key_node = key
        return res

    def match_cached(self, block_hashes, workers, evicted):
        """(per worker of `workers`: max(resident run, assigned run cut at its first block in evicted[worker]),
        the largest of those, the matched path): `match` plus E2's per-worker reconciliation, with the runs kept in per-slot C arrays
        instead of result dicts (see radix_py)."""
        cdef object seq = _fast_seq(block_hashes)
        cdef Py_ssize_t n = PySequence_Fast_GET_SIZE(seq)
        cdef PyObject** items = PySequence_Fast_ITEMS(seq)
        cdef Py_ssize_t last_m = 0, k
        cdef list path = []
        cdef dict cached = {}
        cdef Py_ssize_t res_run[_MAX_SLOTS]
        cdef Py_ssize_t asg_run[_MAX_SLOTS]
        cdef int s
        cdef Py_ssize_t r, a, best = 0
        cdef object sl, ev
        cdef uint64_t h
        self._walk(seq, path, &last_m)
        self._runs(path, last_m, res_run, asg_run)
        for w in workers:
            sl = self._worker_to_slot.get(w)
            if sl is None:
                cached[w] = 0
                continue
            s = sl
            r = res_run[s]
            a = asg_run[s]
            if a > r:
                ev = evicted.get(w)
                if type(ev) is BlockSet:
                    if (<BlockSet>ev)._n:
                        for k in range(r, a):
                            if _as_u64(<object>items[k], &h) and (<BlockSet>ev)._find(h) >= 0:
                                a = k
                                break
                elif ev:
                    for k in range(r, a):
                        if <object>items[k] in ev:
                            a = k
                            break
            if a > r:
                r = a
            cached[w] = r
            if r > best:
                best = r
        return cached, best, path

    @staticmethod
    def key_portion(path, Py_ssize_t upto, bint study):
        """Preble's key portion of `path` clipped to `upto` blocks: (node or None, its end in blocks)."""
        cdef Node node
        cdef Node best = None
        cdef Py_ssize_t start, nb, end = 0, best_n = 0
        for node in path:
            start = node.context_blocks
            if start >= upto:
                break
            nb = node._n if node._n < upto - start else upto - start
            if (nb > start) if study else (nb > best_n):
                best, end, best_n = node, start + nb, nb
        return best, end

    # ---- structure -----------------------------------------------------------------------------------------

    cdef Node _split(self, Node node, Py_ssize_t k):
        """Split node after its first k blocks (0 < k < n); returns the new upper half."""
        cdef Node upper = self._new_node(node._blocks, k, node.context_blocks, node._parent, node.last_access)
        cdef uint64_t bits
        cdef uint64_t res[_NW]
        cdef int s, wi
        cdef uint32_t d
        cdef Py_ssize_t i
        for wi in range(_NW):
            upper._evf_mask[wi] = node._evf_mask[wi]
            upper._asg_mask[wi] = bits = node._asg_mask[wi]
            while bits:
                s = (wi << 6) | _ctz(bits)
                bits &= bits - 1
                self._slot_refs[s] += 1
        memcpy(res, node._res_mask, sizeof(res))  # the loop changes node's mask
        for wi in range(_NW):
            bits = res[wi]
            while bits:
                s = (wi << 6) | _ctz(bits)
                bits &= bits - 1
                d = _run(node, s)
                self._set_resident(upper, s, d if d < <uint32_t>k else <uint32_t>k)
                self._set_resident(node, s, d - <uint32_t>k if d > <uint32_t>k else 0)
        memmove(node._blocks, node._blocks + k, (node._n - k) * sizeof(uint64_t))
        node._n -= k
        node.context_blocks += k
        node._parent._children[PyLong_FromUnsignedLongLong(upper._blocks[0])] = upper
        upper._children[PyLong_FromUnsignedLongLong(node._blocks[0])] = node
        node._parent = upper
        self._reshaped()
        self._reserve(upper._blocks, k, False)  # replacements: no new slots
        for i in range(k):
            if i + _PREFETCH_AHEAD < k:
                _prefetch_key(self._slots, self._cap, self._old, self._old_cap, upper._blocks[i + _PREFETCH_AHEAD])
            self._put(upper._blocks[i], upper, True)
        self._num_nodes += 1
        return upper

    cdef Node _position_end(self, Node node, Py_ssize_t off):
        if off + 1 < node._n:
            return self._split(node, off + 1)
        return node

    cdef object _add_leaf(self, Node parent, uint64_t* blocks, PyObject** keys, Py_ssize_t n, double now):
        """Hang blocks under parent, cut at the first hash already in the tree; None when that is the first.

        `keys`: the caller's int objects for `blocks` (checked by `_to_buffer`); the first keys the parent's
        children. One set-if-absent per block: a hash already indexed (elsewhere, or a repeat inside the run,
        which maps to this leaf already) ends the leaf.
        """
        cdef Node leaf = self._new_node(blocks, n, parent.context_blocks + parent._n, parent, now)
        cdef Py_ssize_t r = 0
        self._reserve(blocks, n, True)
        while r < n:
            if r + _PREFETCH_AHEAD < n:
                _prefetch_key(self._slots, self._cap, self._old, self._old_cap, blocks[r + _PREFETCH_AHEAD])
            if self._put(blocks[r], leaf, False) != NULL:
                break
            r += 1
        if r == 0:
            leaf._parent = None
            leaf.is_attached = False
            self._next_seq -= 1  # the reference numbers only the leaves it hangs
            return None
        leaf._n = r
        parent._children[<object>keys[0]] = leaf
        self._reshaped()
        self._num_nodes += 1
        return leaf

    cdef uint64_t* _to_buffer(self, PyObject** items, Py_ssize_t n) except NULL:
        cdef uint64_t* buf = <uint64_t*>PyMem_Malloc((n + 1) * sizeof(uint64_t))
        cdef Py_ssize_t i
        if buf == NULL:
            raise MemoryError()
        for i in range(n):
            if not _as_u64(<object>items[i], &buf[i]):
                PyMem_Free(buf)
                raise ValueError(f"block hash {<object>items[i]!r} is not a uint64")
        return buf

    def insert(self, block_hashes, double now):
        cdef object seq = _fast_seq(block_hashes)
        cdef Py_ssize_t n = PySequence_Fast_GET_SIZE(seq)
        cdef PyObject** items = PySequence_Fast_ITEMS(seq)
        cdef list path = []
        cdef Py_ssize_t last_m = 0, j, num_path
        cdef Node under, node
        # NOTE: only the unmatched tail is converted (a video-QA prompt is ~1,500 blocks, nearly all matched): the
        # strict walk stops at the first hash that is not a uint64, so one raises here, before the tree changes.
        cdef Py_ssize_t matched = self._walk(seq, path, &last_m, True)
        cdef uint64_t* buf = self._to_buffer(items + matched, n - matched)
        try:
            # NOTE: wraparound is off in this module: index with len - 1, never -1.
            num_path = PyList_GET_SIZE(path)
            under = self._root
            if num_path:
                under = <Node>path[num_path - 1]
                if last_m < under._n:
                    under = self._split(under, last_m)
                    path[num_path - 1] = under
            if matched < n:
                leaf = self._add_leaf(under, buf, items + matched, n - matched, now)
                if leaf is not None:
                    path.append(leaf)
                    self._candidate(<Node>leaf)  # resident nowhere yet
        finally:
            PyMem_Free(buf)
        for j in range(PyList_GET_SIZE(path)):
            node = <Node>PyList_GET_ITEM(path, j)
            if now > node.last_access:
                node.last_access = now
        return path

    # ---- assignment (optimistic) ---------------------------------------------------------------------------

    def assign(self, path, worker, double now):
        cdef int s = -1
        cdef Node node
        try:
            for obj in path:
                node = <Node?>obj
                if not node.is_attached:
                    continue
                if s < 0:
                    s = self._slot(worker, True)
                if not _mtest(node._asg_mask, s):
                    _mset(node._asg_mask, s)
                    self._slot_refs[s] += 1
                if now > node.last_access:
                    node.last_access = now
        finally:
            self._release_if_unused(s)

    def unassign_worker(self, worker):
        cdef int s = self._slot(worker, False)
        cdef Node node
        if s < 0:
            return
        for obj in self.nodes():
            node = <Node>obj
            if _mtest(node._asg_mask, s):
                _mclear(node._asg_mask, s)
                _mclear(node._evf_mask, s)
                self._slot_refs[s] -= 1
        self._release_if_unused(s)

    def note_evictions(self, obj, worker):
        """See radix_py."""
        cdef Node node = <Node?>obj
        cdef int s = self._slot(worker, False)
        if s < 0 or not _mtest(node._asg_mask, s):
            return False
        _mset(node._evf_mask, s)
        return True

    # ---- KV events -----------------------------------------------------------------------------------------

    def mark_resident(self, worker, block_hashes, parent_hash, double now):
        cdef object seq = _fast_seq(block_hashes)
        cdef Py_ssize_t n = PySequence_Fast_GET_SIZE(seq)
        cdef uint64_t* buf = self._to_buffer(PySequence_Fast_ITEMS(seq), n)
        cdef Node prev = None, node, under
        cdef Py_ssize_t prev_off = -1, off, i
        cdef uint64_t ph
        cdef int s = -1
        cdef PyObject* q
        try:
            if parent_hash is not None:
                q = self._get(ph) if _as_u64(parent_hash, &ph) else NULL
                if q == NULL:
                    return  # unknown parent: ignored (a snapshot replays parents first)
                prev = <Node>q
                prev_off = _offset(prev, ph)
            for i in range(n):
                if prev is not None and prev_off + 1 < prev._n and prev._blocks[prev_off + 1] == buf[i]:
                    node = prev  # the common case: the next block of the same node
                    off = prev_off + 1
                else:
                    q = self._get(buf[i])
                    if q == NULL:  # unknown from here on: one new leaf right after prev
                        under = self._root if prev is None else self._position_end(prev, prev_off)
                        node = <Node>self._add_leaf(under, buf + i, PySequence_Fast_ITEMS(seq) + i, n - i, now)
                        off = 0
                    else:
                        node = <Node>q
                        off = _offset(node, buf[i])
                if s < 0:
                    s = self._slot(worker, True)
                if _run(node, s) == off:  # the block right after the leading run extends it
                    self._set_resident(node, s, <uint32_t>(off + 1))
                prev = node
                prev_off = off
        finally:
            PyMem_Free(buf)
            self._release_if_unused(s)

    def mark_evicted(self, worker, block_hashes):
        """See radix_py. A block next to the previous one in its node (an event lists a chain, tail or head
        first) is found without a lookup or an offset scan."""
        cdef int s = self._slot(worker, False)
        cdef uint64_t h
        cdef Node node, prev = None
        cdef Py_ssize_t off, prev_off = -1
        cdef uint32_t d
        cdef PyObject* q
        if s < 0:
            return
        for item in block_hashes:
            if not _as_u64(item, &h):
                continue
            if prev is not None and prev_off > 0 and prev._blocks[prev_off - 1] == h:
                node, off = prev, prev_off - 1
            elif prev is not None and prev_off + 1 < prev._n and prev._blocks[prev_off + 1] == h:
                node, off = prev, prev_off + 1
            else:
                q = self._get(h)
                if q == NULL:
                    continue
                node = <Node>q
                off = -1
            d = _run(node, s)
            if d == 0:
                prev = None  # nothing to cut here: skip the offset scan
                continue
            if off < 0:
                off = _offset(node, h)
            if <Py_ssize_t>d > off:
                self._set_resident(node, s, <uint32_t>off)
            prev, prev_off = node, off
        self._release_if_unused(s)

    def clear_worker(self, worker):
        cdef int s = self._slot(worker, False)
        cdef Node node
        if s < 0:
            return
        for obj in self.nodes():
            node = <Node>obj
            self._set_resident(node, s, 0)
        self._release_if_unused(s)

    def remove_worker(self, worker):
        self.clear_worker(worker)
        self.unassign_worker(worker)

    # ---- garbage collection --------------------------------------------------------------------------------

    def gc(self, double now, double window_s, budget_blocks=None, list removed_out=None, dict evicted=None):
        """See radix_py: the queued candidates of the buckets old enough, not every node; a `BlockSet` in
        `evicted` is pruned in C, straight from the node's blocks."""
        cdef Py_ssize_t i, j, removed = 0, freed = 0, visited = 0
        cdef Py_ssize_t budget = -1 if budget_blocks is None else max(0, <Py_ssize_t>budget_blocks)
        cdef Node node, parent
        cdef uint64_t bits
        cdef size_t mask
        cdef int s, wi
        cdef dict dead = self._dead
        cdef list young = [], bucket
        while dead:
            b = min(dead)
            if not now - <double>b > window_s:  # (the reference says why this bound is exact)
                break
            bucket = dead.pop(b)
            for i in range(PyList_GET_SIZE(bucket)):
                if budget >= 0 and freed + visited >= budget:
                    # still flagged queued, in order; in place: a copy of the rest touched every node's refcount
                    # (a cache miss each: ~4 ms for the ~40k nodes of a burst's second)
                    del bucket[:i]
                    more = dead.get(b)
                    if more:
                        bucket.extend(more)
                    dead[b] = bucket
                    break
                node = <Node>PyList_GET_ITEM(bucket, i)
                visited += 1
                node._gc_queued = False
                if not node.is_attached or node._children or _many(node._res_mask):
                    continue
                if not (now - node.last_access > window_s):
                    young.append(node)
                    continue
                parent = node._parent
                del parent._children[PyLong_FromUnsignedLongLong(node._blocks[0])]
                self._reshaped()
                self._reserve(node._blocks, node._n, False)  # deletions never grow the index
                for j in range(node._n):
                    if j + _PREFETCH_AHEAD < node._n:
                        _prefetch_key(
                            self._slots, self._cap, self._old, self._old_cap, node._blocks[j + _PREFETCH_AHEAD]
                        )
                    self._del(node._blocks[j])
                if removed_out is not None and _many(node._asg_mask):
                    removed_out.append((node.blocks, node.assigned))
                if evicted:
                    self._prune_evicted(node, evicted)
                for wi in range(_NW):
                    node._evf_mask[wi] = 0
                    bits = node._asg_mask[wi]
                    node._asg_mask[wi] = 0
                    while bits:
                        s = (wi << 6) | _ctz(bits)
                        bits &= bits - 1
                        self._slot_refs[s] -= 1
                        self._release_if_unused(s)
                node.is_attached = False
                node._parent = None
                self._num_nodes -= 1
                removed += 1
                freed += node._n
                if parent is not self._root and not parent._children and not _many(parent._res_mask):
                    self._candidate(parent)
            if budget >= 0 and freed + visited >= budget:
                break
        for obj in young:
            self._candidate(<Node>obj)
        self.gc_visits += visited
        self._settle()
        return removed

    cdef int _settle(self) except -1:
        """After a collection, give back the index memory a smaller tree no longer needs, in steps as a grow takes
        it: move on a shrink under way, or a grow's that collection left below load 0.3 (`_MIGRATE_PER_GC` old
        slots: a shrinking tree has few puts to carry a move); drop a grow's next table once the load falls below
        0.3 (it was mapped at 0.6); below load 0.1, map the smallest table that holds the entries at load 0.25 or
        less (its pages faulted in off this thread, as a grow's), and at a later collection, once they are in,
        move into it, unless the tree grew back meanwhile."""
        cdef size_t cap
        if self._old != NULL:
            if self._old_cap > self._cap or self._nidx * 10 < <Py_ssize_t>self._cap * 3:
                self._migrate(_MIGRATE_PER_GC)
            return 0
        cdef bint sparse = self._nidx * 10 < <Py_ssize_t>self._cap
        if self._next != NULL and self._next_cap > self._cap and self._nidx * 10 < <Py_ssize_t>self._cap * 3:
            self._drop_next()
        if self._next != NULL and self._next_cap < self._cap:
            if not sparse or self._nidx * 2 > <Py_ssize_t>self._next_cap:  # the tree grew back: past load 0.5 there
                self._drop_next()
            elif self._toucher is None or self._toucher.done():
                self._switch()
                self._migrate(_MIGRATE_PER_GC)
            return 0
        if self._next == NULL and sparse and self._cap > _MIN_SLOTS:
            cap = self._cap
            while cap > _MIN_SLOTS and self._nidx * 4 <= <Py_ssize_t>(cap // 2):
                cap //= 2
            try:
                self._prepare(cap, True)
            except MemoryError:
                pass  # the larger table still works: try again at the next collection
        return 0

    cdef int _prune_evicted(self, Node node, dict evicted) except -1:
        """Drop the node's blocks from evicted[w] for each worker w it is assigned to (before gc frees the slots)."""
        cdef uint64_t bits
        cdef int s, wi
        cdef Py_ssize_t j
        cdef object ev
        cdef BlockSet bs
        for wi in range(_NW):
            bits = node._asg_mask[wi]
            while bits:
                s = (wi << 6) | _ctz(bits)
                bits &= bits - 1
                ev = evicted.get(self._slot_names[s])
                if type(ev) is BlockSet:
                    bs = <BlockSet>ev
                    for j in range(node._n):
                        if not bs._n:
                            break
                        bs._remove(node._blocks[j])
                elif ev:
                    ev.difference_update(node.blocks)
        return 0

    # ---- tests ---------------------------------------------------------------------------------------------

    def check_invariants(self):
        cdef Node node, parent
        cdef Py_ssize_t count = 0, blocks = 0, off
        cdef int64_t refs[_MAX_SLOTS]
        cdef int s, k, wi
        cdef uint64_t bits
        cdef size_t i
        cdef Py_ssize_t used, old_live
        for s in range(_MAX_SLOTS):
            refs[s] = 0
        for obj in self.nodes():
            node = <Node>obj
            count += 1
            parent = node._parent
            assert node.is_attached and parent is not None
            assert node._n >= 1
            assert parent._children.get(PyLong_FromUnsignedLongLong(node._blocks[0])) is node
            assert node.context_blocks == parent.context_blocks + parent._n
            for key, child in node._children.items():
                assert (<Node>child)._blocks[0] == <uint64_t>key and (<Node>child)._parent is node
            for off in range(node._n):
                assert self._get(node._blocks[off]) == <PyObject*>node
                assert _offset(node, node._blocks[off]) == off  # no duplicate hash inside a node
            assert node._runs_cap >= _mcount(node._res_mask)
            k = 0
            for wi in range(_NW):
                bits = node._res_mask[wi]
                while bits:
                    s = (wi << 6) | _ctz(bits)
                    bits &= bits - 1
                    assert 0 < node._runs[k] <= <uint32_t>node._n
                    assert _mtest(self._used_mask, s)
                    refs[s] += 1
                    k += 1
                assert node._evf_mask[wi] & ~node._asg_mask[wi] == 0  # evictions within assigned
                bits = node._asg_mask[wi]
                while bits:
                    s = (wi << 6) | _ctz(bits)
                    bits &= bits - 1
                    assert _mtest(self._used_mask, s)
                    refs[s] += 1
            blocks += node._n
        assert count == self._num_nodes
        assert blocks == self._nidx
        used = 0
        for i in range(self._cap):  # every slot: an attached node holding its key, reachable from its home
            assert self._slots[i].node != _TOMB
            if self._slots[i].node != NULL:
                used += 1
                node = <Node>self._slots[i].node
                assert node.is_attached and _offset(node, self._slots[i].key) >= 0
                assert self._get(self._slots[i].key) == self._slots[i].node
        if self._old != NULL:  # a grow under way: the old table's live entries lie past the cursor, in neither twice
            old_live = 0
            for i in range(self._old_cap):
                if self._old[i].node != NULL and self._old[i].node != _TOMB:
                    assert i >= self._mig
                    old_live += 1
                    node = <Node>self._old[i].node
                    assert node.is_attached and _offset(node, self._old[i].key) >= 0
                    assert self._find_old(self._old[i].key) == i
                    assert self._get(self._old[i].key) == self._old[i].node
            assert old_live == self._old_n > 0 and self._mig < self._old_cap
            used += old_live
        else:
            assert self._old_cap == self._mig == self._old_n == 0
        assert self._toucher is None or self._next != NULL
        assert (self._next == NULL) == (self._next_cap == 0) and self._next_cap != self._cap
        assert self._cap >= _MIN_SLOTS and self._cap & (self._cap - 1) == 0
        assert used == self._nidx and self._nidx * 20 <= <Py_ssize_t>self._cap * 17
        for s in range(_MAX_SLOTS):
            assert refs[s] == self._slot_refs[s], (s, refs[s], self._slot_refs[s])
            if _mtest(self._used_mask, s):
                assert refs[s] > 0  # an unreferenced slot is released at once
                assert self._worker_to_slot[self._slot_names[s]] == s
            else:
                assert self._slot_names[s] is None
        assert len(self._worker_to_slot) == _mcount(self._used_mask)
        assert all(self._used_mask[i] == 0 for i in range(self._nw, _NW))
        assert self._nw == 0 or self._used_mask[self._nw - 1] != 0
