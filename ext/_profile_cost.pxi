# PREFILLTIME and DECODETIME in C for `ProfileCost`, shared by the Cython builds that price them (`include`d, so each
# module has its own copy of one source: `_e2_select_c` prices R and the default policy's bounds with them,
# `_lru_order_c` M's victim terms, `_anticipator_c` the iteration clock's rate).
# The formulas are `router/policies/preble_cost.ProfileCost`'s methods written out in their order of operations; the
# modules are compiled with -ffp-contract=off, so no fused multiply-add rounds differently: the same floats
# (`tests/ext/test_e2_select.py` and `tests/ext/test_lru_order.py` compare them).

from cpython.float cimport PyFloat_CheckExact
from cpython.long cimport PyLong_CheckExact
from cpython.tuple cimport PyTuple_GET_ITEM, PyTuple_GET_SIZE

cdef extern from "Python.h":
    double PyFloat_AsDouble(object) except? -1.0


cdef double _prefill_s(object cost, Py_ssize_t missed, Py_ssize_t cached) except? -1.0:
    """`cost.prefill_s(missed, cached)`. For a cost model whose `terms` are (step_ms, per_decode_ms,
    decode_ctx_ms_per_ktok, prefill_ms, lin_ms_per_tok, knee_tokens, attn_pair_ratio), six floats and an int
    (`ProfileCost`), its formula in C, operation for operation; anything else is asked."""
    cdef object k = getattr(cost, "terms", None)
    cdef Py_ssize_t e, c, over
    cdef double t
    if (type(k) is tuple and PyTuple_GET_SIZE(k) == 7 and PyLong_CheckExact(<object>PyTuple_GET_ITEM(k, 5))
            and PyFloat_CheckExact(<object>PyTuple_GET_ITEM(k, 0)) and PyFloat_CheckExact(<object>PyTuple_GET_ITEM(k, 1))
            and PyFloat_CheckExact(<object>PyTuple_GET_ITEM(k, 2)) and PyFloat_CheckExact(<object>PyTuple_GET_ITEM(k, 3))
            and PyFloat_CheckExact(<object>PyTuple_GET_ITEM(k, 4)) and PyFloat_CheckExact(<object>PyTuple_GET_ITEM(k, 6))
            and 0 <= missed < 1 << 26 and 0 <= cached < 1 << 26):  # e·c and e·(e+1) stay exact in a double and int64
        e, c = missed, cached
        over = e - <Py_ssize_t>(<object>PyTuple_GET_ITEM(k, 5))
        if over < 0:
            over = 0
        t = (PyFloat_AsDouble(<object>PyTuple_GET_ITEM(k, 0)) + PyFloat_AsDouble(<object>PyTuple_GET_ITEM(k, 1)) * 0.0
             + PyFloat_AsDouble(<object>PyTuple_GET_ITEM(k, 2)) * 0.0 / 1000.0
             + PyFloat_AsDouble(<object>PyTuple_GET_ITEM(k, 4))
             * (<double>over + PyFloat_AsDouble(<object>PyTuple_GET_ITEM(k, 6)) * <double>(e * c + e * (e + 1) / 2)))
        if e:
            t += PyFloat_AsDouble(<object>PyTuple_GET_ITEM(k, 3))
        return 0.001 * t
    return PyFloat_AsDouble(cost.prefill_s(missed, cached))



cdef inline bint _has_decode_terms(object k):
    """`k` is a `ProfileCost.terms` tuple whose decode constants (all but prefill_ms) are exact floats and ints."""
    return (type(k) is tuple and PyTuple_GET_SIZE(k) == 7 and PyLong_CheckExact(<object>PyTuple_GET_ITEM(k, 5))
            and PyFloat_CheckExact(<object>PyTuple_GET_ITEM(k, 0)) and PyFloat_CheckExact(<object>PyTuple_GET_ITEM(k, 1))
            and PyFloat_CheckExact(<object>PyTuple_GET_ITEM(k, 2)) and PyFloat_CheckExact(<object>PyTuple_GET_ITEM(k, 4))
            and PyFloat_CheckExact(<object>PyTuple_GET_ITEM(k, 6)))


cdef double _decode_iteration_s(object cost, Py_ssize_t num_decode_reqs, Py_ssize_t context_tokens) except? -1.0:
    """`cost.decode_iteration_s(num_decode_reqs, context_tokens)`: `ProfileCost`'s formula in C, operation for
    operation (one iteration of D sequences holding C context tokens); anything else is asked."""
    cdef object k = getattr(cost, "terms", None)
    cdef Py_ssize_t over
    if (_has_decode_terms(k) and 0 <= num_decode_reqs < 1 << 52 and 0 <= context_tokens < 1 << 52):
        over = num_decode_reqs - <Py_ssize_t>(<object>PyTuple_GET_ITEM(k, 5))
        if over < 0:
            over = 0
        return 0.001 * (PyFloat_AsDouble(<object>PyTuple_GET_ITEM(k, 0))
                        + PyFloat_AsDouble(<object>PyTuple_GET_ITEM(k, 1)) * <double>num_decode_reqs
                        + PyFloat_AsDouble(<object>PyTuple_GET_ITEM(k, 2)) * <double>context_tokens / 1000.0
                        + PyFloat_AsDouble(<object>PyTuple_GET_ITEM(k, 4))
                        * (<double>over + PyFloat_AsDouble(<object>PyTuple_GET_ITEM(k, 6)) * 0.0))
    return PyFloat_AsDouble(cost.decode_iteration_s(num_decode_reqs, context_tokens))


cdef double _decode_s(object cost, Py_ssize_t num_tokens, double context_tokens) except? -1.0:
    """`cost.decode_s(num_tokens, context_tokens)` for an int token count: `ProfileCost`'s formula (num_tokens ×
    one iteration of a single sequence at int(context) tokens) with `_decode_iteration_s`; anything else is
    asked."""
    if num_tokens > 0 and 0.0 <= context_tokens < <double>(1LL << 52) and _has_decode_terms(getattr(cost, "terms", None)):
        return <double>num_tokens * _decode_iteration_s(cost, 1, <Py_ssize_t>context_tokens)
    return PyFloat_AsDouble(cost.decode_s(num_tokens, context_tokens))


cdef double _decode_marginal_s(object cost, double num_tokens, double context_tokens) except? -1.0:
    """`cost.decode_marginal_s(num_tokens, context_tokens)`: `ProfileCost`'s formula (num_tokens × the increment
    iteration(D=2, C=2c) − iteration(D=1, C=c), c = int(context), at least 0) with `_decode_iteration_s`;
    anything else is asked."""
    cdef Py_ssize_t c
    cdef double inc
    if num_tokens <= 0:
        return 0.0 if _has_decode_terms(getattr(cost, "terms", None)) else PyFloat_AsDouble(
            cost.decode_marginal_s(num_tokens, context_tokens))
    if 0.0 <= context_tokens < <double>(1LL << 51) and _has_decode_terms(getattr(cost, "terms", None)):
        c = <Py_ssize_t>context_tokens
        inc = _decode_iteration_s(cost, 2, 2 * c) - _decode_iteration_s(cost, 1, c)
        return num_tokens * (inc if inc > 0.0 else 0.0)
    return PyFloat_AsDouble(cost.decode_marginal_s(num_tokens, context_tokens))
