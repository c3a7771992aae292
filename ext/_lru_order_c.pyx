# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""Cython build of `lru_order_py.EvictionOrder`: the same order, step for step (its docstring is the contract).

Why a rewrite and not a compile of the reference: the reference spends its time in the calls of each step (heap,
dict, tuple), which a plain Cython compile keeps. Here the frontier over the index's heap array is a C binary heap
of (last_access, seq, position), the index's tables are read with the dict C API, and ids are pointer values
(`id()` is `PyLong_FromVoidPtr`).
"""

cimport cython
from cpython.dict cimport PyDict_Contains, PyDict_GetItem, PyDict_Next, PyDict_SetItem
from cpython.list cimport PyList_GET_ITEM
from cpython.long cimport PyLong_FromVoidPtr
from cpython.mem cimport PyMem_Free, PyMem_Malloc, PyMem_Realloc
from cpython.pycapsule cimport PyCapsule_New
from cpython.ref cimport PyObject
from cpython.set cimport PySet_Add, PySet_Contains
from cpython.tuple cimport PyTuple_GET_ITEM

from libc.math cimport INFINITY, floor

include "_profile_cost.pxi"  # _prefill_s

import heapq
from heapq import heapify as _heapify, heappop as _heappop, heappush as _heappush

from switchyard.ext.lru_order_py import COLD_BUCKETS_PER_S, cold_bucket as _py_cold_bucket


cdef extern from "Python.h":
    void PyObject_GC_UnTrack(void* op)


cdef inline list _untracked(list heap):
    """`heap`, out of the cyclic collector's sight.

    NOTE: why: a full collection traverses every element of a tracked list, and each heap holds an entry per
    candidate node (~110k in all at 100k preloaded nodes): that walk was ~7 ms of each full collection, on the
    daemon's event loop (ext/README.md, "radix"). Safe: an entry is (last access, seq, node), and nothing a node
    holds refers back to an index or its heap (the tree's nodes are `no_gc`; a policy's `node.stats` must not
    refer to nodes or trees), so no cycle can pass through the list; what its entries reference stays reachable
    from it, as it is. A list assigned from Python is tracked as usual (only slower to collect)."""
    PyObject_GC_UnTrack(<void*>heap)
    return heap


cdef tuple _NO_TERM = (None, 0.0, 0.0, None)  # a `price` term that adds nothing (`hot_victims`' walk)


cdef enum:
    RETIRED_CAP = 1024  # as the reference's
    MEMO_CAP = 4096
    _STACK_PROTECTED = 16  # `_span`'s arrays on the stack up to this many protected ids (a path's nodes)


cdef (Py_ssize_t*, long long*) _protected_arrays(Py_ssize_t n) except *:
    """`_span`'s two arrays on the heap, for a path longer than `_STACK_PROTECTED` (freed with `PyMem_Free`)."""
    cdef Py_ssize_t* at = <Py_ssize_t*>PyMem_Malloc(n * sizeof(Py_ssize_t))
    cdef long long* pcum = <long long*>PyMem_Malloc(n * sizeof(long long))
    if at == NULL or pcum == NULL:
        PyMem_Free(at)
        PyMem_Free(pcum)
        raise MemoryError()
    return at, pcum


cdef inline bint _before(double la, long long seq, Py_ssize_t pos,
                         double la2, long long seq2, Py_ssize_t pos2) noexcept:
    """(la, seq, pos) < (la2, seq2, pos2): the reference's frontier tuples' order."""
    if la != la2:
        return la < la2
    if seq != seq2:
        return seq < seq2
    return pos < pos2


@cython.final  # its cpdef methods are called from `LruIndexCore` without an override check
cdef class EvictionOrder:
    cdef readonly object idx, worker, stats_type
    cdef readonly list steps, cum, hot, array, extra
    cdef readonly dict unlocked, local_held, pos, memo, facts
    cdef readonly set done
    cdef dict _keyed, _entries, _held
    cdef double* _f_la
    cdef long long* _f_seq
    cdef Py_ssize_t* _f_pos
    cdef Py_ssize_t _f_n, _f_cap
    # the frontier's last popped (key, seq, position) and the largest (key, seq) of the steps (`pushed`)
    cdef double _lp_la, _mk_la
    cdef long long _lp_seq, _mk_seq
    cdef Py_ssize_t _lp_pos
    cdef bint _lp_set, _mk_set
    cdef readonly bint stale
    # per step, its whole take's term as `memo` holds it under (id, blocks), or None (`_price`)
    cdef list _whole
    # the memo's and the facts' size at which each starts over (MEMO_CAP; a test sets it small, as the reference's
    # module constant)
    cdef public Py_ssize_t memo_cap
    cdef readonly list retired
    cdef readonly Py_ssize_t base  # step numbers and cum's offset, as the reference's
    cdef readonly long long cum_base

    def __cinit__(self):
        self._f_la = NULL
        self._f_seq = NULL
        self._f_pos = NULL
        self._f_n = 0
        self._f_cap = 0
        self._lp_set = False
        self._mk_set = False
        self.stale = False
        self.memo_cap = MEMO_CAP
        self.retired = []
        self.base = 0
        self.cum_base = 0

    def __dealloc__(self):
        PyMem_Free(self._f_la)
        PyMem_Free(self._f_seq)
        PyMem_Free(self._f_pos)

    def __init__(self, idx, worker, stats_type):
        self.idx, self.worker, self.stats_type = idx, worker, stats_type
        self.steps = []
        self.cum = []
        self.hot = []
        self.memo = {}
        self._whole = []
        self.facts = {}
        self.extra = []
        self.unlocked = {}
        self.local_held = {}
        self.pos = {}
        self.done = set()
        # the index replaces none of these objects while an order lives, its heap array only through `rebased`
        self.array = idx.heap
        self._keyed = idx.keyed
        self._entries = idx.entries
        self._held = idx.held
        if self.array:
            self._push(0)

    @property
    def last_popped(self):
        return (self._lp_la, self._lp_seq, self._lp_pos) if self._lp_set else None

    @property
    def max_key(self):
        return (self._mk_la, self._mk_seq) if self._mk_set else None

    cpdef bint reached(self, k) except -1:
        """As the reference's: node k taken, unlocked, or a child of it counted."""
        return (PySet_Contains(self.done, k) or PyDict_GetItem(self.unlocked, k) != NULL
                or PyDict_GetItem(self.local_held, k) != NULL)

    cpdef bint pushed(self, tuple entry) except -1:
        """As the reference's: the steps hold after the index pushed `entry` (joined to the walk), or False."""
        cdef list array = self.array
        cdef Py_ssize_t p = len(array) - 1, q
        cdef double la = entry[0]
        cdef long long seq = entry[1]
        cdef tuple e
        cdef PyObject* got
        if self._mk_set and (la < self._mk_la or (la == self._mk_la and seq <= self._mk_seq)):
            got = PyDict_GetItem(self.unlocked, PyLong_FromVoidPtr(<void*>entry[2]))
            if got == NULL or <double>(<object>got) != la:
                return False
        if self.stale:
            return True
        if <object>PyList_GET_ITEM(array, p) is not entry:  # sifted toward the top: positions moved
            self.stale = True
            return True
        if self._lp_set and _before(la, seq, p, self._lp_la, self._lp_seq, self._lp_pos):
            self.stale = True  # popped now it would come after larger keys (the reference says why)
            return True
        q = (p - 1) // 2
        if p == 0:
            self._push(p)
        elif self._lp_set:
            e = <tuple>PyList_GET_ITEM(array, q)
            if not _before(self._lp_la, self._lp_seq, self._lp_pos, <double>e[0], <long long>e[1], q):
                self._push(p)  # its parent's children are in already
        return True

    cpdef rebased(self, list array):
        """As the reference's: the frontier is rebuilt from `array` before the next step."""
        self.array = array
        self.stale = True

    cdef int _rebase(self) except -1:
        """As the reference's: the positions past max_key whose parents are at or before it, by a C stack."""
        cdef list array = self.array
        cdef Py_ssize_t n = len(array), top = 0, p, c
        cdef Py_ssize_t* stack
        cdef tuple e
        cdef double la
        cdef long long seq
        self._f_n = 0
        if n:
            stack = <Py_ssize_t*>PyMem_Malloc(n * sizeof(Py_ssize_t))
            if stack == NULL:
                raise MemoryError()
            try:
                stack[0] = 0
                top = 1
                while top:
                    top -= 1
                    p = stack[top]
                    e = <tuple>PyList_GET_ITEM(array, p)
                    la = e[0]
                    seq = e[1]
                    if self._mk_set and (la < self._mk_la or (la == self._mk_la and seq <= self._mk_seq)):
                        c = 2 * p + 1
                        if c < n:
                            stack[top] = c
                            top += 1
                            if c + 1 < n:
                                stack[top] = c + 1
                                top += 1
                    else:
                        self._push(p)
            finally:
                PyMem_Free(stack)
        if self._mk_set:
            self._lp_la, self._lp_seq, self._lp_pos, self._lp_set = self._mk_la, self._mk_seq, n, True
        else:
            self._lp_set = False
        self.stale = False
        return 0

    cpdef bint first_resized(self, k, long long blocks) except -1:
        """As the reference's: the first step's node now holds `blocks` (0: it left); False when k is not it."""
        cdef list steps = self.steps
        cdef tuple first
        cdef long long d0
        cdef Py_ssize_t i
        if not steps or (<tuple>steps[0])[2] != k:
            return False
        first = <tuple>steps[0]
        d0 = first[1]
        if blocks:
            for key in [key for key in self.memo if (<tuple>key)[0] == k]:  # its terms change with its blocks
                del self.memo[key]
            self._whole[0] = None
            self.facts.pop(k, None)
            steps[0] = (first[0], blocks, k)
            self.cum_base += d0 - blocks
            return True
        if len(self.retired) >= RETIRED_CAP:
            return False
        self.retired.append(first[0])
        del steps[0]
        del self._whole[0]
        del self.cum[0]
        self.cum_base += d0
        del self.pos[k]
        if self.hot and <Py_ssize_t>self.hot[0] == self.base:
            del self.hot[0]
        self.base += 1
        return True

    # ------------------------------------------------------------------------------------------ frontier heap
    cdef int _push(self, Py_ssize_t p) except -1:
        cdef tuple e = <tuple>self.array[p]
        cdef double la = e[0]
        cdef long long seq = e[1]
        cdef Py_ssize_t i, parent, cap
        if self._f_n == self._f_cap:
            cap = self._f_cap * 2 if self._f_cap else 64
            self._f_la = <double*>PyMem_Realloc(self._f_la, cap * sizeof(double))
            self._f_seq = <long long*>PyMem_Realloc(self._f_seq, cap * sizeof(long long))
            self._f_pos = <Py_ssize_t*>PyMem_Realloc(self._f_pos, cap * sizeof(Py_ssize_t))
            if self._f_la == NULL or self._f_seq == NULL or self._f_pos == NULL:
                raise MemoryError()
            self._f_cap = cap
        i = self._f_n
        self._f_n += 1
        while i > 0:
            parent = (i - 1) >> 1
            if not _before(la, seq, p, self._f_la[parent], self._f_seq[parent], self._f_pos[parent]):
                break
            self._move(i, parent)
            i = parent
        self._put(i, la, seq, p)
        return 0

    cdef inline void _move(self, Py_ssize_t dst, Py_ssize_t src) noexcept:
        self._put(dst, self._f_la[src], self._f_seq[src], self._f_pos[src])

    cdef inline void _put(self, Py_ssize_t i, double la, long long seq, Py_ssize_t p) noexcept:
        self._f_la[i] = la
        self._f_seq[i] = seq
        self._f_pos[i] = p

    cdef Py_ssize_t _pop(self) noexcept:
        """The array position on top of the frontier (which must not be empty), removed."""
        cdef Py_ssize_t top = self._f_pos[0]
        cdef Py_ssize_t n = self._f_n - 1
        cdef double la = self._f_la[n]
        cdef long long seq = self._f_seq[n]
        cdef Py_ssize_t p = self._f_pos[n]
        cdef Py_ssize_t i = 0, c
        self._f_n = n
        if n == 0:
            return top
        while True:
            c = 2 * i + 1
            if c >= n:
                break
            if c + 1 < n and _before(self._f_la[c + 1], self._f_seq[c + 1], self._f_pos[c + 1],
                                     self._f_la[c], self._f_seq[c], self._f_pos[c]):
                c += 1
            if not _before(self._f_la[c], self._f_seq[c], self._f_pos[c], la, seq, p):
                break
            self._move(i, c)
            i = c
        self._put(i, la, seq, p)
        return top

    # ------------------------------------------------------------------------------------------ the order
    def at(self, Py_ssize_t i):
        """The i-th node to evict, or None when fewer remain."""
        while len(self.steps) <= i:
            if not self._step():
                return None
        return self.steps[i]

    def reach(self, long long blocks, Py_ssize_t max_steps=-1):
        """Simulate until the steps hold `blocks` resident blocks; False when the candidates ran out first, or
        when `max_steps` (if >= 0) more steps did not get there (a later call goes on from there)."""
        if max_steps < 0:
            return self._reach(blocks)
        while not self.cum or <long long>self.cum[len(self.cum) - 1] - self.cum_base < blocks:
            if max_steps == 0 or not self._step():
                return False
            max_steps -= 1
        return True

    cdef bint _reach(self, long long blocks) except -1:
        while not self.cum or <long long>self.cum[len(self.cum) - 1] - self.cum_base < blocks:  # (no [-1])
            if not self._step():
                return False
        return True

    cdef Py_ssize_t _span(self, long long need_blocks, set protected, Py_ssize_t* at, long long* pcum,
                          Py_ssize_t* n_out) except -2:
        """Where `_price`'s victims lie: simulates as far as the need, writes the protected steps' positions (sorted)
        into `at` and their running block counts into `pcum` (room for `len(protected)` each), their count into
        `n_out`; returns the step that completes the need, the last victim (-1: no step)."""
        cdef Py_ssize_t n_at = 0, prev_n, i, j, lo, hi, mid, n
        cdef long long extra
        cdef bint enough
        cdef PyObject* got
        cdef list steps = self.steps
        # simulate until the unprotected steps hold need_blocks; protected ones found on the way raise the
        # target until no new one turns up (positions only grow as the simulation goes on)
        while True:
            extra = 0
            for j in range(n_at):
                extra += <long long>(<tuple>steps[at[j]])[1]
            enough = self._reach(need_blocks + extra)
            prev_n = n_at
            n_at = 0
            for k in protected:
                got = PyDict_GetItem(self.pos, k)
                if got != NULL:
                    at[n_at] = <Py_ssize_t>(<object>got) - self.base
                    n_at += 1
            if n_at == prev_n or not enough:  # a position never leaves `pos`: same count, same set
                break
        # sort the positions (insertion: a request's path is short) and accumulate their blocks
        for i in range(1, n_at):
            j = i
            mid = at[i]
            while j > 0 and at[j - 1] > mid:
                at[j] = at[j - 1]
                j -= 1
            at[j] = mid
        for j in range(n_at):
            pcum[j] = (pcum[j - 1] if j else 0) + <long long>(<tuple>steps[at[j]])[1]
        n_out[0] = n_at
        n = len(steps)
        if n == 0:
            return -1
        lo, hi = 0, n - 1
        if self._unprotected_upto(hi, at, pcum, n_at) >= need_blocks:
            while lo < hi:
                mid = (lo + hi) // 2
                if self._unprotected_upto(mid, at, pcum, n_at) >= need_blocks:
                    hi = mid
                else:
                    lo = mid + 1
        return hi

    def hot_victims(self, long long need_blocks, set protected):
        """The victims M prices, in victim order (the reference's docstring): those `_price` walks, collected
        through its `term` with the memo left alone (one walk for both: the tests hold it to the reference's)."""
        cdef list out = []

        def note(node, take, worker, cutoff, block_size, cost):
            out.append((node, take))
            return _NO_TERM

        self._price(need_blocks, protected, 0.0, 0, None, False, note)
        return out

    def price(self, long long need_blocks, set protected, double cutoff, long long block_size, object cost,
              bint keep=True, object term=None):
        """As the reference's: `_price`."""
        return self._price(need_blocks, protected, cutoff, block_size, cost, keep, term)

    cdef double _price(self, long long need_blocks, set protected, double cutoff, long long block_size,
                       object cost, bint keep, object term) except? -1.0:
        """`price`: the loop, the memo and the default term in C (`_term`); the cost model is asked for
        PREFILLTIME (one call per term priced afresh); a given `term` is called.

        NOTE: why not `hot_victims` then a loop over its list: the victims are walked where `_span` leaves
        them, and a memo key reuses the step's id and (for a whole take) its block count, so a victim costs a key
        tuple and a lookup, not a victim tuple, a list slot, a new id and a boxed count as well (full videoqa,
        16 workers, rdtsc around the selects' `order.price` calls: mean 3.54 → 2.81 µs, alternating builds).
        A whole take's term is read from `_whole[i]` without the key or the lookup: it is the object `memo` holds
        under (id, blocks) (set where that key is stored; dropped with the memo's clear and with the node's keys
        in `first_resized`), so the memo changes exactly as the reference's (select ×0.959-0.972 paired).
        Nothing else may change `memo` while an order lives."""
        cdef Py_ssize_t at_buf[_STACK_PROTECTED]
        cdef long long pcum_buf[_STACK_PROTECTED]
        cdef Py_ssize_t* at = at_buf
        cdef long long* pcum = pcum_buf
        cdef Py_ssize_t n_at = 0, i, last
        cdef long long take, d
        cdef list steps = self.steps
        cdef dict memo = self.memo
        cdef double m = 0.0
        cdef tuple step, got
        cdef object k, nblocks, key
        cdef bint whole
        cdef PyObject* p
        if len(protected) > _STACK_PROTECTED:
            at, pcum = _protected_arrays(len(protected))
        try:
            last = self._span(need_blocks, protected, at, pcum, &n_at)
            for h in self.hot:
                i = <Py_ssize_t>h - self.base
                if i > last:
                    break
                step = <tuple>steps[i]
                k = <object>PyTuple_GET_ITEM(step, 2)
                if PySet_Contains(protected, k):
                    continue
                nblocks = <object>PyTuple_GET_ITEM(step, 1)
                whole = True
                if i == last:
                    d = <long long>nblocks
                    take = need_blocks - (self._unprotected_upto(i - 1, at, pcum, n_at) if i else 0)
                    if take < d:
                        nblocks = take
                        whole = False
                got = None
                key = None
                if keep:
                    if whole:
                        got = <object>PyList_GET_ITEM(self._whole, i)
                    if got is None:
                        key = (k, nblocks)
                        p = PyDict_GetItem(memo, key)
                        if p != NULL:
                            got = <tuple>p
                if (got is None or not (<double>got[1] <= cutoff <= <double>got[2])
                        or <object>PyTuple_GET_ITEM(got, 3) is not cost):
                    if term is None:
                        got = self._term(<object>PyTuple_GET_ITEM(step, 0), k, <long long>nblocks, cutoff,
                                         block_size, cost)
                    else:
                        got = <tuple?>term(<object>PyTuple_GET_ITEM(step, 0), nblocks, self.worker, cutoff,
                                           block_size, cost)
                    if keep:
                        if key is None:
                            key = (k, nblocks)
                        if len(memo) >= self.memo_cap:
                            memo.clear()
                            self._whole = [None] * len(steps)
                        PyDict_SetItem(memo, key, got)
                if keep and whole and key is not None:  # (None: it came from `_whole`, valid)
                    self._whole[i] = got
                if <object>PyTuple_GET_ITEM(got, 0) is not None:
                    m = m + <double>got[0]
            return m
        finally:
            if at != at_buf:
                PyMem_Free(at)
                PyMem_Free(pcum)

    cdef tuple _term(self, object node, object k, long long nblocks, double cutoff, long long block_size,
                     object cost):
        """`term_from` the reference's `_facts_of(node, cutoff)` (node's id k): its facts from `facts` while they
        hold, else read from the node (`victim_facts`; `Samples.since`: in C over the Cython build's samples)."""
        cdef PyObject* p = PyDict_GetItem(self.facts, k)
        cdef tuple f
        cdef object st, dq = None, count
        if p != NULL and <double>(<tuple>p)[1] <= cutoff <= <double>(<tuple>p)[2]:
            f = <tuple>p
        else:
            st = node.stats
            if isinstance(st, self.stats_type):
                dq = st.hits.get(self.worker)
            f = None
            if dq:
                got = dq.since(cutoff)
                if (<tuple>got)[0]:
                    f = ((<tuple>got)[0], cutoff, (<tuple>got)[1], node.context_blocks + node.resident_on(self.worker))
            if f is None:
                f = (0, cutoff, INFINITY, 0)
            if len(self.facts) >= self.memo_cap:
                self.facts.clear()
            PyDict_SetItem(self.facts, k, f)
        count = <object>PyTuple_GET_ITEM(f, 0)
        if not count:
            return (None, f[1], f[2], cost)
        return (_prefill_s(cost, nblocks * block_size, (<long long>f[3] - nblocks) * block_size) * <double>count,
                f[1], f[2], cost)

    cdef long long _unprotected_upto(self, Py_ssize_t i, Py_ssize_t* at, long long* pcum, Py_ssize_t n_at) except? -1:
        """cum[i] less the blocks of the protected steps at or before i."""
        cdef Py_ssize_t lo = 0, hi = n_at, mid
        while lo < hi:  # bisect_right(at, i)
            mid = (lo + hi) // 2
            if at[mid] <= i:
                lo = mid + 1
            else:
                hi = mid
        return <long long>self.cum[i] - self.cum_base - (pcum[lo - 1] if lo else 0)

    cdef bint _step(self) except -1:
        if self.stale:
            self._rebase()
        cdef Py_ssize_t size = len(self.array)
        cdef Py_ssize_t p, c, i
        cdef double la
        cdef tuple e, top
        cdef object n, k, kp, par, st, hits
        cdef PyObject* got
        cdef long long d, held, seq
        while True:
            # the next entry in key order: the array's (via the frontier) or an unlocked parent's
            if self._f_n > 0:
                if self.extra:
                    top = <tuple>self.extra[0]
                    if (self._f_la[0] < <double>top[0]
                            or (self._f_la[0] == <double>top[0] and self._f_seq[0] < <long long>top[1])):
                        p = -1
                    else:
                        p = -2
                else:
                    p = -1
            elif self.extra:
                p = -2
            else:
                return False
            if p == -1:
                self._lp_la, self._lp_seq, self._lp_pos, self._lp_set = self._f_la[0], self._f_seq[0], self._f_pos[0], True
                p = self._pop()
                c = 2 * p + 1
                if c < size:
                    self._push(c)
                    if c + 1 < size:
                        self._push(c + 1)
                e = <tuple>self.array[p]
            else:
                e = <tuple>heapq.heappop(self.extra)
            la = e[0]
            n = e[2]
            k = PyLong_FromVoidPtr(<void*>n)
            got = PyDict_GetItem(self._keyed, k)
            if got == NULL or <double>(<object>got) != la:
                got = PyDict_GetItem(self.unlocked, k)
                if got == NULL or <double>(<object>got) != la:
                    continue  # stale: the node left the candidates or was accessed since
            if PySet_Contains(self.done, k):
                continue  # seen already
            PySet_Add(self.done, k)
            seq = e[1]
            if not self._mk_set or la > self._mk_la or (la == self._mk_la and seq > self._mk_seq):
                self._mk_la, self._mk_seq, self._mk_set = la, seq, True
            d = n.resident_on(self.worker)
            i = len(self.steps)
            self.steps.append((n, d, k))
            self._whole.append(None)
            self.cum.append((<long long>self.cum[i - 1] if i else self.cum_base) + d)
            PyDict_SetItem(self.pos, k, self.base + i)
            st = n.stats
            if isinstance(st, self.stats_type):
                hits = st.hits.get(self.worker)
                if hits:
                    self.hot.append(self.base + i)
            par = (<tuple>self._entries[k])[1]
            if par is not None:
                kp = PyLong_FromVoidPtr(<void*>par)
                got = PyDict_GetItem(self.local_held, kp)  # counted resident or not, as the reference
                if got != NULL:
                    held = <long long>(<object>got) - 1
                else:
                    got = PyDict_GetItem(self._held, kp)
                    held = (<long long>(<object>got) if got != NULL else 0) - 1
                PyDict_SetItem(self.local_held, kp, held)
                if held == 0 and kp in self._entries:  # its last resident child gone: the parent is a candidate
                    la = par.last_access
                    self.unlocked[kp] = la
                    heapq.heappush(self.extra, (la, par.seq, par))
            return True


cdef double _COLD_BUCKETS_PER_S = COLD_BUCKETS_PER_S


cdef inline object _cold_bucket(object t):
    """`lru_order_py.cold_bucket`: floor(t × COLD_BUCKETS_PER_S), a power of two, so the product is exact; a
    time past a long long's range, or not finite, goes to the reference (the same int, or its `math.floor`
    error)."""
    cdef double x = <double>t * _COLD_BUCKETS_PER_S
    if not (-9.0e18 < x < 9.0e18):  # not finite, or past a long long
        return _py_cold_bucket(t)
    return <long long>floor(x)


cdef class LruIndexCore:
    """Cython build of `lru_order_py.LruIndexCore`: the same tables (Python dicts, lists and sets, read by the
    eviction orders, `touch_holders` and E2's bound kernel), changed by the same rules in the same order, so the
    heap's array, and every order that walks it, is the reference's. The heap moves by `heapq`'s own functions.

    Why: the KV-event hooks reconcile ~20 nodes per event through `touch` and `_consider`, and on video QA those
    calls were half of E2's hooks (a Python frame, a dozen dict calls and a tuple per node); here they are C calls
    on the dict C API.
    """

    cdef public dict entries, held, keyed, cand, bucket_blocks
    cdef public list heap, ahead
    cdef public set ahead_set
    cdef public object _order, worker
    cdef public long long below
    cdef long long _fb
    cdef bint _fb_set

    def __init__(self):
        self.entries = {}
        self.held = {}
        self.heap = _untracked([])
        self.keyed = {}
        self._order = None
        self.worker = None
        self.cand = {}
        self.bucket_blocks = {}
        self._fb_set = False
        self._fb = 0
        self.below = 0
        self.ahead = []
        self.ahead_set = set()

    @property
    def floor_b(self):
        return self._fb if self._fb_set else None

    @floor_b.setter
    def floor_b(self, v):
        if v is None:
            self._fb_set = False
        else:
            self._fb, self._fb_set = v, True

    # ------------------------------------------------------------------------------------------ the reference's
    def _add_mass(self, long long bucket, long long blocks):
        self._c_add_mass(bucket, blocks)

    def advance(self, long long floor_b):
        """As the reference's."""
        if self._fb_set and floor_b <= self._fb:
            return
        cdef long long below = self.below if self._fb_set else 0
        cdef list ahead = self.ahead
        cdef set ahead_set = self.ahead_set
        cdef dict mass = self.bucket_blocks
        cdef PyObject* p
        while ahead and <long long>ahead[0] < floor_b:
            b = _heappop(ahead)
            ahead_set.discard(b)
            p = PyDict_GetItem(mass, b)
            if p != NULL:
                below += <long long>(<object>p)
        self.below = below
        self._fb, self._fb_set = floor_b, True

    def cold_blocks(self, set protected):
        """As the reference's."""
        if not self._fb_set:
            return 0
        cdef long long n = self.below
        cdef PyObject* p
        cdef tuple c
        for k in protected:
            p = PyDict_GetItem(self.cand, k)
            if p != NULL:
                c = <tuple>(<object>p)
                if <long long>c[0] < self._fb:
                    n -= <long long>c[1]
        return n

    def touch(self, worker, node, resident=None, bint prune=True):
        """As the reference's."""
        self._c_touch(worker, node, resident, prune)

    def touch_all(self, worker, nodes):
        """As the reference's: `touch` each node, the heap's stale top pruned once at the end."""
        for node in nodes:
            self._c_touch(worker, node, None, False)
        if nodes:
            self._c_prune()

    def touch_unmoved(self, node, k, parent):
        """As the reference's."""
        return self._c_touch_unmoved(node, k, parent)

    # ------------------------------------------------------------------------------------------ in C
    cdef int _c_consider(self, object node) except -1:
        cdef object k = PyLong_FromVoidPtr(<void*>node)
        cdef PyObject* p = PyDict_GetItem(self.entries, k)
        cdef PyObject* h
        cdef object la, order, new = None, old
        cdef tuple entry, o, nw
        if p != NULL:
            h = PyDict_GetItem(self.held, k)
            if h != NULL and <object>h:
                p = NULL  # has resident children: not a candidate
        if p != NULL:
            la = node.last_access
            h = PyDict_GetItem(self.keyed, k)
            if h == NULL or <object>h != la:
                PyDict_SetItem(self.keyed, k, la)
                entry = (la, node.seq, node)
                _heappush(self.heap, entry)
                order = self._order
                if order is not None and not _pushed(order, entry):  # it walks this heap's array in place
                    self._order = None
            new = (_cold_bucket(la), node.resident_on(self.worker))
        elif PyDict_GetItem(self.keyed, k) != NULL:
            del self.keyed[k]
        h = PyDict_GetItem(self.cand, k)
        old = <object>h if h != NULL else None
        if old is None and new is None:
            return 0
        if old is not None and new is not None:
            o, nw = <tuple>old, <tuple>new
            if o[0] == nw[0] and o[1] == nw[1]:
                return 0
        if old is not None:
            o = <tuple>old
            self._c_add_mass(o[0], -<long long>o[1])
            del self.cand[k]
        if new is not None:
            nw = <tuple>new
            self._c_add_mass(nw[0], nw[1])
            PyDict_SetItem(self.cand, k, new)
        return 0

    cdef int _c_add_mass(self, long long bucket, long long blocks) except -1:
        cdef object kb = bucket
        cdef PyObject* p = PyDict_GetItem(self.bucket_blocks, kb)
        cdef long long v = (<long long>(<object>p) if p != NULL else 0) + blocks
        if v:
            PyDict_SetItem(self.bucket_blocks, kb, v)
        elif p != NULL:
            del self.bucket_blocks[kb]
        if self._fb_set and bucket < self._fb:
            self.below += blocks
        elif not PySet_Contains(self.ahead_set, kb):
            PySet_Add(self.ahead_set, kb)
            _heappush(self.ahead, kb)
            if len(self.ahead) > 2 * len(self.bucket_blocks) + 64:  # emptied buckets dominate: drop them
                self.ahead = [b for b in self.ahead if b in self.bucket_blocks]
                _heapify(self.ahead)
                self.ahead_set = set(self.ahead)
        return 0

    cdef int _c_touch(self, object worker, object node, object resident, bint prune) except -1:
        self.worker = worker
        cdef object k = PyLong_FromVoidPtr(<void*>node)
        cdef dict res_d = <dict?>(node.resident if resident is None else resident)
        cdef PyObject* p = PyDict_GetItem(res_d, worker)
        cdef bint res = p != NULL and <object>p > 0 and node.is_attached
        cdef object old, parent, order, op, kop, kp
        cdef long long c
        if res and self._c_touch_unmoved(node, k, node.parent):
            return 0
        p = PyDict_GetItem(self.entries, k)
        old = <object>p if p != NULL else None
        if old is None and not res:
            return 0
        parent = node.parent if res else None
        order = self._order
        if order is not None and not (not res and _first_resized(order, k, 0)) and (
                _reached(order, k)
                or (old is not None and (<tuple>old)[1] is not None
                    and _reached(order, PyLong_FromVoidPtr(<void*>(<tuple>old)[1])))
                or (parent is not None and _reached(order, PyLong_FromVoidPtr(<void*>parent)))):
            self._order = None  # the steps read this node or a parent whose resident children change
        if old is not None:
            op = (<tuple>old)[1]
            if op is not None:
                kop = PyLong_FromVoidPtr(<void*>op)
                c = <long long>self.held[kop] - 1
                if c:
                    PyDict_SetItem(self.held, kop, c)
                else:
                    del self.held[kop]
                self._c_consider(op)
        if res:
            PyDict_SetItem(self.entries, k, (node, parent))
            if parent is not None:
                kp = PyLong_FromVoidPtr(<void*>parent)
                p = PyDict_GetItem(self.held, kp)
                PyDict_SetItem(self.held, kp, (<long long>(<object>p) if p != NULL else 0) + 1)
                self._c_consider(parent)
        else:
            del self.entries[k]
        self._c_consider(node)
        if prune:
            self._c_prune()
        return 0

    cdef bint _c_touch_unmoved(self, object node, object k, object parent) except -1:
        cdef PyObject* p = PyDict_GetItem(self.entries, k)
        cdef PyObject* h
        cdef object order
        if p == NULL or (<tuple>(<object>p))[1] is not parent:
            return False
        order = self._order
        if order is not None and _order_reached(order, k):
            h = PyDict_GetItem(self.keyed, k)
            if not (h != NULL and <object>h == node.last_access
                    and _first_resized(order, k, node.resident_on(self.worker))):
                self._order = None  # a step read its key or resident blocks (a new key is `pushed`'s to judge)
        h = PyDict_GetItem(self.held, k)
        if h != NULL and <object>h and not PyDict_Contains(self.keyed, k):
            return True  # not a candidate before or after (resident children): heap and keys unchanged
        self._c_consider(node)
        self._c_prune()
        return True

    cdef int _c_prune(self) except -1:
        cdef list heap = self.heap
        cdef dict keyed = self.keyed
        cdef object order = self._order
        cdef bint popped = False
        cdef tuple e
        if len(heap) > 2 * len(keyed) + 64:
            self.heap = _untracked([e for e in heap if _live(keyed, <tuple>e)])
            _heapify(self.heap)
            if order is not None:
                _rebased(order, self.heap)
            return 0
        while heap and not _live(keyed, <tuple>heap[0]):
            _heappop(heap)
            popped = True
        if popped and order is not None:
            _rebased(order, heap)
        return 0


cdef inline bint _live(dict keyed, tuple e) except -1:
    """`keyed.get(id(e[2])) == e[0]`: a heap entry whose node is still keyed at its key."""
    cdef PyObject* p = PyDict_GetItem(keyed, PyLong_FromVoidPtr(<void*>e[2]))
    return p != NULL and <object>p == e[0]


# an index's order is this module's EvictionOrder or (in tests) the reference's: C calls for the first
cdef inline bint _pushed(object order, tuple entry) except -1:
    if type(order) is EvictionOrder:
        return (<EvictionOrder>order).pushed(entry)
    return order.pushed(entry)


cdef inline bint _reached(object order, object k) except -1:
    if type(order) is EvictionOrder:
        return (<EvictionOrder>order).reached(k)
    return order.reached(k)


cdef inline bint _first_resized(object order, object k, long long blocks) except -1:
    if type(order) is EvictionOrder:
        return (<EvictionOrder>order).first_resized(k, blocks)
    return order.first_resized(k, blocks)


cdef inline int _rebased(object order, list array) except -1:
    if type(order) is EvictionOrder:
        (<EvictionOrder>order).rebased(array)
    else:
        order.rebased(array)
    return 0


def touch_holders(dict lru, list nodes, moved=None):
    """As `lru_order_py.touch_holders`, over the holders' indexes: an index of this module (`LruIndexCore`) takes
    its `touch_unmoved` and `touch` as C calls; for nearly every (node, holder) of a dispatch (a shared prefix's
    node, with resident children there) that exit does nothing but maybe drop a stale eviction order. Any other
    index (the reference's, in tests) is called as the reference calls it."""
    cdef Py_ssize_t pos
    cdef PyObject* pw
    cdef PyObject* prun
    cdef PyObject* p
    cdef dict res
    cdef object idx, k, parent, attached
    if moved is not None:
        res = moved.resident
        parent = moved.parent
        for w in (parent.resident if parent is not None else lru):  # detached: any index may hold it
            p = PyDict_GetItem(lru, w)
            if p is NULL:
                continue
            idx = <object>p
            if isinstance(idx, LruIndexCore):
                (<LruIndexCore>idx)._c_touch(w, moved, res, True)
            else:
                idx.touch(w, moved, res)
    for node in nodes:
        res = node.resident
        if not res:
            continue
        k, parent, attached = id(node), node.parent, node.is_attached
        pos = 0
        while PyDict_Next(res, &pos, &pw, &prun):
            p = PyDict_GetItem(lru, <object>pw)
            if p is NULL:
                continue
            idx = <object>p
            if isinstance(idx, LruIndexCore):
                if not (<object>prun > 0 and attached
                        and (<LruIndexCore>idx)._c_touch_unmoved(node, k, parent)):
                    (<LruIndexCore>idx)._c_touch(<object>pw, node, res, True)
            elif not (<object>prun > 0 and attached and idx.touch_unmoved(node, k, parent)):
                idx.touch(<object>pw, node, res)


cdef bint _order_reached(object order, object k) except -1:
    """`k in order.done or k in order.unlocked`: whether the simulation has reached node k."""
    if type(order) is EvictionOrder:
        return PySet_Contains((<EvictionOrder>order).done, k) or PyDict_GetItem((<EvictionOrder>order).unlocked, k) != NULL
    return k in order.done or k in order.unlocked


ctypedef double (*PriceFn)(object, long long, set, double, long long, object, bint, object) except? -1.0


cdef double _price_of(object order, long long need_blocks, set protected, double cutoff, long long block_size,
                      object cost, bint keep, object term) except? -1.0:
    """`order.price(...)` for an `EvictionOrder` of this build (the caller checks the type), without a Python call."""
    return (<EvictionOrder>order)._price(need_blocks, protected, cutoff, block_size, cost, keep, term)


ctypedef int (*ColdCoversFn)(object, object, Py_ssize_t) except -1


cdef int _cold_covers(object lru, object path, Py_ssize_t need) except -1:
    """Whether M is 0 without simulating, on an index of this build (the caller checks the type): no candidates, or
    the cold ones (keyed before the floor) less those among `path`'s nodes cover `need`; `_e2_select_c`'s
    `_m_is_zero` read in C (`cold_blocks` with the path's nodes for the protected ids)."""
    cdef LruIndexCore x = <LruIndexCore>lru
    cdef long long cold
    cdef PyObject* p
    cdef tuple c
    if not x.heap:
        return True
    if not x._fb_set:
        return need <= 0
    cold = x.below
    for node in path:
        p = PyDict_GetItem(x.cand, PyLong_FromVoidPtr(<void*>node))
        if p != NULL:
            c = <tuple>p
            if <long long>c[0] < x._fb:
                cold -= <long long>c[1]
    return cold >= need


# `_cold_covers` for `_e2_select_c`'s early exit from M, in place of four attribute reads (`floor_b` a property)
# and Python compares on the index (~0.6 µs mean per priced candidate)
COLD_COVERS_C = PyCapsule_New(<void*>_cold_covers, "switchyard.ext._lru_order_c.ColdCoversFn", NULL)


# `_price_of` for `_e2_select_c`'s M, a C call where `order.price` parsed seven arguments and boxed the float
# (~0.5 µs of each M); the capsule's name is the contract: `PriceFn`, the same typedef in both modules
PRICE_C = PyCapsule_New(<void*>_price_of, "switchyard.ext._lru_order_c.PriceFn", NULL)
