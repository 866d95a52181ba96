"""The input gradient of a float64 training call over few values a channel, in double-double
arithmetic, rounded once.

Why. Over few values a channel (``inplace_policy.takes_double_double_gradient``) the input
gradient is a difference of terms larger than itself (``inplace_policy.rebuilds_from_count``),
and every rounding of the layer's arithmetic reaches it unaveraged. Narrower inputs compute in
float64 there (``functional.computes_in``); float64 has no wider dtype, and its roundings, as
many as nn.BatchNorm2d's in another order, exceed 3x its error (README, Limits) wherever its
happen to cancel. In double-double arithmetic every step errs by about 2^-104 relative, so
the one error left of any size is dx's final rounding (and, for an activation whose
derivative is transcendental, that derivative's float64 rounding).

How. A double-double number is an unevaluated sum ``hi + lo`` of float64 tensors with
``|lo| <= ulp(hi) / 2``. Built from error-free transformations, each an exact identity of
float64 operations rounding to nearest (no fused multiply-add needed)::

    two_sum(a, b) = (s, e):   s = fl(a + b),  e = (a - (s - b')) + (b - b'),  b' = fl(s - a)
                               a + b = s + e exactly (Knuth)
    split(a) = (h, l):        t = fl(c a),  h = fl(t - fl(t - a)),  l = fl(a - h),
                               c = 2^27 + 1; h and l hold 26 bits each (Dekker)
    two_prod(a, b) = (p, e):  p = fl(a b),  e = ((h_a h_b - p) + h_a l_b + l_a h_b) + l_a l_b
                               a b = p + e exactly (Dekker)

Sums over a channel's values are pairwise (halving), of double-double terms; the reciprocal
square root takes float64's ``rsqrt`` and one Newton step ``r + r (1 - v r^2) / 2`` with the
residual in double-double, which squares its relative error. With n values a channel::

    mean = sum(x) / n,   d = x - mean,   invstd = rsqrt(sum(d^2) / n + eps),   xhat = d invstd
    dz = dy act'(w xhat + b)
    dx = w invstd (dz - sum(dz) / n - xhat sum(dz xhat) / n)

The cost is a few dozen elementwise passes over the channel's values: nil at those counts,
and a call over more never comes here.
"""

from __future__ import annotations

import math
from fractions import Fraction

import torch

from .. import activations

_SPLITTER = float(2**27 + 1)

DD = tuple[torch.Tensor, torch.Tensor]


def _constant(value: Fraction) -> tuple[float, float]:
    """``value`` as a double-double pair of Python floats."""
    high = float(value)
    return high, float(value - Fraction(high))


# exp's range reduction: z = k ln 2 + 2^SQUARINGS r, then exp(r) by its Taylor polynomial
# (degree TAYLOR_DEGREE: |r| <= ln 2 / 2^(SQUARINGS + 1) leaves a remainder below 2^-110).
# ln 2: float64's, plus its error to 35 digits.
_LN2 = _constant(Fraction(math.log(2)) + Fraction("2.3190468138462996154948554638754786e-17"))
_SQUARINGS = 8
# Below about -745.1 float64's exp is 0 (under half its smallest subnormal).
_EXP_FLOOR = -800.0
_TAYLOR_DEGREE = 9
_INVERSE_FACTORIALS = [_constant(Fraction(1, math.factorial(k)))
                       for k in range(_TAYLOR_DEGREE + 1)]


def _exact_where_finite(s: torch.Tensor, error: torch.Tensor, checked: bool) -> DD:
    """``(s, error)``, the error 0 where s is infinite or NaN: there the transformation's
    own arithmetic makes NaN, and ``s`` alone is what float64 computes (NaN and inf
    propagate as in nn.BatchNorm2d). Unchecked, the error stays non-finite there, and so
    does every result it reaches (``batch_backward`` checks once)."""
    if not checked:
        return s, error
    return s, torch.where(torch.isfinite(s), error, 0.0)


def _over(scratch: torch.Tensor) -> torch.Tensor | None:
    """``scratch``, a temporary of the caller's, to take an elementwise result of its shape
    in its place; None (a new tensor) where autograd may record the steps (``torch_ops``'
    statistics under create_graph), which ``out=`` refuses."""
    return None if torch.is_grad_enabled() else scratch


def _sum_into(total: torch.Tensor, term: torch.Tensor) -> torch.Tensor:
    """``total + term``, over ``total`` (a temporary of the caller's) where it has the sum's
    shape."""
    if total.shape == torch.broadcast_shapes(total.shape, term.shape):
        return torch.add(total, term, out=_over(total))
    return total + term


def two_sum(a: torch.Tensor, b: torch.Tensor, checked: bool = True) -> DD:
    s = a + b
    b_virtual = s - a
    error = s - b_virtual
    error = torch.sub(a, error, out=_over(error))
    return _exact_where_finite(
        s, _sum_into(error, torch.sub(b, b_virtual, out=_over(b_virtual))), checked)


def _fast_two_sum(a: torch.Tensor, b: torch.Tensor, checked: bool = True) -> DD:
    """``two_sum`` where |a| >= |b| (or a is 0)."""
    s = a + b
    error = s - a
    return _exact_where_finite(s, torch.sub(b, error, out=_over(error)), checked)


def _split(a: torch.Tensor) -> DD:
    t = _SPLITTER * a
    high = t - a
    high = torch.sub(t, high, out=_over(high))
    return high, torch.sub(a, high, out=_over(t))


def two_prod(a: torch.Tensor, b: torch.Tensor, checked: bool = True) -> DD:
    p = a * b
    a_high, a_low = _split(a)
    b_high, b_low = _split(b) if b is not a else (a_high, a_low)
    # Every term has p's shape: summed over two temporaries.
    error = a_high * b_high
    error = torch.sub(error, p, out=_over(error))
    term = a_high * b_low
    error = _sum_into(error, term)
    error = _sum_into(error, torch.mul(a_low, b_high, out=_over(term)))
    error = _sum_into(error, torch.mul(a_low, b_low, out=_over(term)))
    return _exact_where_finite(p, error, checked)


def add(a: DD, b: DD, checked: bool = True) -> DD:
    s, e = two_sum(a[0], b[0], checked)
    t, f = two_sum(a[1], b[1], checked)
    s, e = _fast_two_sum(s, _sum_into(e, t), checked)
    return _fast_two_sum(s, _sum_into(e, f), checked)


def neg(a: DD) -> DD:
    return -a[0], -a[1]


def mul(a: DD, b: DD, checked: bool = True) -> DD:
    """``a b``; an infinite or NaN product of the high parts is the result as float64's, not
    the NaN its cross terms make (inf times a low part of 0)."""
    p, e = two_prod(a[0], b[0], checked)
    cross = _sum_into(a[0] * b[1], a[1] * b[0])
    s, error = _fast_two_sum(p, _sum_into(e, cross), checked)
    if not checked:
        return s, error
    finite = torch.isfinite(p)
    return torch.where(finite, s, p), torch.where(finite, error, 0.0)


def div(a: DD, b: DD, checked: bool = True) -> DD:
    """``a / b``: float64's quotient and two corrections from the double-double remainder."""
    zero = a[0].new_zeros(())
    q1 = a[0] / b[0]
    r = add(a, neg(mul(b, (q1, zero), checked)), checked)
    q2 = r[0] / b[0]
    r = add(r, neg(mul(b, (q2, zero), checked)), checked)
    q3 = r[0] / b[0]
    q = _fast_two_sum(q1, q2, checked)
    return add(q, (q3, zero), checked)


def rsqrt(v: DD, checked: bool = True) -> DD:
    """``1 / sqrt(v)`` for v > 0: one Newton step from float64's."""
    r = torch.rsqrt(v[0])
    zero = r.new_zeros(())
    residual = add((torch.ones_like(r), zero),
                   neg(mul(v, mul((r, zero), (r, zero), checked), checked)), checked)
    return _fast_two_sum(r, r * residual[0] * 0.5, checked)


def exp(z: DD) -> DD:
    """``exp(z)`` for z <= 0: ``2^k exp(r)^(2^_SQUARINGS)`` with ``r = (z - k ln 2) /
    2^_SQUARINGS`` (exact scalings by powers of 2). z below ``_EXP_FLOOR`` (-inf too) takes
    the floor's: 0, as float64's exp, where ``z - k ln 2`` would cancel to a residue too
    large for the polynomial."""
    below = z[0] < _EXP_FLOOR
    z = torch.where(below, _EXP_FLOOR, z[0]), torch.where(below, 0.0, z[1])
    k = torch.round(z[0] / _LN2[0])
    zero = torch.zeros_like(k)
    ln2 = (torch.full_like(k, _LN2[0]), torch.full_like(k, _LN2[1]))
    r = add(z, neg(mul((k, zero), ln2)))
    r = (torch.ldexp(r[0], torch.full_like(k, -_SQUARINGS)),
         torch.ldexp(r[1], torch.full_like(k, -_SQUARINGS)))
    high, low = _INVERSE_FACTORIALS[-1]
    p = (torch.full_like(k, high), torch.full_like(k, low))
    for high, low in reversed(_INVERSE_FACTORIALS[:-1]):
        p = add(mul(p, r), (torch.full_like(k, high), torch.full_like(k, low)))
    for _ in range(_SQUARINGS):
        p = mul(p, p)
    return torch.ldexp(p[0], k), torch.ldexp(p[1], k)


def channel_sum(a: DD, checked: bool = True) -> DD:
    """Per row of (C, n) double-double values, their sum, pairwise; (C, 1). The low part may
    be a single column (or a single value), the same for the whole row."""
    high, low = a
    while high.shape[1] > 1:
        half, width = high.shape[1] // 2, high.shape[1]
        if low.dim() < 2 or low.shape[1] == 1:  # the row's one low part: summed as one
            first, second = low, low
            low = low.expand(high.shape[0], width)
        else:
            first, second = low[:, :half], low[:, half:2 * half]
        s = add((high[:, :half], first), (high[:, half:2 * half], second), checked)
        if width == 2 * half:
            high, low = s
        else:
            high, low = (torch.cat([part, rest[:, 2 * half:]], 1)
                         for part, rest in zip(s, (high, low)))
    return high, low.expand_as(high)


def channel_rows(t: torch.Tensor) -> torch.Tensor:
    """An (N, C, *) tensor as (C, values a channel)."""
    return t.transpose(0, 1).reshape(t.shape[1], -1)


def _activation_slope(z: DD, dy: torch.Tensor, activation: str, param: float) -> DD:
    """``dy * act'(z)``: ELU's ``alpha exp(z)`` below 0 and the smooth activations'
    derivatives in double-double (``_SMOOTH_SLOPES``); the others' act' is piecewise constant,
    ATen's at z's high part (whose sign is z's) and exact."""
    zero = dy.new_zeros(())
    dy_dd = (dy, zero)
    if activation == "elu":
        positive = z[0] > 0
        below = exp((torch.clamp(z[0], max=0), torch.where(positive, 0.0, z[1])))
        slope = mul((dy.new_tensor(param), zero), below)
        slope = (torch.where(positive, 1.0, slope[0]), torch.where(positive, 0.0, slope[1]))
        return mul(dy_dd, slope)
    definition = activations.ACTIVATIONS[activation]
    if definition.derivative is None:
        return dy_dd
    smooth = _SMOOTH_SLOPES.get(activation)
    if smooth is not None:
        return mul(dy_dd, smooth(z))
    slope = definition.derivative(torch.ones_like(z[0]), z[0], param, torch.empty_like(z[0]))
    return mul(dy_dd, (slope, zero))


def _scaled(a: DD, factor: float) -> DD:
    """``a`` times a float64 ``factor``."""
    return mul(a, (a[0].new_tensor(factor), a[0].new_zeros(())))


def _sigmoids(a: DD) -> tuple[DD, DD]:
    """``(sigmoid(a), sigmoid(-a))`` from ``e = exp(-|a|)`` (``exp``, whose argument is <= 0):
    ``1 / (1 + e)`` and ``e / (1 + e)``, each to its own precision in both tails (where
    float64's ``1 - sigmoid`` loses it)."""
    negative = a[0] < 0
    e = exp((-a[0].abs(), torch.where(negative, a[1], -a[1])))
    one = (torch.ones_like(a[0]), torch.zeros_like(a[0]))
    large = div(one, add(one, e))
    small = mul(e, large)
    return _where(negative, small, large), _where(negative, large, small)


def _where(condition: torch.Tensor, a: DD, b: DD) -> DD:
    return torch.where(condition, a[0], b[0]), torch.where(condition, a[1], b[1])


def _silu_slope(z: DD) -> DD:
    """silu'(z) = s(z) + z s(z) s(-z), s the sigmoid."""
    up, down = _sigmoids(z)
    return add(up, mul(z, mul(up, down)))


def _gelu_slope(z: DD) -> DD:
    """gelu'(z) = Phi(z) + z phi(z): phi(z) = exp(-z^2 / 2) / sqrt(2 pi) in double-double;
    Phi(z) = erfc(-x) / 2, x = z / sqrt(2), float64's erfc at x's high part plus the step
    ``2 / sqrt(pi) exp(-x^2) x_lo`` (exp(-x^2) = sqrt(2 pi) phi(z)): erfc keeps its digits in
    both tails, where ATen's 1 + erf(x) loses them (all below z of about -8), and errs by
    about a rounding of Phi elsewhere."""
    density = mul(exp(_scaled(mul(z, z), -0.5)), _INV_SQRT_2PI_DD(z))
    x = mul(z, _SQRT_HALF_DD(z))
    cdf = (torch.special.erfc(-x[0]).mul_(0.5)
           .add_(math.sqrt(2.0) * (density[0] + density[1]) * x[1]))
    return add(mul(z, density), (cdf, cdf.new_zeros(())))


def _gelu_tanh_slope(z: DD) -> DD:
    """gelu_tanh'(z) = s(2u) + 2 z s(2u) s(-2u) u'(z), u = k (z + c z^3), u' = k (1 + 3 c z^2),
    k = sqrt(2 / pi), c = 0.044715 (float64's, as ATen's), s the sigmoid: ``(1 + tanh(u)) / 2
    = s(2u)`` and ``1 - tanh(u)^2 = 4 s(2u) s(-2u)`` keep their digits in both tails, where
    ATen's ``1 + tanh(u)`` loses them (most below z of about -5, all below -7)."""
    k, c = _SQRT_2_OVER_PI_DD(z), _GELU_TANH_CUBIC(z)
    c_z2 = mul(c, mul(z, z))
    one = (torch.ones_like(z[0]), torch.zeros_like(z[0]))
    u = mul(k, mul(z, add(one, c_z2)))
    up, down = _sigmoids(_scaled(u, 2.0))
    du = mul(k, add(one, _scaled(c_z2, 3.0)))
    return add(up, mul(_scaled(z, 2.0), mul(mul(up, down), du)))


def _dd_constant(value: Fraction):
    """A double-double constant as a function of a tensor to take its shape from."""
    high, low = _constant(value)
    return lambda like: (torch.full_like(like[0], high), torch.full_like(like[0], low))


# 1 / sqrt(2 pi), 1 / sqrt(2): float64's, plus the error to 32 digits.
_INV_SQRT_2PI_DD = _dd_constant(Fraction(1 / math.sqrt(2 * math.pi))
                                + Fraction("-2.4923272022777300786441381511657e-17"))
_SQRT_HALF_DD = _dd_constant(Fraction(math.sqrt(0.5))
                             + Fraction("-4.8336466567264565185935844299127932e-17"))
# sqrt(2 / pi): float64's, plus the error to 32 digits.
_SQRT_2_OVER_PI_DD = _dd_constant(Fraction(math.sqrt(2 / math.pi))
                                  + Fraction("-4.9846544045554601572882763023315e-17"))
# gelu_tanh's cubic coefficient: float64's 0.044715, the number ATen and nn.GELU compute with.
_GELU_TANH_CUBIC = _dd_constant(Fraction(0.044715))
# The smooth activations' act' in double-double from z's both parts, where ATen's float64
# loses its tails and z's low part.
_SMOOTH_SLOPES = {"gelu": _gelu_slope, "gelu_tanh": _gelu_tanh_slope, "silu": _silu_slope}


# Elements a block of channels of ``batch_backward`` takes at once: the few hundred
# elementwise steps' temporaries then stay in cache, and the transient memory is a block's.
_BLOCK_ELEMENTS = 1 << 16


def batch_backward(x: torch.Tensor, dy: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                   eps: float, activation: str, param: float
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dx, sum(dz), sum(dz * xhat))`` of training-mode BatchNorm (biased variance) + the
    activation over the whole float64 batch ``x`` (N, C, *), each rounded once from
    double-double (module docstring); a block of channels at a time (``_BLOCK_ELEMENTS``)."""
    channels = x.shape[1]
    grad_input = torch.empty_like(x)
    sums = x.new_empty(2, channels)
    weight, bias = (p.to(x.dtype) for p in (weight, bias))
    step = max(1, _BLOCK_ELEMENTS * channels // max(x.numel(), 1))
    for start in range(0, channels, step):
        block = slice(start, start + step)
        args = (channel_rows(x[:, block]), channel_rows(dy[:, block].to(x.dtype)),
                weight[block].view(-1, 1), bias[block].view(-1, 1), eps, activation, param)
        rows = _rows_backward(*args, checked=False) or _rows_backward(*args, checked=True)
        target = grad_input[:, block].transpose(0, 1)
        target.copy_(rows[0].view(target.shape))
        sums[0, block], sums[1, block] = rows[1].view(-1), rows[2].view(-1)
    return grad_input, sums[0], sums[1]


def _all_finite(*tensors: torch.Tensor) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in tensors)


def _rows_backward(values: torch.Tensor, grads: torch.Tensor, weight: torch.Tensor,
                   bias: torch.Tensor, eps: float, activation: str, param: float,
                   checked: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """``batch_backward`` on (C, n) rows and (C, 1) parameters. Unchecked, no step masks its
    error where its result is not finite (``_exact_where_finite``), and None where anything
    was not: a non-finite result leaves a non-finite error, which every later step carries
    to z or to the results, checked once each (z before the activation, whose comparisons
    and ``where`` would drop it); the checked steps then take over. The activation's
    derivative is checked always."""
    zero = values.new_zeros(1, 1)  # the low part of float64 values, broadcast
    count = values.shape[1]
    n = (torch.full_like(values[:, :1], float(count)), zero)
    w = (weight, zero)
    mean = div(channel_sum((values, zero), checked), n, checked)
    centred = add((values, zero), neg(mean), checked)
    var = div(channel_sum(mul(centred, centred, checked), checked), n, checked)
    invstd = rsqrt(add(var, (torch.full_like(var[0], eps), zero), checked), checked)
    xhat = mul(centred, invstd, checked)
    del centred
    z = add(mul(w, xhat, checked), (bias, zero), checked)
    if not checked and not _all_finite(*z):
        return None
    dz = _activation_slope(z, grads, activation, param)
    del z
    sum_dz, sum_dz_xhat = channel_sum(dz, checked), channel_sum(mul(dz, xhat, checked), checked)
    inner = add(dz, neg(div(sum_dz, n, checked)), checked)
    del dz
    inner = add(inner, neg(mul(xhat, div(sum_dz_xhat, n, checked), checked)), checked)
    del xhat
    dx = mul(mul(w, invstd, checked), inner, checked)
    del inner
    rows = _sum_into(*dx), sum_dz[0] + sum_dz[1], sum_dz_xhat[0] + sum_dz_xhat[1]
    if not checked and not _all_finite(*rows):
        return None
    return rows
