# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""Fast per-worker load anticipator: the same API and results as `anticipator_py` (see its docstring).

Layout, chosen for the per-decision queries (peak, virtual_peak over 100 slots) and the per-request updates:

    _ring  int64_t[_size]   U in tokens; absolute iteration a lives at slot a & _mask (_size = a power of two
                            > max_len, so every record's end fits and no head index is needed)
    _recs  Rec[_n]          live records, dense: finish swaps the last record into the hole
    _index dict             rid -> position in _recs;  _rids list: position -> rid (to fix _index on a swap)
    _min_end int64_t        <= the end of every record that can still be extended: advance_to scans the
                            records only when it reaches this bound (an overrun, or a stale bound after a finish)

All loops over the ring and the records run in C without the GIL.
"""

from cpython.dict cimport PyDict_GetItem, PyDict_Next
from cpython.float cimport PyFloat_Check
from cpython.long cimport PyLong_Check
from cpython.mem cimport PyMem_Free, PyMem_Malloc, PyMem_Realloc
from cpython.number cimport PyNumber_Index
from cpython.object cimport PyObject
from cpython.pycapsule cimport PyCapsule_New
from libc.math cimport ceil, isfinite
from libc.stdint cimport INT64_MAX, int64_t
from libc.string cimport memset

from switchyard.ext.anticipator_py import MAX_CAPACITY, MAX_ITERATION, MAX_LEN, MAX_TOKENS


cdef extern from "Python.h":
    long long PyLong_AsLongLongAndOverflow(object o, int* overflow) except? -1


ctypedef struct Rec:
    int64_t prompt      # P
    int64_t start       # absolute iteration of the add
    int64_t predicted   # D
    int64_t end         # absolute effective end (grows with overrun extensions, <= start + max_len)
    int64_t ext         # tokens per extension: max(1, ceil(ext_frac * D)), at most max_len
    int64_t context     # tokens its decode attends to at its start (decode_in; default P)


cdef int64_t _C_MAX_TOKENS = MAX_TOKENS
cdef int64_t _C_MAX_ITERATION = MAX_ITERATION


cdef int64_t _count(object value, str name, int64_t upper) except -1:
    """An int in [0, upper] as int64 (TypeError for non-ints, ValueError outside; same messages as the twin)."""
    cdef int overflow = 0
    v = PyNumber_Index(value)
    cdef long long x = PyLong_AsLongLongAndOverflow(v, &overflow)
    if overflow != 0 or x < 0 or x > upper:
        raise ValueError(f"{name} must be in [0, {upper}], got {v}")
    return x


cdef inline void _add_range(int64_t* ring, int64_t mask, int64_t lo, int64_t hi, int64_t first,
                            int64_t sign) noexcept nogil:
    """Slots of absolute iterations [lo, hi) += sign * (first, first + 1, ...)."""
    cdef int64_t n = hi - lo
    cdef int64_t s, head, i
    if n <= 0:
        return
    s = lo & mask
    head = mask + 1 - s
    if head > n:
        head = n
    for i in range(head):
        ring[s + i] += sign * (first + i)
    first += head
    for i in range(n - head):  # wrapped to slot 0
        ring[i] += sign * (first + i)


cdef class Anticipator:
    """One worker's load-look-ahead map over future decode iterations; see `anticipator_py`."""

    cdef int64_t* _ring
    cdef int64_t _size
    cdef int64_t _mask
    cdef int64_t _it
    cdef int64_t _capacity
    cdef int64_t _max_len
    cdef double _ext_frac
    cdef Rec* _recs
    cdef Py_ssize_t _n
    cdef Py_ssize_t _recs_cap
    cdef dict _index
    cdef list _rids
    cdef int64_t _min_end

    def __cinit__(self, capacity_tokens, max_len=4096, ext_frac=0.2):
        self._ring = NULL
        self._recs = NULL

    def __init__(self, capacity_tokens, max_len=4096, ext_frac=0.2):
        capacity = PyNumber_Index(capacity_tokens)
        if not 1 <= capacity <= MAX_CAPACITY:
            raise ValueError(f"capacity_tokens must be in [1, {MAX_CAPACITY}], got {capacity}")
        length = PyNumber_Index(max_len)
        if not 1 <= length <= MAX_LEN:
            raise ValueError(f"max_len must be in [1, {MAX_LEN}], got {length}")
        cdef double frac = float(ext_frac)
        if not (isfinite(frac) and frac >= 0.0):
            raise ValueError(f"ext_frac must be finite and >= 0, got {ext_frac!r}")
        self._capacity = capacity
        self._max_len = length
        self._ext_frac = frac
        cdef int64_t size = 1
        while size <= self._max_len:
            size <<= 1
        PyMem_Free(self._ring)  # __init__ called again on a live object
        self._ring = <int64_t*>PyMem_Malloc(size * sizeof(int64_t))
        if self._ring == NULL:
            raise MemoryError()
        memset(self._ring, 0, size * sizeof(int64_t))
        self._size = size
        self._mask = size - 1
        self._it = 0
        PyMem_Free(self._recs)
        self._recs = NULL
        self._n = 0
        self._recs_cap = 0
        self._index = {}
        self._rids = []
        self._min_end = INT64_MAX

    def __dealloc__(self):
        PyMem_Free(self._ring)
        PyMem_Free(self._recs)

    # ---- properties --------------------------------------------------------------------------------------

    @property
    def iteration(self):
        return self._it

    @property
    def capacity_tokens(self):
        return self._capacity

    @property
    def max_len(self):
        return self._max_len

    @property
    def ext_frac(self):
        return self._ext_frac

    def __contains__(self, rid):
        return rid in self._index

    def __len__(self):
        return self._n

    # ---- updates -----------------------------------------------------------------------------------------

    def add(self, rid, prompt_tokens, predicted_tokens, context_tokens=None):
        cdef int64_t p = _count(prompt_tokens, "prompt_tokens", _C_MAX_TOKENS)
        cdef int64_t d = _count(predicted_tokens, "predicted_tokens", _C_MAX_TOKENS)
        cdef int64_t c = p if context_tokens is None else _count(context_tokens, "context_tokens", _C_MAX_TOKENS)
        if rid in self._index:
            raise ValueError(f"request {rid!r} is already in the map")
        cdef Rec* grown
        cdef Py_ssize_t new_cap
        if self._n == self._recs_cap:
            new_cap = 64 if self._recs_cap == 0 else 2 * self._recs_cap
            grown = <Rec*>PyMem_Realloc(self._recs, new_cap * sizeof(Rec))
            if grown == NULL:
                raise MemoryError()
            self._recs = grown
            self._recs_cap = new_cap
        cdef double x = self._ext_frac * <double>d
        cdef int64_t ext
        if x >= <double>self._max_len:  # longer would be capped anyway; also keeps the cast in range
            ext = self._max_len
        else:
            ext = <int64_t>ceil(x)
            if ext < 1:
                ext = 1
        cdef Rec* r = &self._recs[self._n]
        r.prompt = p
        r.start = self._it
        r.predicted = d
        r.end = self._it + (d if d < self._max_len else self._max_len)
        r.ext = ext
        r.context = c
        self._index[rid] = self._n
        self._rids.append(rid)
        self._n += 1
        with nogil:
            _add_range(self._ring, self._mask, r.start, r.end, p, 1)
        if r.end < r.start + self._max_len and r.end < self._min_end:
            self._min_end = r.end

    def finish(self, rid):
        pos = self._index.pop(rid, None)
        if pos is None:
            return False
        cdef Py_ssize_t i = pos
        cdef Py_ssize_t last = self._n - 1
        cdef Rec* r = &self._recs[i]
        with nogil:  # its value at absolute iteration a is P + (a - start); only [iteration, end) remains
            _add_range(self._ring, self._mask, self._it, r.end, r.prompt + (self._it - r.start), -1)
        if i != last:
            self._recs[i] = self._recs[last]
            moved = self._rids[last]
            self._rids[i] = moved
            self._index[moved] = i
        self._rids.pop()
        self._n = last
        return True

    def advance_to(self, iteration):
        cdef int64_t it = _count(iteration, "iteration", _C_MAX_ITERATION)
        if it < self._it:
            raise ValueError(f"iteration {it} is before the map's origin {self._it}")
        cdef int64_t a
        with nogil:
            if it - self._it >= self._size:
                memset(self._ring, 0, self._size * sizeof(int64_t))
            else:  # the slots of [old, it) become those of [old + size, it + size): the new far future, empty
                a = self._it
                while a < it:
                    self._ring[a & self._mask] = 0
                    a += 1
            self._it = it
            if self._min_end <= it:
                self._extend_overruns()

    cdef void _extend_overruns(self) noexcept nogil:
        """Extend every live record with end <= iteration; recompute the earliest-end bound."""
        cdef int64_t it = self._it
        cdef int64_t min_end = INT64_MAX
        cdef int64_t cap, k, new_end
        cdef Py_ssize_t i
        cdef Rec* r
        for i in range(self._n):
            r = &self._recs[i]
            cap = r.start + self._max_len
            if r.end >= cap:
                continue  # at the cap: never extended again
            if r.end <= it:
                # repeated extensions of r.ext until end > it; those over past iterations left no trace
                k = (it - r.end) // r.ext + 1
                new_end = r.end + k * r.ext
                if new_end > cap:
                    new_end = cap
                _add_range(self._ring, self._mask, it, new_end, r.prompt + (it - r.start), 1)
                r.end = new_end
            if r.end < cap and r.end < min_end:
                min_end = r.end
        self._min_end = min_end

    # ---- queries -----------------------------------------------------------------------------------------

    cdef int64_t _horizon(self, object horizon) except -1:
        cdef int overflow = 0
        v = PyNumber_Index(horizon)
        cdef long long h = PyLong_AsLongLongAndOverflow(v, &overflow)
        if overflow < 0 or (overflow == 0 and h < 0):
            raise ValueError(f"horizon must be >= 0, got {v}")
        if overflow > 0 or h > self._max_len:
            return self._max_len
        return h

    cdef Rec* _get(self, rid) except NULL:
        cdef Py_ssize_t i = self._index[rid]  # KeyError for an unknown rid
        return &self._recs[i]

    def generated(self, rid):
        return self._it - self._get(rid).start

    def record(self, rid):
        cdef Rec* r = self._get(rid)
        return (r.prompt, r.start, r.predicted, r.end)

    def batch(self, dict queued):
        """As the reference's: the records read in C (in the array's order), `queued` with the dict C API."""
        cdef list running = [], waiting = []
        cdef int64_t it = self._it
        cdef Py_ssize_t i, pos = 0
        cdef Rec* r
        cdef PyObject* key
        cdef PyObject* v
        cdef object rq
        for i in range(self._n):
            r = &self._recs[i]
            if r.end > it:
                running.append((r.end - it, r.context + (it - r.start)))
        while PyDict_Next(queued, &pos, &key, &v):
            rq = <object>v
            waiting.append((rq.prompt_tokens, rq.kv_prompt_tokens, rq.predicted_tokens))
        return running, waiting

    def decode_in(self, dict queued, Py_ssize_t d, cost):
        """As the reference's: the records summed in C, then `queued` read with the dict C API. Each term
        m·(c + (m - 1)/2) is a multiple of 1/2, so the sums equal the reference's in any order below 2^53."""
        return self._decode_in(queued, d, cost)

    cdef double _decode_in(self, dict queued, Py_ssize_t d, object cost) except? -1.0:
        cdef int64_t it = self._it, rem, k_m, m_run = 0, m_q = 0
        cdef double own_run = 0.0, own_q = 0.0, in_run = 0.0, in_q = 0.0
        cdef Py_ssize_t i, pos = 0
        cdef Rec* r
        cdef PyObject* key
        cdef PyObject* v
        cdef object rq
        with nogil:
            for i in range(self._n):
                r = &self._recs[i]
                if r.end <= it:
                    continue
                rem = r.end - it
                k_m = rem if rem < d else d
                m_run += k_m
                own_run += <double>k_m * (<double>(r.context + (it - r.start)) + <double>(k_m - 1) / 2.0)
        while PyDict_Next(queued, &pos, &key, &v):
            rq = <object>v
            rem = rq.predicted_tokens
            k_m = rem if rem < d else d
            m_q += k_m
            rem = rq.prompt_tokens
            own_q += <double>k_m * (<double>rem + <double>(k_m - 1) / 2.0)
        if m_run:
            in_run = _decode_marginal_s(cost, <double>m_run, own_run / <double>m_run)
        if m_q:
            in_q = _decode_marginal_s(cost, <double>m_q, own_q / <double>m_q)
        return in_run + in_q

    def load_tokens(self, horizon):
        cdef int64_t h = self._horizon(horizon)
        cdef int64_t j
        return [self._ring[(self._it + j) & self._mask] for j in range(h)]

    def occupancy(self, offset):
        cdef int overflow = 0
        v = PyNumber_Index(offset)
        cdef long long j = PyLong_AsLongLongAndOverflow(v, &overflow)
        if overflow < 0 or (overflow == 0 and j < 0):
            raise ValueError(f"offset must be >= 0, got {v}")
        if overflow > 0 or j >= self._max_len:
            return 0.0
        return <double>self._ring[(self._it + j) & self._mask] / <double>self._capacity

    def peak(self, horizon=100):
        cdef int64_t h = self._horizon(horizon)
        cdef int64_t best = 0
        cdef int64_t j, u
        with nogil:
            for j in range(h):
                u = self._ring[(self._it + j) & self._mask]
                if u > best:
                    best = u
        return <double>best / <double>self._capacity

    def virtual_peak(self, prompt_tokens, predicted_tokens, horizon=100):
        cdef int64_t p = _count(prompt_tokens, "prompt_tokens", _C_MAX_TOKENS)
        cdef int64_t d = _count(predicted_tokens, "predicted_tokens", _C_MAX_TOKENS)
        cdef int64_t h = self._horizon(horizon)
        cdef int64_t best = 0
        cdef int64_t j, u
        cdef int64_t m = d if d < h else h
        with nogil:
            for j in range(m):  # offsets the virtual request occupies: + (P + j)
                u = self._ring[(self._it + j) & self._mask] + p + j
                if u > best:
                    best = u
            for j in range(m, h):
                u = self._ring[(self._it + j) & self._mask]
                if u > best:
                    best = u
        return <double>best / <double>self._capacity

    def overload_fraction(self, horizon=100, threshold=0.95):
        cdef int64_t h = self._horizon(horizon)
        cdef double thr = float(threshold)
        cdef double cap = <double>self._capacity
        cdef int64_t j, over = 0
        if h == 0:
            return 0.0
        with nogil:
            for j in range(h):
                if <double>self._ring[(self._it + j) & self._mask] / cap > thr:
                    over += 1
        return <double>over / <double>h

    def remaining_decode_tokens(self):
        cdef int64_t total = 0
        cdef Py_ssize_t i
        with nogil:
            for i in range(self._n):
                if self._recs[i].end > self._it:
                    total += self._recs[i].end - self._it
        return total

    def resident_tokens(self):
        return self._ring[self._it & self._mask]


# ---------------------------------------------------------------------------------------------- iteration clock
include "_profile_cost.pxi"  # _decode_iteration_s


cdef class IterationClock:
    """As `anticipator_py.IterationClock`: the fields in C, the rate's profile formula in C (`_profile_cost.pxi`),
    the map read through its C fields when it is this module's `Anticipator`."""

    cdef public object cost, default_cost
    cdef public long long base, sample_iterations, rate_n, rate_c
    cdef public double sample_at, since_sample, last_t, observed_rate, memo_rate
    cdef public bint has_sample

    def __init__(self, cost, default_cost, double now):
        self.cost, self.default_cost = cost, default_cost
        self.base = self.sample_iterations = 0
        self.sample_at = self.last_t = now
        self.has_sample = False
        self.since_sample = self.observed_rate = self.memo_rate = 0.0
        self.rate_n = self.rate_c = -1

    def same_sample(self, stats_at, num_iterations):
        return self._same(stats_at, num_iterations)

    cdef bint _same(self, object stats_at, object num_iterations) except -1:
        if not self.has_sample or not (PyFloat_Check(stats_at) or PyLong_Check(stats_at)):
            return False
        if <double>float(stats_at) != self.sample_at:
            return False
        return num_iterations == self.sample_iterations

    def rate(self, ant):
        return self._rate(ant)

    cdef double _rate(self, object ant) except? -1.0:
        cdef Py_ssize_t n
        cdef long long c
        cdef object cost
        cdef double t, rate
        if type(ant) is Anticipator:
            n = (<Anticipator>ant)._n
        else:
            n = len(ant)
        if n == 0:
            return 0.0
        cost = self.cost
        if cost is None:
            if self.observed_rate > 0:
                return self.observed_rate
            cost = self.default_cost
        if type(ant) is Anticipator:
            c = (<Anticipator>ant)._ring[(<Anticipator>ant)._it & (<Anticipator>ant)._mask]
        else:
            c = ant.resident_tokens()
        if n == self.rate_n and c == self.rate_c:  # exact, a function of (n, c) alone: a worker's cost is fixed
            return self.memo_rate
        t = _decode_iteration_s(cost, n, c)
        rate = 1.0 / t if t > 0 else 0.0
        self.rate_n, self.rate_c, self.memo_rate = n, c, rate
        return rate

    def observe(self, ant, stats_at, double stats_age_s, num_iterations, double now):
        if not self._same(stats_at, num_iterations):
            self._observe(ant, stats_at, stats_age_s, num_iterations, now)

    cdef int _observe(self, object ant, object stats_at, double stats_age_s, object num_iterations,
                      double now) except -1:
        """`observe` past its same-sample exit."""
        cdef double at, since
        cdef long long n
        if not isfinite(stats_age_s):
            return 0  # no sample yet
        if PyFloat_Check(stats_at) or PyLong_Check(stats_at):
            at = float(stats_at)
        else:
            at = now - stats_age_s
        n = num_iterations
        if self.has_sample and at == self.sample_at and n == self.sample_iterations:
            return 0
        self._advance(ant, now)
        if n < self.sample_iterations:
            self.base = ((<Anticipator>ant)._it if type(ant) is Anticipator else <long long>ant.iteration) - n
        elif self.has_sample and n > self.sample_iterations and at > self.sample_at:
            self.observed_rate = <double>(n - self.sample_iterations) / (at - self.sample_at)
        self.has_sample = True
        self.sample_iterations = n
        self.sample_at = at
        since = now - at
        if not since > 0.0:
            since = 0.0
        self.since_sample = since * self._rate(ant)
        self.last_t = now
        return 0

    def advance(self, ant, double now):
        self._advance(ant, now)

    cdef int _advance(self, object ant, double now) except -1:
        cdef double dt = now - self.last_t
        cdef long long target, it
        if dt > 0:
            self.since_sample += dt * self._rate(ant)
            self.last_t = now
        target = self.base + self.sample_iterations + <long long>self.since_sample
        it = (<Anticipator>ant)._it if type(ant) is Anticipator else ant.iteration
        if target > it:
            ant.advance_to(target)
        return 0


def sync_known(dict states, pool, double now):
    """As `anticipator_py.sync_known`."""
    cdef list out = []
    cdef PyObject* p
    cdef object st, ant, clock, at, n
    for w in pool:
        p = PyDict_GetItem(states, w.worker_id)
        if p is NULL:
            out.append(None)
            continue
        st = <object>p
        ant = st.anticipator
        if ant is None:
            out.append(None)
            continue
        clock = st.clock
        at, n = getattr(w, "stats_at", None), w.num_iterations
        if not (<IterationClock?>clock)._same(at, n):
            (<IterationClock>clock)._observe(ant, at, w.stats_age_s, n, now)
        (<IterationClock>clock)._advance(ant, now)
        out.append(ant)
    return out


cdef double _decode_in_of(object ant, dict queued, Py_ssize_t d, object cost) except? -1.0:
    return (<Anticipator>ant)._decode_in(queued, d, cost)


# `Anticipator.decode_in` for `_e2_select_c.fill_level`, a C call per pool worker where a method call parsed three
# arguments and boxed the float; the capsule's name is the contract: `DecodeInFn`, the same typedef in both modules
DECODE_IN_C = PyCapsule_New(<void*>_decode_in_of, "switchyard.ext._anticipator_c.DecodeInFn", NULL)
