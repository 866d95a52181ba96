"""Double-double arithmetic as Triton device functions: the float64 kernels' per-channel sums
and finishing steps, rounded once.

Why. float64 has no wider dtype to accumulate and finish its statistics in (narrower inputs
take float32's or float64's, ``finalize_stats``); in float64's own arithmetic M2 and invstd
round at every step, and the input gradient scales with invstd in every element, unaveraged
over few values a channel (``kernels/double_double.py``, whose formulas these mirror op for
op, so that a kernel's float64 invstd is ``torch_ops.float64_invstd``'s: a GPU's fused
multiply-adds may change only the corrections' last bits, far below the result's rounding).

A value is a pair ``(hi, lo)`` of float64 tensors, ``|lo| <= ulp(hi) / 2``. ``two_prod`` takes
its error from ``tl.fma`` (exact in float64 on a GPU and in the interpreter), where the ATen
version splits the factors (Dekker): both give the exact error. Where a result is not finite
its error is 0, and the high part alone is what float64 computes (NaN and inf propagate).
Only float64 kernels call these (a constexpr branch on the dtype): the other dtypes' kernels
keep their single sums and roundings, which their float32 or float64 accumulation covers.
"""

import triton
import triton.language as tl


@triton.jit
def _exact_where_finite(s, error):
    return s, tl.where(s - s == 0.0, error, 0.0)


@triton.jit
def two_sum(a, b):
    """``(s, e)``, ``s = fl(a + b)``, ``a + b = s + e`` exactly (Knuth)."""
    s = a + b
    b_virtual = s - a
    return _exact_where_finite(s, (a - (s - b_virtual)) + (b - b_virtual))


@triton.jit
def fast_two_sum(a, b):
    """``two_sum`` where ``|a| >= |b|`` (or a is 0)."""
    s = a + b
    return _exact_where_finite(s, b - (s - a))


@triton.jit
def two_prod(a, b):
    """``(p, e)``, ``p = fl(a b)``, ``a b = p + e`` exactly."""
    p = a * b
    return _exact_where_finite(p, tl.fma(a, b, -p))


@triton.jit
def add(a_hi, a_lo, b_hi, b_lo):
    s, e = two_sum(a_hi, b_hi)
    t, f = two_sum(a_lo, b_lo)
    s, e = fast_two_sum(s, e + t)
    return fast_two_sum(s, e + f)


@triton.jit
def mul(a_hi, a_lo, b_hi, b_lo):
    p, e = two_prod(a_hi, b_hi)
    return fast_two_sum(p, e + (a_hi * b_lo + a_lo * b_hi))


@triton.jit
def _finite_or_zero(t):
    return tl.where(t - t == 0.0, t, 0.0)


@triton.jit
def quotient(a_hi, a_lo, b):
    """``a / b`` of a double-double a and float64 b: float64's quotient q of a_hi and ``(a_hi
    - q b + a_lo) / b``, the remainder exact: a float64 number (q is a rounded quotient),
    which one fused multiply-add gives, with no ``q b`` to overflow for a dividend near
    float64's largest (the ATen version's scaled ``two_prod``: the same bits); the
    correction 0 where it is not finite."""
    q = a_hi / b
    return fast_two_sum(q, _finite_or_zero((tl.fma(-q, b, a_hi) + a_lo) / b))


@triton.jit
def rsqrt(v_hi, v_lo):
    """``1 / sqrt(v)`` for v > 0 (0 for an infinite v): float64's root r and one Newton step
    ``r + r (1 - v r^2) / 2``, the residual ``(1 - p) - (p_e + h_e r + (v_lo r) r)`` from the
    exact products ``v_hi r = h + h_e`` and ``h r = p + p_e``; the step 0 where it is not
    finite."""
    r = tl.math.rsqrt(v_hi)
    h, h_error = two_prod(v_hi, r)
    p, p_error = two_prod(h, r)
    residual = (1.0 - p) - (p_error + (h_error * r + (v_lo * r) * r))
    return fast_two_sum(r, _finite_or_zero(r * residual * 0.5))


@triton.jit
def _halves(t, AXIS: tl.constexpr):
    """A 2-D ``t``'s two halves along ``AXIS`` (a power of two long)."""
    if AXIS == 0:
        t = tl.permute(tl.reshape(t, [2, t.shape[0] // 2, t.shape[1]]), (1, 2, 0))
    else:
        t = tl.permute(tl.reshape(t, [t.shape[0], 2, t.shape[1] // 2]), (0, 2, 1))
    return tl.split(t)


@triton.jit
def sum_along(hi, lo, AXIS: tl.constexpr):
    """Per row of a 2-D ``(hi, lo)`` along ``AXIS`` (0 or 1; its length a power of two), the
    double-double sum, pairwise: halves added until one is left. (Not ``tl.reduce`` with
    ``add`` as its combining function: the interpreter calls that once an element.)"""
    for _ in tl.static_range(32):
        if hi.shape[AXIS] > 1:
            hi_a, hi_b = _halves(hi, AXIS)
            lo_a, lo_b = _halves(lo, AXIS)
            hi, lo = add(hi_a, lo_a, hi_b, lo_b)
    if AXIS == 0:
        hi, lo = tl.reshape(hi, [hi.shape[1]]), tl.reshape(lo, [lo.shape[1]])
    else:
        hi, lo = tl.reshape(hi, [hi.shape[0]]), tl.reshape(lo, [lo.shape[0]])
    return hi, lo


@triton.jit
def accumulate(acc_hi, acc_lo, value, error):
    """``acc + (value + error)``, with ``|error|`` far below ``|value|``: the running sum's
    rounding is carried in its low part, which takes the small terms as they come."""
    s, e = two_sum(acc_hi, value)
    return s, acc_lo + (e + error)
