# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""Cython build of `e2_select_py` (its docstring is the contract): the same objects, floats and ints, in the same
order.

Why a rewrite: the reference is a loop of dict reads, attribute reads and small tuples per worker, all bytecode.
Here the dict reads are C calls on the policy's dicts, the R memo is a C array scanned linearly (candidates hold
one or two distinct prefix lengths), L's memo is tested in C, and the bounds are C structs, ordered and walked by
the branch and bound without a tuple per candidate. R is priced in C for a cost model with `terms` (`ProfileCost`'s
formula, written out below in its order of operations: the same floats; the module is compiled with
-ffp-contract=off, so no fused multiply-add rounds differently), and M's early exits (`m_is_zero`) are read in C.
The Python-level calls left are `prefill_s` of other cost models, `kv_usage_frac` where a view has it as a property
(the fleet's records keep it in a slot), `load_s` on a memo miss, and M's `price` in the worker's eviction order, per
priced worker whose M the early exits cannot settle.
"""

from functools import partial

from cpython.dict cimport PyDict_GetItem, PyDict_Next
from cpython.long cimport PyLong_FromVoidPtr
from cpython.mem cimport PyMem_Free, PyMem_Malloc
from cpython.object cimport PyObject
from cpython.pycapsule cimport PyCapsule_GetPointer
from cpython.tuple cimport PyTuple_CheckExact, PyTuple_GET_ITEM, PyTuple_GET_SIZE
from libc.math cimport frexp, ldexp, signbit
from libc.stdint cimport uint64_t
from libc.stdlib cimport qsort

include "_profile_cost.pxi"  # _prefill_s, PyFloat_AsDouble

# `EvictionOrder.price` as a C call (`_lru_order_c.PRICE_C`; the typedef is that module's `PriceFn`, and the
# capsule's name changes with it), for the Cython build's orders; another order type (the reference's, a test's)
# is called through Python. NOTE: the module is imported by its full name, which `bench decisions`' NAME@REV
# rewrites to the revision's own build where its source differs from today's.
# Likewise `_m_is_zero` on the Cython build's LRU indexes (`COLD_COVERS_C`, typedef `ColdCoversFn`).
ctypedef double (*PriceFn)(object, long long, set, double, long long, object, bint, object) except? -1.0
ctypedef int (*ColdCoversFn)(object, object, Py_ssize_t) except -1
cdef PriceFn _price_c = NULL
cdef ColdCoversFn _cold_covers_c = NULL
cdef object _order_c = None, _index_c = None
try:
    from switchyard.ext._lru_order_c import (
        COLD_COVERS_C as _COLD_COVERS_C, PRICE_C as _PRICE_C, EvictionOrder as _EvictionOrder,
        LruIndexCore as _LruIndexCore,
    )
except ImportError:  # pragma: no cover - a build without it prices through Python
    _PRICE_C = None
if _PRICE_C is not None:
    _price_c = <PriceFn>PyCapsule_GetPointer(_PRICE_C, "switchyard.ext._lru_order_c.PriceFn")
    _order_c = _EvictionOrder
    _cold_covers_c = <ColdCoversFn>PyCapsule_GetPointer(_COLD_COVERS_C, "switchyard.ext._lru_order_c.ColdCoversFn")
    _index_c = _LruIndexCore


# `Anticipator.decode_in` as a C call (`_anticipator_c.DECODE_IN_C`, typedef `DecodeInFn`) for `fill_level` on the
# Cython build's anticipators; any other (the reference's) is called through Python
ctypedef double (*DecodeInFn)(object, dict, Py_ssize_t, object) except? -1.0
cdef DecodeInFn _decode_in_c = NULL
cdef object _anticipator_c = None
try:
    from switchyard.ext._anticipator_c import Anticipator as _Anticipator, DECODE_IN_C as _DECODE_IN_C
except ImportError:  # pragma: no cover - a build without it calls `decode_in` through Python
    _DECODE_IN_C = None
if _DECODE_IN_C is not None:
    _decode_in_c = <DecodeInFn>PyCapsule_GetPointer(_DECODE_IN_C, "switchyard.ext._anticipator_c.DecodeInFn")
    _anticipator_c = _Anticipator


def c_decode_in_type():
    """The anticipator type whose `decode_in` `fill_level` reads with a C call (None: every one through Python)."""
    return _anticipator_c if _decode_in_c != NULL else None


def c_priced_order_type():
    """The eviction order type whose M `_evict_s` prices with a C call (None: every order through Python)."""
    return _order_c if _price_c != NULL else None


def c_read_index_type():
    """The LRU index type (and its subclasses) whose early exit `_m_is_zero` reads with a C call (None: none)."""
    return _index_c if _cold_covers_c != NULL else None

cdef enum:
    _MEMO = 16
    _DEBUG = 10  # logging.DEBUG

# "0.00" .. "1.00": `format(k / 100, ".2f")`'s text for each k (P/D's reasons)
_HUNDREDTHS = tuple(f"{k // 100}.{k % 100:02d}" for k in range(101))


cdef int _hundredths(double x) noexcept:
    """`format(x, ".2f")`'s value in hundredths for 0 <= x <= 1 (-1 otherwise: NaN, a sign bit, beyond 1).

    Python rounds the exact binary value half to even. Here x = m·2^-s exactly (m < 2^53, s >= 52 for x <= 1), so
    100·x = N / 2^s with N = 100·m < 2^60: the quotient and the remainder against half of 2^s are exact in 64 bits
    (for s >= 61, N < 2^s / 2: 0)."""
    cdef int ex, s
    cdef uint64_t m, n, k, r, half
    if not (0.0 <= x <= 1.0) or signbit(x):
        return -1
    m = <uint64_t>ldexp(frexp(x, &ex), 53)  # x = m·2^(ex - 53), exact
    s = 53 - ex
    if s >= 61:
        return 0
    n = m * 100
    k = n >> s
    r = n & ((<uint64_t>1 << s) - 1)
    half = <uint64_t>1 << (s - 1)
    if r > half or (r == half and (k & 1)):
        k += 1
    return <int>k


def two_decimals(double x):
    """`format(x, ".2f")`, as P/D's reasons write it: `_hundredths`' text for 0 <= x <= 1, else `format`'s (the
    reference, `select_steps`, formats)."""
    cdef int k = _hundredths(x)
    return _HUNDREDTHS[k] if k >= 0 else format(x, ".2f")


def exploit_set(dict cached, Py_ssize_t key_end, dict by_id, redirect, replicas, double now):
    """As `e2_select_py.exploit_set`."""
    return _exploit_set(cached, key_end, by_id, redirect, replicas, now)


cdef list _exploit_set(dict cached, Py_ssize_t key_end, dict by_id, object redirect, object replicas, double now):
    """`exploit_set`, callable in C."""
    cdef Py_ssize_t pos = 0, i, j, n
    cdef PyObject* k
    cdef PyObject* v
    cdef list ks = []
    cdef list out
    cdef object got, wid
    while PyDict_Next(cached, &pos, &k, &v):
        if <Py_ssize_t><object>v >= key_end:
            ks.append(<object>k)
    if not (redirect or replicas):
        return [by_id[wid] for wid in ks]
    if not ks:
        return []  # replicas only widen an existing holder set
    if redirect:
        for i in range(len(ks)):
            got = redirect.get(ks[i])
            if got is not None and got[1] >= now and got[0] in by_id:
                ks[i] = got[0]
    if replicas:
        for wid, got in (<dict?>replicas).items():
            if got >= now and wid in by_id:
                ks.append(wid)
    out = []
    n = len(ks)
    for i in range(n):  # each worker once, at its first place (holder sets are small: a scan beats a set)
        wid = ks[i]
        for j in range(i):
            if ks[j] == wid:
                break
        else:
            out.append(by_id[wid])
    return out


cdef class BoundsEnv:
    """As `e2_select_py.BoundsEnv`."""

    cdef public dict cost_memo, facts, lru, resident_count, outstanding, load_memo
    cdef public object cost_model, load_s
    cdef public double window_s
    cdef public bint evict_on, assume_full, with_l, with_q

    def __init__(self, *, dict cost_memo, cost_model, dict facts, dict lru, dict resident_count, dict outstanding,
                 dict load_memo, load_s, double window_s, bint evict_on, bint assume_full, bint with_l,
                 bint with_q):
        self.cost_memo, self.cost_model, self.facts = cost_memo, cost_model, facts
        self.lru, self.resident_count, self.outstanding = lru, resident_count, outstanding
        self.load_memo, self.load_s, self.window_s = load_memo, load_s, window_s
        self.evict_on, self.assume_full, self.with_l, self.with_q = evict_on, assume_full, with_l, with_q


cdef class SelectEnv:
    """As `e2_select_py.SelectEnv`: the tables a select reads, and the configuration, taken from the policy once,
    by reference (its `BoundsEnv`'s rule: the tables stay current, the configuration is fixed at construction).
    The tree and the policy's methods (called off the default path) are looked up per use, so a
    wrapped tree or a patched method is the one called."""

    cdef readonly object policy, decision, node_stats, debug_on
    cdef readonly dict debug_cache
    cdef readonly Py_ssize_t decisions_cap
    cdef readonly BoundsEnv bounds
    cdef readonly dict evicted, outstanding, decisions, remembered
    cdef readonly bint study, overflow, pd_on, pd_argmax, decode_tokens
    cdef readonly double imbalance
    cdef readonly str pd_suffix
    cdef readonly tuple pd_reasons  # "explore P/D ratio=" + each of _HUNDREDTHS + pd_suffix
    # M (`_evict_s`): the policy's instance dict (an `_evict_s` patched there is called), its `recent_needs` and
    # W; `m_pricing`'s parts; how many Ms were read from an eviction order here
    cdef readonly object policy_dict, recent_needs, evict_s_fn, eviction_cost_fn, order_fn, profile_cost, m_term
    cdef readonly object protected_fn
    cdef readonly double node_window_s
    cdef readonly Py_ssize_t fused_ms

    def __init__(self, policy, *, decision, node_stats, Py_ssize_t decisions_cap, logger, tuple m_pricing):
        cfg = policy.cfg
        self.policy, self.decision, self.node_stats, self.decisions_cap = policy, decision, node_stats, decisions_cap
        self.policy_dict = getattr(policy, "__dict__", None)
        self.recent_needs, self.node_window_s = policy.recent_needs, cfg.node_window_s
        (self.evict_s_fn, self.eviction_cost_fn, self.order_fn, self.profile_cost, self.m_term,
         self.protected_fn) = m_pricing
        self.fused_ms = 0
        self.debug_on = logger.isEnabledFor
        # `logging.Logger.isEnabledFor` answers `_cache[level]` unless the logger is disabled: a False there is
        # its answer, read as one dict probe (the method call was ~0.8 µs of each select); else it is asked
        cache = getattr(logger, "_cache", None)
        self.debug_cache = cache if type(cache) is dict else None
        self.bounds = policy._bounds_env
        self.evicted, self.outstanding = policy.evicted, policy.outstanding
        self.decisions, self.remembered = policy._decisions, policy._remembered
        self.study = cfg.key_portion == "study"
        self.overflow = cfg.exploit_overflow
        self.pd_on = cfg.enable_pd_balancing
        self.pd_argmax = cfg.pd_pick == "argmax"
        self.decode_tokens = cfg.decode_ratio == "decode_tokens"
        self.imbalance = cfg.imbalance_ratio
        self.pd_suffix = f">{cfg.imbalance_ratio}"
        self.pd_reasons = tuple("explore P/D ratio=" + t + self.pd_suffix for t in _HUNDREDTHS)


def m_is_zero(lru, path, Py_ssize_t need):
    """As `e2_select_py.m_is_zero`."""
    return _m_is_zero(lru, path, need)


cdef bint _m_is_zero(object lru, object path, Py_ssize_t need) except -1:
    cdef object fb, c
    cdef dict cand
    cdef Py_ssize_t cold
    cdef PyObject* p
    if _cold_covers_c != NULL and isinstance(lru, _index_c):
        return _cold_covers_c(lru, path, need)
    if not lru.heap:
        return True
    fb = lru.floor_b
    if fb is None:
        return need <= 0
    cold = lru.below
    cand = lru.cand
    for node in path:
        p = PyDict_GetItem(cand, id(node))
        if p is not NULL:
            c = <object>p
            if c[0] < fb:
                cold -= <Py_ssize_t>c[1]
    return cold >= need


cdef inline Py_ssize_t _floordiv(Py_ssize_t a, Py_ssize_t b):
    """Python's a // b (rounds toward minus infinity), for b > 0."""
    cdef Py_ssize_t q = a / b
    if (a % b != 0) and (a < 0):
        q -= 1
    return q


cdef inline Py_ssize_t _pymod(Py_ssize_t a, Py_ssize_t m):
    """Python's a % m for m > 0 (never negative)."""
    cdef Py_ssize_t r = a % m
    return r + m if r < 0 else r


cdef inline object _cost_of(dict cost_memo, object cost_model, object wid):
    """`cost_memo.get(wid) or cost_model(wid)`: a worker's cost model."""
    cdef PyObject* p = PyDict_GetItem(cost_memo, wid)
    if p is not NULL and <object>p:
        return <object>p
    return cost_model(wid)


cdef class Outstanding:
    """As `e2_select_py.Outstanding`, with `queued_s` and the counts as C numbers: the selects read them in C (a
    field each, where the reference's are attribute reads of boxed numbers). Paired on full video QA, 16 workers:
    select ×0.92-0.97, on_dispatch ×1.00-1.01 (README "Decision cost"). `add` and `drop` take ints and floats
    (the tokens as C integers); the tuples in `queued` hold the objects given."""

    cdef public dict queued, decoding
    cdef public double queued_s
    cdef public long long queued_tokens, decoding_ctx, num_decoding

    def __init__(self):
        self.queued = {}
        self.decoding = {}
        self.queued_s = 0.0
        self.queued_tokens = 0
        self.decoding_ctx = 0
        self.num_decoding = 0

    def add(self, request_id, missed_tokens, prefill_s):
        self._drop(request_id)
        self.queued[request_id] = (missed_tokens, prefill_s)
        self.queued_s += <double>prefill_s
        self.queued_tokens += <long long>missed_tokens

    def first_token(self, request_id, context_tokens):
        cdef object q = self.queued.pop(request_id, None)
        if q is None:
            return
        self._unqueue(<tuple>q)
        self.decoding[request_id] = context_tokens  # (not there: `add` dropped it)
        self.decoding_ctx += <long long>context_tokens
        self.num_decoding += 1

    def drop(self, request_id):
        self._drop(request_id)

    cdef int _drop(self, object request_id) except -1:
        cdef object q = self.queued.pop(request_id, None), c
        if q is not None:
            self._unqueue(<tuple>q)
        c = self.decoding.pop(request_id, None)
        if c is not None:
            self.decoding_ctx -= <long long>c
            self.num_decoding -= 1
        return 0

    cdef int _unqueue(self, tuple q) except -1:
        if not self.queued:  # NOTE: exact reset, so float drift never outlives an empty queue
            self.queued_s, self.queued_tokens = 0.0, 0
        else:
            self.queued_tokens -= <long long>q[0]
            self.queued_s -= <double>q[1]
        return 0

    def decode_fraction(self):
        """As the reference's (`_decode_fraction`)."""
        return _decode_fraction(self)


cdef inline double _queued_s(object o) except? -1.0:
    """`max(0.0, o.queued_s)` compared in C (NaN: 0.0): a field on this build's `Outstanding`."""
    cdef double q = (<Outstanding>o).queued_s if type(o) is Outstanding else PyFloat_AsDouble(o.queued_s)
    return q if q > 0.0 else 0.0


cdef inline Py_ssize_t _queued_tokens(object o) except? -1:
    """`o.queued_tokens`: a field on this build's `Outstanding`."""
    return <Py_ssize_t>(<Outstanding>o).queued_tokens if type(o) is Outstanding else <Py_ssize_t>o.queued_tokens


cdef struct Bound:
    double load, r, q, lb  # L, R, Q and the bound L + R + Q
    Py_ssize_t evict, rot  # blocks R_k would evict; the rotated index


cdef int _fill(BoundsEnv env, object ws, dict cached, Py_ssize_t n, double now, Bound* out,
               Py_ssize_t turn) except -1:
    """Each worker's `Bound` into out[0..len(ws))."""
    cdef Py_ssize_t m = len(ws), i = 0, cb, bs, cap, tok, missed, used, by_stats, need, evict, k, nmemo = 0
    cdef double r, load, q, cutoff = now - env.window_s
    cdef bint found
    cdef PyObject* p
    cdef object wid, cost, f
    # R's memo: (cached blocks, block size, cost model) -> (missed tokens, R), up to _MEMO entries (candidates
    # hold one or two distinct prefix lengths; past that R is priced again, the same float); `held` keeps the
    # models alive, so their addresses stay unique for the call
    cdef Py_ssize_t mk_cb[_MEMO]
    cdef Py_ssize_t mk_bs[_MEMO]
    cdef Py_ssize_t mk_missed[_MEMO]
    cdef void* mk_cost[_MEMO]
    cdef double mk_r[_MEMO]
    cdef list held = []
    for w in ws:
        if i >= m:  # the sequence grew under us (it cannot through the policy): never write past the array
            break
        wid = w.worker_id
        cost = _cost_of(env.cost_memo, env.cost_model, wid)
        p = PyDict_GetItem(env.facts, wid)
        if p is NULL:
            bs, cap = w.block_size, w.kv_capacity_blocks
        else:
            f = <object>p
            bs, cap = f.block_size, f.kv_capacity_blocks
        cb = cached[wid]
        for k in range(nmemo):
            if mk_cb[k] == cb and mk_bs[k] == bs and mk_cost[k] == <void*>cost:
                missed, r = mk_missed[k], mk_r[k]
                break
        else:
            tok = cb * bs
            if tok >= n:  # the last token is always computed
                tok = n - 1 if n > 0 else 0
            missed = n - tok
            r = _prefill_s(cost, missed, tok)
            if nmemo < _MEMO:
                held.append(cost)
                mk_cb[nmemo], mk_bs[nmemo], mk_cost[nmemo] = cb, bs, <void*>cost
                mk_missed[nmemo], mk_r[nmemo] = missed, r
                nmemo += 1
        evict = 0
        if env.evict_on and PyDict_GetItem(env.lru, wid) is not NULL:
            p = PyDict_GetItem(env.resident_count, wid)
            used = <object>p if p is not NULL else 0
            by_stats = <Py_ssize_t>(PyFloat_AsDouble(w.kv_usage_frac) * <double>cap)
            if by_stats > used:
                used = by_stats
            need = -_floordiv(-missed, bs)
            evict = need if env.assume_full else need - (cap - used if cap > used else 0)
        load = 0.0
        if env.with_l:
            p = PyDict_GetItem(env.load_memo, wid)
            found = False
            if (p is not NULL and PyTuple_CheckExact(<object>p) and PyTuple_GET_SIZE(<object>p) >= 3
                    and PyTuple_GET_SIZE(<object>p) % 2 == 1
                    and PyFloat_AsDouble(<object>PyTuple_GET_ITEM(<object>p, 0)) <= now):
                for k in range(1, PyTuple_GET_SIZE(<object>p), 2):
                    if cutoff <= PyFloat_AsDouble(<object>PyTuple_GET_ITEM(<object>p, k)):
                        load = PyFloat_AsDouble(<object>PyTuple_GET_ITEM(<object>p, k + 1))
                        found = True
                        break
            if not found:
                load = PyFloat_AsDouble(env.load_s(wid, now))
        q = 0.0
        if env.with_q:
            p = PyDict_GetItem(env.outstanding, wid)
            if p is not NULL:
                q = _queued_s(<object>p)
        out[i].load, out[i].r, out[i].q, out[i].evict = load, r, q, evict
        out[i].lb = load + r + q
        out[i].rot = _pymod(i - turn, m)
        i += 1
    if i != m:
        raise ValueError("e2_select: the candidate sequence changed length while it was priced")
    return 0


cdef inline bint _before(Bound* a, Bound* b):
    """(a.lb, a.rot) < (b.lb, b.rot), as Python compares the tuples."""
    return a.lb < b.lb or (a.lb == b.lb and a.rot < b.rot)


def raw_bounds(BoundsEnv env, ws, dict cached, Py_ssize_t n, double now):
    """As `e2_select_py.raw_bounds`."""
    cdef Py_ssize_t m = len(ws), i
    cdef list out = []
    cdef Bound* b = <Bound*>PyMem_Malloc((m if m else 1) * sizeof(Bound))
    if b == NULL:
        raise MemoryError()
    try:
        _fill(env, ws, cached, n, now, b, 0)
        for i in range(m):
            out.append((b[i].load, b[i].r, b[i].q, b[i].evict))
    finally:
        PyMem_Free(b)
    return out


def cheapest(BoundsEnv env, ws, dict cached, Py_ssize_t n, double now, Py_ssize_t turn, price_m, path):
    """As `e2_select_py.cheapest`: the bounds in C structs, ordered by an insertion sort of their indices (a
    candidate set is at most the fleet), the branch and bound over them in C; Python only for M past its early
    exits."""
    return _cheapest(env, ws, cached, n, now, turn, price_m, None, path)


cdef tuple _cheapest(BoundsEnv env, object ws, dict cached, Py_ssize_t n, double now, Py_ssize_t turn,
                     object price_m, SelectEnv senv, object path):
    """`cheapest`, with M from `price_m(i, evict)`, or where `senv` is given from the policy's
    `_evict_s(ws[i], evict, now, protected)`, `protected` (`_protected(path)`) built once, at the first M."""
    cdef Py_ssize_t m = len(ws), i, j, t, best = -1
    cdef double mm, total, best_total = 0.0
    cdef Py_ssize_t best_rot = 0
    cdef list priced = []
    cdef object protected = None, lru
    cdef Bound* b
    cdef Py_ssize_t* order
    if m == 0:
        raise ValueError("cheapest: no worker to price")
    b = <Bound*>PyMem_Malloc(m * sizeof(Bound) + m * sizeof(Py_ssize_t))
    if b == NULL:
        raise MemoryError()
    order = <Py_ssize_t*>(<char*>b + m * sizeof(Bound))
    try:
        _fill(env, ws, cached, n, now, b, turn)
        for i in range(m):
            t = i
            j = i
            while j > 0 and _before(&b[t], &b[order[j - 1]]):
                order[j] = order[j - 1]
                j -= 1
            order[j] = t
        for j in range(m):
            i = order[j]
            if best >= 0 and (b[i].lb > best_total or (b[i].lb == best_total and b[i].rot > best_rot)):
                break  # this bound and every later one exceed the best total
            mm = 0.0
            if b[i].evict > 0:
                lru = env.lru[ws[i].worker_id]
                if not _m_is_zero(lru, path, b[i].evict):
                    if senv is None:
                        mm = PyFloat_AsDouble(price_m(i, b[i].evict))
                    else:
                        if protected is None:
                            protected = _protected(senv, path)
                        mm = _evict_s(senv, ws[i], lru, b[i].evict, now, protected)
            priced.append((i, b[i].load, mm, b[i].r, b[i].q))
            total = b[i].load + mm + b[i].r + b[i].q
            if best < 0 or total < best_total or (total == best_total and b[i].rot < best_rot):
                best, best_total, best_rot = i, total, b[i].rot
    finally:
        PyMem_Free(b)
    return best, priced


cdef object _protected(SelectEnv senv, object path):
    """`PrebleE2._protected(path)`, the ids of the path's nodes, as a set built in C (the staticmethod's comprehension
    was ~1.3 µs p50 of a cold select), unless the policy's class or instance has another `_protected`."""
    cdef set out
    if ((senv.policy_dict is not None and PyDict_GetItem(senv.policy_dict, "_protected") is not NULL)
            or getattr(type(senv.policy), "_protected", None) is not senv.protected_fn):
        return senv.policy._protected(path)
    out = set()
    for node in path:
        out.add(PyLong_FromVoidPtr(<void*>node))  # id(node)
    return out


cdef double _evict_s(SelectEnv senv, object w, object lru, Py_ssize_t evict, double now, object protected) except? -1.0:
    """M: `PrebleE2._evict_s`, and in it `LruPricing.eviction_cost` past the early exits `_m_is_zero` took, as
    one C call into the worker's eviction order (`price`): the same float without their two Python frames, while
    the policy's class, the index's class and the policy instance have `m_pricing`'s methods; else (a subclass, a
    patch) the policy's `_evict_s`."""
    cdef object wid, cost, order, lru_type = type(lru)
    if ((senv.policy_dict is not None and PyDict_GetItem(senv.policy_dict, "_evict_s") is not NULL)
            or getattr(type(senv.policy), "_evict_s", None) is not senv.evict_s_fn
            or getattr(lru_type, "eviction_cost", None) is not senv.eviction_cost_fn
            or getattr(lru_type, "order", None) is not senv.order_fn):
        return PyFloat_AsDouble(senv.policy._evict_s(w, evict, now, protected))
    senv.recent_needs.append(evict)
    wid = w.worker_id
    cost = _cost_of(senv.bounds.cost_memo, senv.bounds.cost_model, wid)
    order = lru._order
    if order is None:
        order = lru.order(wid)
    senv.fused_ms += 1
    if type(order) is _order_c:
        return _price_c(order, evict, protected, now - senv.node_window_s, w.block_size, cost,
                        isinstance(cost, senv.profile_cost), senv.m_term)
    return PyFloat_AsDouble(order.price(evict, protected, now - senv.node_window_s, w.block_size, cost,
                                        isinstance(cost, senv.profile_cost), senv.m_term))


cdef object _decide(SelectEnv env, object ctx, object w, str why, object cached_len, object missed_len, object ws,
                    list priced):
    """`PrebleE2._decide` of w with `_costs(ws, priced)` for its DEBUG line (the policy's own, when DEBUG is on)."""
    cdef object wid, key, got
    cdef PyObject* p = NULL
    if env.debug_cache is not None:
        p = PyDict_GetItem(env.debug_cache, _DEBUG)
    if (p is NULL or <object>p is not False) and env.debug_on(_DEBUG):
        return env.policy._decide(ctx, w, why, cached_len, missed_len, partial(env.policy._costs, ws, priced))
    wid = w.worker_id
    key = (wid, why)
    p = PyDict_GetItem(env.decisions, key)
    if p is not NULL:
        return <object>p
    got = env.decision(worker_id=wid, reason=why)
    if len(env.decisions) >= env.decisions_cap:
        env.decisions.clear()
    env.decisions[key] = got
    return got


cdef double _decode_fraction(object o) except? -1.0:
    """`Outstanding.decode_fraction()`: decoding / (decoding + queued tokens), 0 when idle (in C for int tokens:
    both counts are exact doubles, so the quotient is Python's correctly rounded int division; the decoding
    count from `num_decoding`, on the record's own lines; this build's record's fields read in C)."""
    cdef object qt
    cdef long long d, total
    if type(o) is Outstanding:
        d = (<Outstanding>o).num_decoding
        total = d + (<Outstanding>o).queued_tokens
    else:
        qt = o.queued_tokens
        if type(qt) is not int:
            return PyFloat_AsDouble(o.decode_fraction())
        d = o.num_decoding
        total = d + <long long>qt
    return <double>d / <double>total if total > 0 else 0.0


def select_e2(SelectEnv env, ctx, fleet, double now):
    """As `e2_select_py.select_e2`: `PrebleE2.select_steps` in C, step for step, the policy's step methods
    called only off the default path (excluded workers, a new pool, exploit overflow, hit-ratio DECODERATIO, the
    DEBUG line); M by `_evict_s` below."""
    cdef object policy = env.policy, tree = policy.tree, pool, memo, hashes, path, got, key, st, pick, w
    cdef object model = ctx.model
    cdef dict zero, by_id, cached
    cdef list ks, priced, heavy, over_i, over_r
    cdef Py_ssize_t best, bs, n, cached_len, missed_len, m, i, j, bi, turn, rot, best_rot
    cdef double r, best_r
    cdef int hk
    cdef str why
    if ctx.excluded_workers:
        pool = policy.pool(ctx, fleet)
    else:
        pool = fleet.routable(model)
    if not pool:
        return None
    if policy._fleet is not fleet or env.remembered.get(model) is not pool:
        policy._remember(fleet, pool, model)
    memo = policy._pool_memo
    if memo is not None and (<tuple>memo)[0] is pool:
        zero, by_id = (<tuple>memo)[1], (<tuple>memo)[2]
    else:
        zero, by_id = policy._pool_index(pool)
    # prefix
    hashes = ctx.block_hashes
    if hashes:
        got = tree.match_cached(hashes, zero, env.evicted)
        cached, best, path = (<tuple>got)[0], (<tuple>got)[1], (<tuple>got)[2]
        policy._prefix_memo = (ctx.request_id, hashes, policy._tree_gen, cached, path)
    else:
        cached, best, path = zero.copy(), 0, []
    bs = pool[0].block_size
    n = len(ctx.prompt_token_ids)
    cached_len = best * bs
    if cached_len > n:
        cached_len = n
    missed_len = n - cached_len
    turn = policy._turn
    if cached_len > missed_len:
        got = tree.key_portion(path, best, env.study)
        key = (<tuple>got)[0]
        if key is not None:
            st = key.stats
            if isinstance(st, env.node_stats):
                ks = _exploit_set(cached, (<tuple>got)[1], by_id, st.redirect, st.replicas, now)
            else:
                ks = _exploit_set(cached, (<tuple>got)[1], by_id, None, None, now)
            if ks:
                if len(ks) == 1:
                    pick, why, priced = ks[0], "exploit only holder", []
                else:
                    got = _cheapest(env.bounds, ks, cached, n, now, turn, None, env, path)
                    pick, priced, why = ks[<Py_ssize_t>(<tuple>got)[0]], (<tuple>got)[1], "exploit"
                if env.overflow:
                    got = policy._overflow(ctx, pick, ks, pool, cached, path, now)
                    if got is not None:
                        return policy._decide(ctx, (<tuple>got)[0], "explore overflow", cached_len, missed_len,
                                          (<tuple>got)[1].copy)
                return _decide(env, ctx, pick, why, cached_len, missed_len, ks, priced)
    if env.pd_on:
        m = len(pool)
        over_i, over_r = [], []
        if env.decode_tokens:
            i = 0
            for w in pool:
                got = env.outstanding.get(w.worker_id)
                r = _decode_fraction(got) if got is not None else 0.0
                if r > env.imbalance:
                    over_i.append(i)
                    over_r.append(r)
                i += 1
        else:
            i = 0
            for got in policy._ratios(pool, now):
                if got > env.imbalance:
                    over_i.append(i)
                    over_r.append(got)
                i += 1
        if over_i:
            heavy = [pool[i] for i in over_i]
            if env.pd_argmax:  # the highest ratio; ties: the lowest rotated index (unique), as everywhere
                bi, best_r, best_rot = -1, 0.0, 0
                for j in range(len(over_i)):
                    i = over_i[j]
                    r = over_r[j]
                    rot = _pymod(i - turn, m)
                    if bi < 0 or r > best_r or (r == best_r and rot < best_rot):
                        bi, best_r, best_rot = j, r, rot
                w, priced = pool[over_i[bi]], []
            else:  # the lightest of the decode-heavy workers
                got = _cheapest(env.bounds, heavy, cached, n, now, turn, None, env, path)
                w, priced = heavy[<Py_ssize_t>(<tuple>got)[0]], (<tuple>got)[1]
                for bi in range(len(over_i)):
                    if pool[over_i[bi]] is w:
                        break
            # its reason shows the ratio to two decimals: a built string (formatting a float was ~4.4 µs p50 of a
            # cold select's ~30 µs), `format`'s text only past 0 <= ratio <= 1
            hk = _hundredths(over_r[bi])
            if hk >= 0:
                why = <str>PyTuple_GET_ITEM(env.pd_reasons, hk)
            else:
                why = "explore P/D ratio=" + format(over_r[bi], ".2f") + env.pd_suffix
            return _decide(env, ctx, w, why, cached_len, missed_len, heavy, priced)
    got = _cheapest(env.bounds, pool, cached, n, now, turn, None, env, path)
    return _decide(env, ctx, pool[<Py_ssize_t>(<tuple>got)[0]], "explore", cached_len, missed_len, pool,
                   (<tuple>got)[1])


cdef class ArgminEnv:
    """As `e2_select_py.ArgminEnv`."""

    cdef public dict cost_memo, outstanding, queued
    cdef public object cost_model, batched_tokens
    cdef public double queue_weight, prefix_weight, decode_weight, interference_weight
    cdef public double externality_weight, interference_term_weight, behind_weight, window_s
    cdef public bint queue_by_sum, joint_prefill

    def __init__(self, *, dict cost_memo, cost_model, dict outstanding, dict queued, batched_tokens,
                 double queue_weight, double prefix_weight, double decode_weight, double interference_weight,
                 bint queue_by_sum, bint joint_prefill, double externality_weight, double interference_term_weight,
                 double behind_weight, double window_s):
        self.cost_memo, self.cost_model, self.outstanding = cost_memo, cost_model, outstanding
        self.queued, self.batched_tokens = queued, batched_tokens
        self.queue_weight, self.prefix_weight, self.decode_weight = queue_weight, prefix_weight, decode_weight
        self.interference_weight, self.queue_by_sum, self.joint_prefill = (interference_weight, queue_by_sum,
                                                                          joint_prefill)
        self.externality_weight, self.interference_term_weight = externality_weight, interference_term_weight
        self.behind_weight, self.window_s = behind_weight, window_s


cdef struct ArgminBound:
    double lb
    Py_ssize_t rot, i


cdef double _queued_prefill(ArgminEnv env, object w, object cost, Py_ssize_t t, Py_ssize_t missed,
                           Py_ssize_t* k) except? -1.0:
    """As `e2_select_py.queued_prefill` (t > 0); the chunks' count into k[0]."""
    cdef Py_ssize_t b = env.batched_tokens(w)
    cdef double q
    k[0] = 0
    if env.joint_prefill and t + missed <= b:
        q = _prefill_s(cost, t + missed, 0) - _prefill_s(cost, missed, 0)
        return q if q > 0.0 else 0.0
    k[0] = -_floordiv(-t, b)
    return <double>k[0] * _prefill_s(cost, -_floordiv(-t, k[0]), 0)


cdef double _step_gain(ArgminEnv env, object w, object cost, object o, double r, Py_ssize_t missed) except? -1.0:
    """As `e2_select_py.step_gain`."""
    cdef Py_ssize_t t = _queued_tokens(o) if o is not None and env.joint_prefill else 0
    cdef double gain
    if t > 0 and t + missed <= <Py_ssize_t>env.batched_tokens(w):
        gain = _prefill_s(cost, t + missed, 0) - _prefill_s(cost, t, 0) + r - _prefill_s(cost, missed, 0)
    else:
        gain = r - _prefill_s(cost, 0, 0)
    return gain if gain > 0.0 else 0.0


cdef int _argmin_fill(ArgminEnv env, object pool, dict cached, Py_ssize_t p, Py_ssize_t d, Py_ssize_t turn,
                      ArgminBound* out, Py_ssize_t m) except -1:
    """Each pool worker's bound into out[0..m) (`e2_select_py.argmin_bounds`, the same floats in the same order).
    R and D_self are priced once per (cost model, cached tokens), up to _MEMO pairs (the same floats again)."""
    cdef Py_ssize_t i = 0, tok, missed, k, nq, nmemo = 0, j, t
    cdef Py_ssize_t last = p - 1 if p > 1 else 0
    cdef double r, d_self, q, interference, ctx = <double>p + <double>(d - 1) / 2.0
    cdef double qw = env.queue_weight, pw = env.prefix_weight, dw = env.decode_weight, iw = env.interference_weight
    cdef PyObject* got
    cdef object wid, cost, o
    cdef Py_ssize_t mk_tok[_MEMO]
    cdef void* mk_cost[_MEMO]
    cdef double mk_r[_MEMO]
    cdef double mk_d[_MEMO]
    cdef bint found
    cdef list held = []  # keeps the memo's cost models alive, so their addresses stay unique for the call
    for w in pool:
        if i >= m:
            break
        wid = w.worker_id
        cost = _cost_of(env.cost_memo, env.cost_model, wid)
        tok = <Py_ssize_t>cached[wid] * <Py_ssize_t>w.block_size
        if tok > last:
            tok = last
        missed = p - tok
        found = False
        for j in range(nmemo):
            if mk_cost[j] == <void*>cost and mk_tok[j] == tok:
                r, d_self, found = mk_r[j], mk_d[j], True
                break
        if not found:
            r = _prefill_s(cost, missed, tok)
            d_self = _decode_s(cost, d, ctx)
            if nmemo < _MEMO:
                held.append(cost)
                mk_cost[nmemo], mk_tok[nmemo], mk_r[nmemo], mk_d[nmemo] = <void*>cost, tok, r, d_self
                nmemo += 1
        got = PyDict_GetItem(env.outstanding, wid)
        o = <object>got if got is not NULL else None
        q = 0.0
        if env.queue_by_sum:
            if o is not None:
                q = _queued_s(o)
        elif o is not None:
            t = _queued_tokens(o)
            if t > 0:
                q = _queued_prefill(env, w, cost, t, missed, &k)
        got = PyDict_GetItem(env.queued, wid)
        nq = len(<object>got) if got is not NULL else 0
        interference = 0.0
        if nq:
            interference = <double>nq * _step_gain(env, w, cost, o, r, missed)
        out[i].lb = qw * q + pw * r + dw * d_self + iw * interference
        out[i].rot = _pymod(i - turn, m)
        out[i].i = i
        i += 1
    if i != m:
        raise ValueError("argmin_order: the pool changed length while it was priced")
    return 0


def argmin_bounds(ArgminEnv env, pool, dict cached, Py_ssize_t p, Py_ssize_t d):
    """As `e2_select_py.argmin_bounds`."""
    cdef Py_ssize_t m = len(pool), i
    cdef ArgminBound* b = <ArgminBound*>PyMem_Malloc((m if m else 1) * sizeof(ArgminBound))
    if b == NULL:
        raise MemoryError()
    try:
        _argmin_fill(env, pool, cached, p, d, 0, b, m)
        return [b[i].lb for i in range(m)]
    finally:
        PyMem_Free(b)


def argmin_order(ArgminEnv env, pool, dict cached, Py_ssize_t p, Py_ssize_t d, Py_ssize_t turn):
    """As `e2_select_py.argmin_order`: the bounds in C structs, ordered by an insertion sort on (bound, rot) (a
    pool is at most the fleet; the rotation is a permutation, so no two keys tie)."""
    cdef Py_ssize_t m = len(pool), i, j
    cdef ArgminBound x
    cdef ArgminBound* b = <ArgminBound*>PyMem_Malloc((m if m else 1) * sizeof(ArgminBound))
    if b == NULL:
        raise MemoryError()
    try:
        _argmin_fill(env, pool, cached, p, d, turn, b, m)
        for i in range(1, m):
            x = b[i]
            j = i
            while j > 0 and (x.lb < b[j - 1].lb or (x.lb == b[j - 1].lb and x.rot < b[j - 1].rot)):
                b[j] = b[j - 1]
                j -= 1
            b[j] = x
        return [(b[i].lb, b[i].rot, b[i].i) for i in range(m)]
    finally:
        PyMem_Free(b)


cdef int _co_sums(list batch, Py_ssize_t i_rem, Py_ssize_t i_ctx, Py_ssize_t prompt_tokens, Py_ssize_t d,
                  Py_ssize_t* m_sum, double* own_ctx, double* pair_ctx) except -1:
    """`co_residency`'s sums over `batch`, reading each tuple's remaining tokens at i_rem and context at i_ctx."""
    cdef Py_ssize_t m, rem, c, i, n = len(batch)
    cdef double half
    cdef tuple x
    m_sum[0], own_ctx[0], pair_ctx[0] = 0, 0.0, 0.0
    for i in range(n):
        x = <tuple>batch[i]
        rem, c = x[i_rem], x[i_ctx]
        m = rem if rem < d else d
        half = <double>(m - 1) / 2.0
        m_sum[0] += m
        own_ctx[0] += <double>m * (<double>c + half)
        pair_ctx[0] += <double>m * (<double>prompt_tokens + half)
    return 0


def head_terms(ArgminEnv env, w, cost, list running, list queued, Py_ssize_t p, Py_ssize_t d,
               Py_ssize_t cached_blocks, double load, double r, double q, double arrivals_per_s,
               double prefill_load, load_span_s):
    """As `e2_select_py.head_terms`: the same floats in the same order, the batch's sums in C (ints below 2^53,
    so each conversion is exact) and the profile's formulas in C for `ProfileCost`."""
    cdef Py_ssize_t shared = cached_blocks * <Py_ssize_t>w.block_size
    cdef Py_ssize_t last = p - 1 if p > 1 else 0
    cdef Py_ssize_t missed = p - (shared if shared <= last else last)
    cdef Py_ssize_t n = len(running) + len(queued), t, k = 0, ctx = 0, i, m_sum
    cdef double queue, d_self, d_in, d_out, gain, interference, backlog, busy, horizon, behind, lam
    cdef double in_run = 0.0, out_run = 0.0, in_q = 0.0, out_q = 0.0, own_ctx, pair_ctx
    cdef PyObject* got = PyDict_GetItem(env.outstanding, w.worker_id)
    cdef object o = <object>got if got is not NULL else None
    if env.queue_by_sum:
        queue = q
    else:
        t = 0
        if o is not None:
            t = _queued_tokens(o)
            if t < 0:
                t = 0
        queue = _queued_prefill(env, w, cost, t, missed, &k) if t else 0.0
        if n:
            for i in range(len(running)):
                ctx += <Py_ssize_t>(<tuple>running[i])[1]
            for i in range(len(queued)):
                ctx += <Py_ssize_t>(<tuple>queued[i])[0]
            queue += (<double>k + 1.5) * _decode_marginal_s(cost, <double>n, <double>ctx / <double>n)
    d_self = _decode_s(cost, d, <double>p + <double>(d - 1) / 2.0)
    _co_sums(running, 0, 1, p, d, &m_sum, &own_ctx, &pair_ctx)
    if m_sum:
        in_run = _decode_marginal_s(cost, <double>m_sum, own_ctx / <double>m_sum)
        out_run = _decode_marginal_s(cost, <double>m_sum, pair_ctx / <double>m_sum)
    _co_sums(queued, 2, 0, p, d, &m_sum, &own_ctx, &pair_ctx)
    if m_sum:
        in_q = _decode_marginal_s(cost, <double>m_sum, own_ctx / <double>m_sum)
        out_q = _decode_marginal_s(cost, <double>m_sum, pair_ctx / <double>m_sum)
    d_in = in_run + in_q
    d_out = out_run + out_q
    gain = _step_gain(env, w, cost, o, r, missed)
    interference = <double>n * gain
    backlog = queue + r
    busy = backlog
    if not prefill_load <= 0.0:  # `e2_select_py.busy_period`
        horizon = env.window_s if load_span_s is None else <double>load_span_s
        if prefill_load < 1.0 and backlog < horizon * (1.0 - prefill_load):
            horizon = backlog / (1.0 - prefill_load)
        busy = backlog if backlog > horizon else horizon
    behind = arrivals_per_s * busy * gain
    lam = env.externality_weight
    return (queue, d_self, d_in, d_out, interference, behind, missed,
            load + env.queue_weight * queue + env.prefix_weight * r,
            env.decode_weight * (d_self + d_in + lam * d_out),
            lam * (env.interference_term_weight * interference + env.behind_weight * behind))


def prefill(cost, Py_ssize_t missed, Py_ssize_t cached):
    """As `e2_select_py.prefill`."""
    return _prefill_s(cost, missed, cached)


def decode(cost, Py_ssize_t num_tokens, double context_tokens):
    """As `e2_select_py.decode`."""
    return _decode_s(cost, num_tokens, context_tokens)


def decode_marginal(cost, double num_tokens, double context_tokens):
    """As `e2_select_py.decode_marginal`."""
    return _decode_marginal_s(cost, num_tokens, context_tokens)


def co_residency(list batch, Py_ssize_t prompt_tokens, Py_ssize_t d, cost):
    """As `e2_select_py.co_residency`: the same sums in the same order, in C doubles (every int here is below
    2^53, so each conversion is exact), and `decode_marginal_s` in C for `ProfileCost`."""
    cdef Py_ssize_t m_sum = 0, m, rem, c, i, n = len(batch)
    cdef double own_ctx = 0.0, pair_ctx = 0.0, half
    cdef tuple x
    for i in range(n):
        x = <tuple>batch[i]
        rem, c = x[0], x[1]
        m = rem if rem < d else d
        half = <double>(m - 1) / 2.0
        m_sum += m
        own_ctx += <double>m * (<double>c + half)
        pair_ctx += <double>m * (<double>prompt_tokens + half)
    if not m_sum:
        return 0.0, 0.0
    return (_decode_marginal_s(cost, <double>m_sum, own_ctx / <double>m_sum),
            _decode_marginal_s(cost, <double>m_sum, pair_ctx / <double>m_sum))


cdef dict _NO_QUEUED = {}  # a worker with no queued requests (read only)


cdef int _cmp_double(const void* a, const void* b) noexcept nogil:
    cdef double x = (<const double*>a)[0], y = (<const double*>b)[0]
    return (x > y) - (x < y)


cdef double _water_level(double* s, Py_ssize_t n, double fill) noexcept nogil:
    """As `e2_select_py.water_level` over s[0..n), sorted here in place (equal values sum alike in any order)."""
    cdef double acc = 0.0, level
    cdef Py_ssize_t k
    qsort(s, n, sizeof(double), _cmp_double)
    for k in range(n):
        acc += s[k]
        level = (fill + acc) / <double>(k + 1)
        if k + 1 == n or level <= s[k + 1]:
            return level
    return 0.0


def water_level(values, double fill):
    """As `e2_select_py.water_level`."""
    cdef Py_ssize_t n = len(values), i
    cdef double* s = <double*>PyMem_Malloc((n if n else 1) * sizeof(double))
    if s == NULL:
        raise MemoryError()
    try:
        for i in range(n):
            s[i] = values[i]
        return _water_level(s, n, fill)
    finally:
        PyMem_Free(s)


def fill_level(ArgminEnv env, pool, ants, Py_ssize_t p, Py_ssize_t d, double rate):
    """As `e2_select_py.fill_level`: the pool read once in C (the cost memo, `env.queued`), each worker's D_self in C
    and its `decode_in` a C call on the Cython build's anticipators (`DECODE_IN_C`), F's formulas on the quickest
    worker and the water level in C."""
    cdef Py_ssize_t n = len(pool), i = 0
    if len(ants) != n:
        raise ValueError("fill_level: the pool and its anticipators differ in length")
    if n == 0:
        return 0.0, 0.0
    cdef double* s = <double*>PyMem_Malloc(n * sizeof(double))
    if s == NULL:
        raise MemoryError()
    cdef object wid, cost, cost_q = None, q, last = None
    cdef PyObject* got
    cdef Py_ssize_t half = d // 2
    cdef double fill, level, d_self = 0.0, slowest = 0.0, ctx = <double>p + <double>(d - 1) / 2.0
    cdef double d_self_q = 0.0, s_q = 0.0  # D_self, D_self + D_in on the worker the arrivals fill first
    try:
        for w, ant in zip(pool, ants):
            wid = w.worker_id
            cost = _cost_of(env.cost_memo, env.cost_model, wid)
            if cost is not last:  # the workers of one profile share its cost model: one D_self for them all
                d_self = _decode_s(cost, d, ctx)
                last = cost
                if d_self > slowest:
                    slowest = d_self
            got = PyDict_GetItem(env.queued, wid)
            q = <object>got if got is not NULL else _NO_QUEUED
            if _decode_in_c != NULL and type(ant) is _anticipator_c and type(q) is dict:
                s[i] = d_self + _decode_in_c(ant, <dict>q, d, cost)
            else:
                s[i] = d_self + PyFloat_AsDouble(ant.decode_in(q, d, cost))
            if i == 0 or s[i] < s_q:
                s_q, d_self_q, cost_q = s[i], d_self, cost
            i += 1
        # arrivals while r decodes alone (D_self), each sharing half of r's iterations at r's context
        fill = (rate * d_self_q
                * _decode_marginal_s(cost_q, <double>(half if half > 1 else 1), <double>(p + half)))
        level = _water_level(s, n, fill)
        return level, (level - slowest if level > slowest else 0.0)
    finally:
        PyMem_Free(s)
