"""The double-double arithmetic of ``kernels/double_double.py`` against exact rationals, over
float64's whole range: its error-free transformations are exact wherever their result is
finite and its error term representable (no underflow), the largest magnitudes included."""

from __future__ import annotations

from fractions import Fraction

import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from encoding_syncbn.kernels import double_double

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
