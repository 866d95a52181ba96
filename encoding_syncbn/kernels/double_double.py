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
residual from exact products, which squares its relative error. With n values a channel::

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
# Above 2^996 the splitter's product can overflow; 2^28 times smaller, a number is below it.
_SPLIT_LIMIT = 2.0**996
_SPLIT_SCALE = 2.0**28
_ABOVE_SPLIT_LIMIT = math.nextafter(_SPLIT_LIMIT, math.inf)

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


def _zero_where_not_finite(error: torch.Tensor) -> torch.Tensor:
    """The error of ``s = fl(a + b)`` (``two_sum``, ``_fast_two_sum``), 0 where s is
    infinite or NaN: there the transformation's own arithmetic makes the error infinite or
    NaN, and ``s`` alone is what float64 computes (NaN and inf propagate as in
    nn.BatchNorm2d). Its error is finite where s is (no step of it overflows where the sum
    does not) and not where s is not, so zeroing the error where it is not finite, one pass,
    is ``where(isfinite(s), error, 0)``, five. ``quotient`` and ``rsqrt`` zero their
    corrections with it for the same end: where a correction is not finite, float64's
    result stands alone."""
    return torch.nan_to_num(error, nan=0.0, posinf=0.0, neginf=0.0)


def _where_finite(s: torch.Tensor, error: torch.Tensor) -> torch.Tensor:
    """``where(isfinite(s), error, 0)`` for an ``error`` that is never NaN where ``s`` is
    finite (``two_prod``'s: finite, or infinite where a product within 2^-26 of float64's
    largest number overflows its split halves' product), in three passes: ``s - s`` is +0
    where s is finite and NaN where not, and subtracting it leaves every other value as it
    is (a zero's sign too)."""
    return torch.nan_to_num(error - (s - s), nan=0.0, posinf=math.inf, neginf=-math.inf)


def two_sum(a: torch.Tensor, b: torch.Tensor) -> DD:
    s = a + b
    b_virtual = s - a
    return s, _zero_where_not_finite((a - (s - b_virtual)) + (b - b_virtual))


def _fast_two_sum(a: torch.Tensor, b: torch.Tensor) -> DD:
    """``two_sum`` where |a| >= |b| (or a is 0)."""
    s = a + b
    return s, _zero_where_not_finite(b - (s - a))


def _split(a: torch.Tensor) -> DD:
    t = _SPLITTER * a
    high = t - (t - a)
    return high, a - high


def _split_inverse_scale(a: torch.Tensor) -> torch.Tensor:
    """``1 / _SPLIT_SCALE`` where |a| > ``_SPLIT_LIMIT``, else 1 (NaN where a is NaN), in
    four cheap elementwise passes, not a comparison's where: ``(next - |a|) 2^100``, next the
    float64 number after the limit, is at least 2^1044 (inf) up to the limit, whose ulp is
    2^944, and at most 0 above it, so clamping it to [1 / scale, 1] takes one of the two.
    Piecewise constant: no gradient of the statistics' (create_graph) passes through it."""
    return ((_ABOVE_SPLIT_LIMIT - a.detach().abs()) * 2.0**100).clamp(1.0 / _SPLIT_SCALE, 1.0)


def _two_prod(a: torch.Tensor, b: torch.Tensor) -> DD:
    """``two_prod`` before its error is zeroed where the product is not finite; a square
    (``b is a``) splits its factor once."""
    p = a * b
    a_inverse = _split_inverse_scale(a)
    a_scaled = a * a_inverse
    a_high, a_low = _split(a_scaled)
    if b is a:
        b_inverse, b_scaled, b_high, b_low = a_inverse, a_scaled, a_high, a_low
    else:
        b_inverse = _split_inverse_scale(b)
        b_scaled = b * b_inverse
        b_high, b_low = _split(b_scaled)
    error = (((a_high * b_high - a_scaled * b_scaled) + a_high * b_low + a_low * b_high)
             + a_low * b_low)
    return p, error / (a_inverse * b_inverse)


def two_prod(a: torch.Tensor, b: torch.Tensor) -> DD:
    """``a b`` exactly, as ``(fl(a b), error)`` (Dekker), the error 0 where the product is
    not finite. A factor above ``_SPLIT_LIMIT``, whose split would overflow (NaN parts: a
    NaN error beside a finite product), is split ``_SPLIT_SCALE`` times smaller and the error
    scaled back: powers of 2, exact."""
    p, error = _two_prod(a, b)
    return p, _where_finite(p, error)


def square(a: torch.Tensor) -> DD:
    """``a^2`` as ``(p, e)``, ``p + e`` exact where ``|a| <= _SPLIT_LIMIT`` and e is normal:
    ``two_prod(a, a)`` in about a third of its passes over a large tensor, for callers that
    take ``p`` alone wherever it is not finite. Its factor is split as it is, not scaled
    (above the limit p is inf, and e meaningless); e is not zeroed where p is not finite; and
    the error's steps ``((h^2 - p) + 2 h l) + l^2`` (h + l = a, ``_split``) are in-place
    ``addcmul``s, each exact, so that a fused multiply-add there changes nothing."""
    high, low = _split(a)
    p = a * a
    error = (high * high).sub_(p).addcmul_(high, low, value=2.0).addcmul_(low, low)
    return p, error


def add(a: DD, b: DD) -> DD:
    s, e = two_sum(a[0], b[0])
    t, f = two_sum(a[1], b[1])
    s, e = _fast_two_sum(s, e + t)
    return _fast_two_sum(s, e + f)


def neg(a: DD) -> DD:
    return -a[0], -a[1]


def mul(a: DD, b: DD) -> DD:
    """``a b``; an infinite or NaN product of the high parts is the result as float64's, not
    the NaN its cross terms make (inf times a low part of 0): there the correction is 0, so
    the sum is the product and its error 0."""
    p, error = _two_prod(a[0], b[0])
    correction = _where_finite(p, error + (a[0] * b[1] + a[1] * b[0]))
    s = p + correction
    return s, _zero_where_not_finite(correction - (s - p))


def div(a: DD, b: DD) -> DD:
    """``a / b``: float64's quotient and two corrections from the double-double remainder."""
    q1 = a[0] / b[0]
    r = add(a, neg(mul(b, (q1, torch.zeros_like(q1)))))
    q2 = r[0] / b[0]
    r = add(r, neg(mul(b, (q2, torch.zeros_like(q2)))))
    q3 = r[0] / b[0]
    q = _fast_two_sum(q1, q2)
    return add(q, (q3, torch.zeros_like(q3)))


def quotient(a: DD, b: torch.Tensor | float) -> DD:
    """``a / b`` of a double-double ``a`` and a float64 ``b`` (a number, or a tensor of them):
    float64's quotient q of a's high part, and ``(a_hi - q b + a_lo) / b``, whose remainder
    ``a_hi - q b`` is exact: ``q b = p + e`` (``two_prod``), ``a_hi - p`` exact (p within an
    ulp of a_hi: Sterbenz), and the remainder of a rounded quotient is a float64 number. What
    rounds is adding a_lo and dividing: about 2^-104 of the result. Where ``div`` (a
    double-double divisor) takes two corrections, each from a double-double product and sum,
    this takes one exact product, a fraction of div's steps. A dividend above
    ``_SPLIT_LIMIT`` takes its remainder ``_SPLIT_SCALE`` times smaller, from ``q`` and
    ``a_hi`` so scaled (powers of 2: exact), then scaled back: ``q b`` of a dividend within
    2^-53 of float64's largest would overflow, and its split's halves within 2^-26. Where
    the correction is not finite (q infinite or NaN; b infinite, q 0) it is 0, and q alone
    is the result, float64's."""
    high, low = a
    q = high / b
    inverse = _split_inverse_scale(high)
    p, e = two_prod(q * inverse, b if isinstance(b, torch.Tensor) else torch.full_like(q, b))
    remainder = ((high * inverse - p) - e) / inverse
    return _fast_two_sum(q, _zero_where_not_finite((remainder + low) / b))


def rsqrt(v: DD) -> DD:
    """``1 / sqrt(v)`` for v > 0 (and 0 for an infinite v, as float64's): float64's root r and
    one Newton step ``r + r (1 - v r^2) / 2``, its residual from two exact products, ``v_hi r
    = h + h_e`` and ``h r = p + p_e`` (``two_prod``)::

        1 - v r^2 = (1 - p) - (p_e + h_e r + (v_lo r) r)

    ``1 - p`` exact (p within a few ulps of 1: Sterbenz), each other term about 2^-53, so the
    residual errs by a few 2^-106, far below what the step needs. General double-double
    products (``mul``) would take r^2, whose error term is subnormal for v above 2^960 and
    which overflows for v below 2^-1022, in more steps; here every factor stays near
    sqrt(v), r or 1. The step is 0 where it is not finite (an infinite v: r = 0, r v NaN),
    so that r is the result there; a NaN v leaves r NaN."""
    high, low = v
    r = torch.rsqrt(high)
    h, h_error = two_prod(high, r)
    p, p_error = two_prod(h, r)
    residual = (1.0 - p) - (p_error + (h_error * r + (low * r) * r))
    return _fast_two_sum(r, _zero_where_not_finite(r * residual * 0.5))


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
    r = r[0] * 2.0**-_SQUARINGS, r[1] * 2.0**-_SQUARINGS
    high, low = _INVERSE_FACTORIALS[-1]
    p = (torch.full_like(k, high), torch.full_like(k, low))
    for high, low in reversed(_INVERSE_FACTORIALS[:-1]):
        p = add(mul(p, r), (torch.full_like(k, high), torch.full_like(k, low)))
    for _ in range(_SQUARINGS):
        p = mul(p, p)
    power = torch.pow(k.new_full((), 2.0), k)  # torch.ldexp's factor, taken once
    return p[0] * power, p[1] * power


def channel_sum(a: DD) -> DD:
    """Per row of (C, n) double-double values, their sum, pairwise; (C, 1)."""
    high, low = a
    while high.shape[1] > 1:
        half = high.shape[1] // 2
        s = add((high[:, :half], low[:, :half]), (high[:, half:2 * half], low[:, half:2 * half]))
        high, low = (torch.cat([part, rest[:, 2 * half:]], 1)
                     for part, rest in zip(s, (high, low)))
    return high, low


def channel_rows(t: torch.Tensor) -> torch.Tensor:
    """An (N, C, *) tensor as (C, values a channel)."""
    return t.transpose(0, 1).reshape(t.shape[1], -1)


def _activation_slope(z: DD, dy: torch.Tensor, activation: str, param: float) -> DD:
    """``dy * act'(z)``: ELU's ``alpha exp(z)`` below 0 and the smooth activations'
    derivatives in double-double (``_SMOOTH_SLOPES``); the others' act' is piecewise constant,
    ATen's at z's high part (whose sign is z's) and exact."""
    dy_dd = (dy, torch.zeros_like(dy))
    if activation == "elu":
        positive = z[0] > 0
        below = exp((torch.clamp(z[0], max=0), torch.where(positive, 0.0, z[1])))
        slope = mul((torch.full_like(dy, param), torch.zeros_like(dy)), below)
        slope = (torch.where(positive, 1.0, slope[0]), torch.where(positive, 0.0, slope[1]))
        return mul(dy_dd, slope)
    definition = activations.ACTIVATIONS[activation]
    if definition.derivative is None:
        return dy_dd
    smooth = _SMOOTH_SLOPES.get(activation)
    if smooth is not None:
        return mul(dy_dd, smooth(z))
    slope = definition.derivative(torch.ones_like(z[0]), z[0], param, torch.empty_like(z[0]))
    return mul(dy_dd, (slope, torch.zeros_like(slope)))


def _scaled(a: DD, factor: float) -> DD:
    """``a`` times a float64 ``factor``."""
    return mul(a, (torch.full_like(a[0], factor), torch.zeros_like(a[0])))


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
    return add(mul(z, density), (cdf, torch.zeros_like(cdf)))


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


# Elements of a block of channels that ``batch_backward`` takes at once: the few hundred
# elementwise steps' temporaries then stay in cache and come from the allocator's free lists,
# not fresh pages, and the backward's transient memory is a block's, not hundreds of the
# input's size.
_BLOCK_ELEMENTS = 1 << 15


def batch_backward(x: torch.Tensor, dy: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                   eps: float, activation: str, param: float
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dx, sum(dz), sum(dz * xhat))`` of training-mode BatchNorm (biased variance) + the
    activation over the whole float64 batch ``x`` (N, C, *), each rounded once from
    double-double (module docstring); a block of channels at a time (``_BLOCK_ELEMENTS``:
    every step is elementwise or within a channel, so the blocks' results are the whole's)."""
    channels = x.shape[1]
    grad_input = torch.empty_like(x)
    weight, bias = weight.to(x.dtype), bias.to(x.dtype)
    step = max(1, _BLOCK_ELEMENTS * channels // max(x.numel(), 1))
    sums = []
    for start in range(0, channels, step):
        block = slice(start, start + step)
        dx, sum_dz, sum_dz_xhat = _rows_backward(
            x[:, block], dy[:, block], weight[block].view(-1, 1), bias[block].view(-1, 1),
            eps, activation, param)
        target = grad_input[:, block].transpose(0, 1)
        target.copy_(dx.view(target.shape))
        sums.append((sum_dz, sum_dz_xhat))
    sum_dz, sum_dz_xhat = (torch.cat(parts).view(-1) for parts in zip(*sums))
    return grad_input, sum_dz, sum_dz_xhat


def _rows_backward(x: torch.Tensor, dy: torch.Tensor, weight: torch.Tensor,
                   bias: torch.Tensor, eps: float, activation: str, param: float
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``batch_backward`` of a block of channels, ``x`` and ``dy`` (N, c, *) with (c, 1)
    parameters: dx as (c, values a channel) rows, the sums as (c, 1). Each temporary goes
    once the last step reading it has run, so that few are alive at once."""
    values = channel_rows(x)
    n = float(values.shape[1])
    w = (weight, torch.zeros_like(weight))
    values = values, torch.zeros_like(values)
    mean = quotient(channel_sum(values), n)
    centred = add(values, neg(mean))
    del values
    var = quotient(channel_sum(mul(centred, centred)), n)
    invstd = rsqrt(add(var, (torch.full_like(var[0], eps), torch.zeros_like(var[0]))))
    xhat = mul(centred, invstd)
    del centred
    z = add(mul(w, xhat), (bias, torch.zeros_like(bias)))
    dz = _activation_slope(z, channel_rows(dy.to(x.dtype)), activation, param)
    del z
    sum_dz, sum_dz_xhat = channel_sum(dz), channel_sum(mul(dz, xhat))
    inner = add(dz, neg(quotient(sum_dz, n)))
    del dz
    inner = add(inner, neg(mul(xhat, quotient(sum_dz_xhat, n))))
    del xhat
    dx = mul(mul(w, invstd), inner)
    del inner
    return dx[0] + dx[1], sum_dz[0] + sum_dz[1], sum_dz_xhat[0] + sum_dz_xhat[1]
