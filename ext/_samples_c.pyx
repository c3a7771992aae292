# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""E2's per-node samples in C arrays: the same API and results as `samples_py` (its docstring is the contract), and
no Python object inside, so the collector never sees one (`Samples`: a ring of double pairs; `RecentMedian`: a ring
of int64 and the same values sorted); and `NodeStats`, which holds them, untracked as well."""

cimport cython
from cpython.mem cimport PyMem_Free, PyMem_Malloc, PyMem_Realloc
from libc.stdint cimport int64_t
from libc.string cimport memmove
from libc.math cimport INFINITY


@cython.no_gc  # holds no Python object, so it cannot be part of a cycle
@cython.final
cdef class Samples:
    """See `samples_py`."""

    cdef double* _t
    cdef double* _v
    cdef Py_ssize_t _cap, _head, _n  # a ring of _cap slots; the oldest at _head

    def __init__(self, iterable=()):
        self.clear()
        for t, v in iterable:
            self._push(t, v)

    def __dealloc__(self):
        PyMem_Free(self._t)
        PyMem_Free(self._v)

    cdef int _grow(self) except -1:
        cdef Py_ssize_t cap = 4 if self._cap == 0 else 2 * self._cap, i, j
        cdef double* t = <double*>PyMem_Malloc(cap * sizeof(double))
        cdef double* v = <double*>PyMem_Malloc(cap * sizeof(double))
        if t == NULL or v == NULL:
            PyMem_Free(t)
            PyMem_Free(v)
            raise MemoryError()
        for i in range(self._n):
            j = (self._head + i) % self._cap
            t[i] = self._t[j]
            v[i] = self._v[j]
        PyMem_Free(self._t)
        PyMem_Free(self._v)
        self._t, self._v, self._cap, self._head = t, v, cap, 0
        return 0

    cdef inline Py_ssize_t _at(self, Py_ssize_t i) noexcept:
        i += self._head
        return i - self._cap if i >= self._cap else i

    cdef int _push(self, double t, double v) except -1:
        cdef Py_ssize_t j
        if self._n == self._cap:
            self._grow()
        j = self._at(self._n)
        self._t[j] = t
        self._v[j] = v
        self._n += 1
        return 0

    def append(self, sample):
        t, v = sample
        self._push(t, v)

    def popleft(self):
        if self._n == 0:
            raise IndexError("pop from an empty deque")
        cdef Py_ssize_t j = self._head
        self._head = self._at(1)
        self._n -= 1
        return (self._t[j], self._v[j])

    def clear(self):
        self._head = 0
        self._n = 0

    def trim(self, double cutoff):
        while self._n and self._t[self._head] < cutoff:
            self._head = self._at(1)
            self._n -= 1

    def since(self, double cutoff):
        cdef Py_ssize_t i
        cdef double t
        for i in range(self._n):
            t = self._t[self._at(i)]
            if t >= cutoff:
                return self._n - i, t
        return 0, INFINITY

    def total_since(self, double cutoff):
        cdef Py_ssize_t i, n = self._n
        cdef double skipped = 0.0, total = 0.0
        for i in range(self._n):
            if self._t[self._at(i)] >= cutoff:
                break
            n -= 1
            skipped += self._v[self._at(i)]
        if not n:
            return 0, 0.0
        for i in range(self._n):
            total += self._v[self._at(i)]
        return n, total - skipped

    def __len__(self):
        return self._n

    def __getitem__(self, Py_ssize_t i):
        if i < 0:
            i += self._n
        if i < 0 or i >= self._n:
            raise IndexError("deque index out of range")
        i = self._at(i)
        return (self._t[i], self._v[i])

    def __iter__(self):
        return _SamplesIter(self)

    def __repr__(self):
        return f"Samples({list(self)!r})"

    def __reduce__(self):
        return (Samples, (list(self),))


@cython.final
cdef class _SamplesIter:
    """Iteration as a deque's: (t, value) tuples, oldest first; RuntimeError if the samples change meanwhile."""

    cdef Samples _s
    cdef Py_ssize_t _i, _n, _head

    def __cinit__(self, Samples s):
        self._s, self._i, self._n, self._head = s, 0, s._n, s._head

    def __iter__(self):
        return self

    def __next__(self):
        cdef Samples s = self._s
        cdef Py_ssize_t j
        if s._n != self._n or s._head != self._head:
            raise RuntimeError("deque mutated during iteration")
        if self._i >= self._n:
            raise StopIteration
        j = s._at(self._i)
        self._i += 1
        return (s._t[j], s._v[j])


@cython.no_gc  # holds no Python object
@cython.final
cdef class RecentMedian:
    """See `samples_py`: int64 values (an output length), so the median's sum is exact as Python ints."""

    cdef int64_t* _ring  # arrival order, the oldest at _head
    cdef int64_t* _sorted
    cdef Py_ssize_t _cap, _head, _n
    cdef Py_ssize_t _alloc  # slots allocated in each array: grown up to _cap by `_grow` (_head stays 0 until full)
    cdef object _median  # kept until the next add; None while unknown

    def __cinit__(self, Py_ssize_t capacity):
        # NOTE: no slot is allocated until the first add. Every node a dispatch passes gets one of these (in its
        # NodeStats), but only a request's key node receives output lengths, so most never hold a value: two
        # arrays of `capacity` (64: 1 KiB) allocated upfront were most of a node's stats' memory (ext/README).
        if capacity <= 0:
            raise ValueError("capacity must be positive")
        self._cap = capacity
        self._median = None

    cdef int _grow(self) except -1:
        """Double the arrays (4 at first, at most _cap); only while not full, when _head is 0 and both are linear."""
        cdef Py_ssize_t alloc = 4 if self._alloc == 0 else 2 * self._alloc
        cdef int64_t* p
        if alloc > self._cap:
            alloc = self._cap
        p = <int64_t*>PyMem_Realloc(self._ring, alloc * sizeof(int64_t))
        if p == NULL:
            raise MemoryError()
        self._ring = p
        p = <int64_t*>PyMem_Realloc(self._sorted, alloc * sizeof(int64_t))
        if p == NULL:
            raise MemoryError()
        self._sorted = p
        self._alloc = alloc
        return 0

    def __dealloc__(self):
        PyMem_Free(self._ring)
        PyMem_Free(self._sorted)

    cdef Py_ssize_t _left(self, int64_t x) noexcept:
        cdef Py_ssize_t lo = 0, hi = self._n, mid
        while lo < hi:
            mid = (lo + hi) >> 1
            if self._sorted[mid] < x:
                lo = mid + 1
            else:
                hi = mid
        return lo

    cdef Py_ssize_t _right(self, int64_t x) noexcept:
        cdef Py_ssize_t lo = 0, hi = self._n, mid
        while lo < hi:
            mid = (lo + hi) >> 1
            if x < self._sorted[mid]:
                hi = mid
            else:
                lo = mid + 1
        return lo

    def add(self, int64_t value):
        cdef Py_ssize_t i, tail
        if self._n == self._alloc and self._alloc < self._cap:
            self._grow()
        if self._n == self._cap:  # the oldest goes, from both orders
            i = self._left(self._ring[self._head])
            memmove(&self._sorted[i], &self._sorted[i + 1], (self._n - i - 1) * sizeof(int64_t))
            self._head = (self._head + 1) % self._cap
            self._n -= 1
        tail = (self._head + self._n) % self._cap
        self._ring[tail] = value
        i = self._right(value)  # bisect.insort: after equal values
        memmove(&self._sorted[i + 1], &self._sorted[i], (self._n - i) * sizeof(int64_t))
        self._sorted[i] = value
        self._n += 1
        self._median = None

    def median(self):
        cdef Py_ssize_t i
        if self._median is None and self._n:
            i = self._n // 2
            if self._n % 2:
                self._median = self._sorted[i]
            else:
                self._median = (<object>self._sorted[i - 1] + <object>self._sorted[i]) / 2
        return self._median

    def __len__(self):
        return self._n

    def __iter__(self):
        return iter([self._ring[(self._head + i) % self._cap] for i in range(self._n)])


from switchyard.ext.samples_py import DECODE_SAMPLES  # one value for both builds


@cython.no_gc  # what it holds never refers back to it, to nodes or to trees (samples_py)
@cython.final
cdef class NodeStats:
    """See `samples_py.NodeStats`."""

    cdef public dict hits, ttft, redirect, replicas
    cdef public RecentMedian decode_tokens

    def __init__(self):
        self.hits = {}
        self.ttft = {}
        self.redirect = {}
        self.replicas = {}
        self.decode_tokens = RecentMedian(DECODE_SAMPLES)

    def add_hit(self, worker, double now, double prefill_s, double window_s):
        cdef Samples dq = self.hits.get(worker)
        if dq is None:
            dq = Samples()
            self.hits[worker] = dq
        dq._push(now, prefill_s)
        dq.trim(now - window_s)

    def add_decode(self, num_tokens):
        self.decode_tokens.add(num_tokens)

    def median_decode(self):
        return self.decode_tokens.median()

    def __repr__(self):
        return (f"NodeStats(hits={self.hits!r}, decode_tokens={list(self.decode_tokens)!r}, ttft={self.ttft!r}, "
                f"redirect={self.redirect!r}, replicas={self.replicas!r})")
