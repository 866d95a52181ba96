"""The double-double arithmetic of ``kernels/double_double.py`` against exact rationals, over
float64's whole range: its error-free transformations are exact wherever their result is
finite and its error term representable (no underflow), the largest magnitudes included."""

from __future__ import annotations

import math
from fractions import Fraction
from unittest import mock

import mpmath
import pytest
import torch
from helpers.peak_storage import PeakStorage
from hypothesis import assume, example, given, settings
from hypothesis import strategies as st

from encoding_syncbn.kernels import double_double, torch_ops

# Magnitudes from 2^-400 (products' errors stay normal) to float64's largest.
MAGNITUDES = st.floats(2.0**-400, 1.7976931348623157e308, allow_nan=False,
                       allow_infinity=False)
SIGNED = st.tuples(MAGNITUDES, st.sampled_from([-1.0, 1.0])).map(lambda pair: pair[0] * pair[1])


def _tensor(value: float) -> torch.Tensor:
    return torch.tensor([value], dtype=torch.float64)


@settings(max_examples=300, deadline=None, derandomize=True)
@given(a=SIGNED)
def test_split_is_exact_with_half_widths(a):
    """``high + low == a`` with each part of at most 26 significant bits, up to the largest
    number split as it is (``two_prod`` scales larger ones below it)."""
    assume(abs(a) <= double_double._SPLIT_LIMIT)
    high, low = double_double._split(_tensor(a))
    high, low = float(high), float(low)
    assert Fraction(high) + Fraction(low) == Fraction(a)
    for part in (high, low):
        assert part == 0 or _significant_bits(part) <= 26, (a, part)


def _significant_bits(value: float) -> int:
    """The bits from the highest set one to the lowest of ``value``'s significand."""
    numerator = abs(Fraction(value).numerator)
    return (numerator >> ((numerator & -numerator).bit_length() - 1)).bit_length()


@settings(max_examples=300, deadline=None, derandomize=True)
@given(a=SIGNED, b=SIGNED)
def test_two_prod_is_exact_where_the_product_is_finite(a, b):
    """``p + e == a b`` exactly wherever ``p = fl(a b)`` is finite and normal, the largest
    products included."""
    exact = Fraction(a) * Fraction(b)
    assume(Fraction(2.0**-900) < abs(exact) < Fraction(1.7976931348623157e308))
    p, e = double_double.two_prod(_tensor(a), _tensor(b))
    assume(torch.isfinite(p).item())
    assert Fraction(float(p)) + Fraction(float(e)) == exact, (a, b)


@settings(max_examples=300, deadline=None, derandomize=True)
@given(a=SIGNED)
def test_square_is_exact_below_the_split_limit(a):
    """``square(a)``: ``p + e == a^2`` exactly wherever ``|a| <= _SPLIT_LIMIT`` and the
    error is normal, as ``two_prod(a, a)``'s, and p the same; above the limit p is inf."""
    tensor = _tensor(a)
    p, e = (float(part) for part in double_double.square(tensor))
    if abs(a) > double_double._SPLIT_LIMIT:
        assert p == math.inf
        return
    assume(Fraction(2.0**-900) < Fraction(a) ** 2 < Fraction(1.7976931348623157e308))
    assert Fraction(p) + Fraction(e) == Fraction(a) ** 2, a
    assert (p, e) == tuple(float(part) for part in double_double.two_prod(tensor, tensor))


@settings(max_examples=400, deadline=None, derandomize=True)
@given(high=SIGNED, low=st.floats(-0.5, 0.5), b=st.one_of(SIGNED, st.integers(1, 2**40)))
# Dividends within 2^-53 of float64's largest, whose ``q b`` overflows, or its split's halves.
@example(high=1.7976931348623157e308, low=0.0, b=14)
@example(high=-1.7976931348623155e308, low=0.25, b=2**36 + 1)
def test_quotient_of_a_double_double_by_a_float_is_exact_to_2_103(high, low, b):
    """``quotient((high, low), b)`` is a normalised pair within 2^-103 of the exact ``(high
    + low) / b`` (its remainder exact, then two roundings of a correction about 2^-52 of the
    quotient), over float64's range of finite quotients, dividends up to its largest, a
    number or a tensor divisor alike."""
    pair = double_double._fast_two_sum(_tensor(high), _tensor(low * math.ulp(high)))
    assume(math.isfinite(float(pair[0])))
    exact = (Fraction(float(pair[0])) + Fraction(float(pair[1]))) / Fraction(b)
    assume(Fraction(2.0**-900) < abs(exact) < Fraction(1.7976931348623157e308))
    for divisor in (float(b), _tensor(float(b))):
        q, q_low = (float(part) for part in double_double.quotient(pair, divisor))
        assert abs(q_low) <= math.ulp(q) / 2
        assert abs(Fraction(q) + Fraction(q_low) - exact) <= abs(exact) * Fraction(2) ** -103


@pytest.mark.parametrize("dividend,divisor,expected", [
    (math.inf, 3.0, math.inf), (-math.inf, 3.0, -math.inf), (math.nan, 3.0, math.nan),
    (1.5, math.inf, 0.0), (1.5, 0.0, math.inf), (1.7976931348623157e308, 0.5, math.inf),
])
def test_quotient_where_float64_is_not_finite_or_zero_is_float64s(dividend, divisor,
                                                                 expected):
    """Where float64's quotient is infinite or NaN, or 0 by an infinite divisor, the result
    is that quotient and a low part of +0 (the correction's inf - inf or inf * 0 made 0)."""
    q, q_low = double_double.quotient((_tensor(dividend), _tensor(0.0)), divisor)
    torch.testing.assert_close(q, _tensor(expected), rtol=0, atol=0, equal_nan=True)
    assert q_low.item() == 0.0 and math.copysign(1.0, q_low.item()) == 1.0


@settings(max_examples=400, deadline=None, derandomize=True)
@given(m2=st.floats(2.0**-1074, 1.7976931348623157e308, allow_nan=False, allow_infinity=False),
       count=st.integers(1, 2**40),
       eps=st.one_of(st.sampled_from([0.0, 1e-5, 1e-3]), st.floats(0.0, 1.0)))
# M2 within 2^-53 of float64's largest: ``q n`` overflows, or the halves of its split do.
@example(m2=1.7976931348623157e308, count=14, eps=0.0)
@example(m2=1.7976931348623155e308, count=2**36 + 1, eps=0.0)
def test_float64_invstd_is_rounded_once(m2, count, eps):
    """``torch_ops.float64_invstd``: ``1 / sqrt(M2 / count + eps)`` within half an ulp of the
    exact value (400-bit mpmath from exact rationals): the variance in double-double
    (``quotient``, ``add``), then ``rsqrt``'s Newton step. Over variances from 2^-960 to
    float64's largest: below them the remainder's quotient is subnormal, which no batch's
    variance comes near."""
    variance = Fraction(m2) / count + Fraction(eps)
    assume(Fraction(2) ** -960 <= variance)
    with mpmath.workprec(400):
        exact = 1 / mpmath.sqrt(mpmath.mpf(variance.numerator) / variance.denominator)
        result = float(torch_ops.float64_invstd(_tensor(m2), count, eps))
        half_ulps = abs(mpmath.mpf(result) - exact) / math.ulp(result) * 2
    # A value within double-double's error of a midpoint (hypothesis finds exact ones) may
    # round to either side.
    assert half_ulps <= 1 + 2.0**-40, (m2, count, eps, float(half_ulps))


@settings(max_examples=200, deadline=None, derandomize=True)
@given(m2=st.one_of(st.floats(0.0, allow_infinity=False),
                    st.sampled_from([float("inf"), float("nan"), 1.7976931348623157e308])),
       count=st.integers(1, 2**40),
       eps=st.one_of(st.floats(2.0**-1074, 2.0**-900), st.floats(2.0**-1074, 1.0)))
def test_float64_invstd_follows_rsqrt_over_every_kind_of_variance(m2, count, eps):
    """Where float64's ``rsqrt(M2 / count + eps)`` is exact to a few ulps or not finite, so is
    ``float64_invstd``: 0 for an infinite M2 (a batch whose squares overflow, as
    nn.BatchNorm2d's invstd), NaN for a NaN one, and within 4 ulps of it for subnormal
    and the largest variances (no step's product or square overflows or turns NaN)."""
    ours = torch_ops.float64_invstd(_tensor(m2), count, eps)
    theirs = torch.rsqrt(_tensor(m2) / count + eps)
    if not torch.isfinite(theirs).item() or theirs.item() == 0:
        torch.testing.assert_close(ours, theirs, rtol=0, atol=0, equal_nan=True)
    else:
        torch.testing.assert_close(ours, theirs, rtol=4 * 2.0**-52, atol=0)


# Every float64 kind: the largest magnitudes, zeros of both signs, infinities and NaN.
ANY = st.one_of(SIGNED, st.sampled_from([0.0, -0.0, float("inf"), float("-inf"), float("nan"),
                                         1.7976931348623157e308, 2.0**996, 2.0**997]))


@settings(max_examples=400, deadline=None, derandomize=True)
@given(a=st.lists(ANY, min_size=1, max_size=8), b=st.lists(ANY, min_size=1, max_size=8))
def test_errors_are_zero_exactly_where_results_are_not_finite(a, b):
    """Each transformation's (and ``mul``'s) error is +0 where its result is infinite or NaN
    (that result alone is float64's) and never NaN where the result is finite (infinite only
    for a product within 2^-26 of float64's largest number, whose split halves' product
    overflows); ``mul`` of an infinite or NaN product is that product."""
    size = min(len(a), len(b))
    a, b = (torch.tensor(v[:size], dtype=torch.float64) for v in (a, b))
    results = {name: getattr(double_double, name)(a, b)
               for name in ("two_sum", "_fast_two_sum", "two_prod")}
    results["mul"] = double_double.mul((a, torch.zeros_like(a)), (b, torch.zeros_like(b)))
    for name, (s, e) in results.items():
        finite = torch.isfinite(s)
        zero = e[~finite]
        assert torch.equal(zero.view(torch.int64), torch.zeros_like(zero).view(torch.int64)), name
        assert not torch.isnan(e[finite]).any(), name
    product = a * b
    torch.testing.assert_close(results["mul"][0], product, rtol=0, atol=0, equal_nan=True)


def _bits(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bit patterns, every NaN as one."""
    return t.nan_to_num(nan=0.0, posinf=float("inf"), neginf=float("-inf")).view(torch.int64)


@settings(max_examples=24, deadline=None, derandomize=True)
@given(shape=st.tuples(st.integers(1, 6), st.integers(1, 7), st.integers(1, 4)),
       activation=st.sampled_from(["identity", "leaky_relu", "elu", "silu", "gelu",
                                   "gelu_tanh"]),
       special=st.sampled_from([None, float("inf"), float("nan"), 1e300, 0.0]),
       seed=st.integers(0, 2**16))
def test_blocks_of_channels_give_the_whole_batch_gradient(shape, activation, special, seed):
    """``batch_backward`` a channel at a time (the smallest blocks) is bit for bit the whole
    batch at once, non-finite and huge values included: no step reads across channels."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen, dtype=torch.float64) * 3 + 1
    dy = torch.randn(shape, generator=gen, dtype=torch.float64)
    weight = torch.randn(shape[1], generator=gen, dtype=torch.float64)
    bias = torch.randn(shape[1], generator=gen, dtype=torch.float64) * 4
    if special is not None:
        x[0, -1, 0] = special
        dy[-1, 0, -1] = special
    args = (x, dy, weight, bias, 1e-5, activation, 0.3)
    whole = double_double.batch_backward(*args)
    with mock.patch.object(double_double, "_BLOCK_ELEMENTS", 1):
        blocks = double_double.batch_backward(*args)
    for one, other in zip(whole, blocks):
        assert one.shape == other.shape and one.stride() == other.stride()
        assert torch.equal(torch.isnan(one), torch.isnan(other))
        assert torch.equal(_bits(one), _bits(other))


@pytest.mark.parametrize("activation", ["leaky_relu", "gelu"])
def test_transient_memory_is_a_block_of_channels(activation):
    """Beside the gradient it returns, ``batch_backward`` keeps the temporaries of one block
    of channels alive at a time, not of the whole input."""
    x = torch.randn(2, 64, 8, 8, dtype=torch.float64)
    args = (x, torch.randn_like(x), torch.rand(64, dtype=torch.float64),
            torch.randn(64, dtype=torch.float64), 1e-5, activation, 0.01)
    block = 256  # 1/32 of the input: two channels of 128 values
    peak = PeakStorage(*args[:4])
    with mock.patch.object(double_double, "_BLOCK_ELEMENTS", block), peak:
        double_double.batch_backward(*args)
    input_bytes = x.numel() * x.element_size()
    # The gradient, and the temporaries of a block: a few dozen block-sized tensors where
    # the whole input at once leaves 20-35 input-sized ones alive.
    assert peak.peak <= input_bytes + 40 * block * x.element_size(), peak.peak / input_bytes
