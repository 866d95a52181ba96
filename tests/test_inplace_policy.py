"""Which inputs an in-place layer may overwrite (``inplace_policy.can_overwrite``): the quick
test of the usual input and the explaining checks must agree on every kind of input."""

from __future__ import annotations

import warnings

import pytest
import torch
from backends import each_backend
from hypothesis import given, settings
from hypothesis import strategies as st

from encoding_syncbn import SyncBatchNorm
from encoding_syncbn.layer import inplace_policy


class _Overlapping(torch.autograd.Function):
    """A non-leaf tensor that is no view but whose elements share memory (stride 0)."""

    @staticmethod
    def forward(ctx, like):
        n, c, s = like.shape
        return torch.empty_strided((n, c, s), (0, s, 1), dtype=like.dtype).fill_(1.0)

    @staticmethod
    def backward(ctx, grad):
        return grad.sum(0, keepdim=True).expand(grad.shape[0], -1, -1).clone()


class _Gapped(torch.autograd.Function):
    """A non-leaf tensor that is no view, neither dense nor overlapping (a gap per row)."""

    @staticmethod
    def forward(ctx, like):
        n, c, s = like.shape
        out = torch.empty_strided((n, c, s), (c * (s + 1), s + 1, 1), dtype=like.dtype)
        return out.copy_(like)

    @staticmethod
    def backward(ctx, grad):
        return grad


def _leaf():
    # Enough values a channel, its slice [1:] too, to train in place
    # (inplace_policy.rebuilds_from_count, float64).
    return torch.randn(25, 3, 5, dtype=torch.float64, requires_grad=True)


def _inference():
    with torch.inference_mode():
        return torch.randn(25, 3, 5, dtype=torch.float64)


# (name, make the input, whether it may be overwritten)
CASES = [
    ("fresh", lambda: _leaf() * 1, True),
    ("fresh channels_last",
     lambda: (torch.randn(12, 3, 5, 2, dtype=torch.float64, requires_grad=True) * 1).to(
         memory_format=torch.channels_last), True),
    ("no grad", lambda: torch.randn(25, 3, 5, dtype=torch.float64), True),
    ("gapped", lambda: _Gapped.apply(_leaf()), True),
    ("slice of a fresh tensor", lambda: (_leaf() * 1)[1:], True),
    ("leaf", _leaf, False),
    ("view of a leaf", lambda: _leaf()[1:], False),
    ("chunk", lambda: (_leaf() * 1).chunk(2)[0], False),
    ("overlapping", lambda: _Overlapping.apply(_leaf()), False),
    ("expanded", lambda: (_leaf()[:1] * 1).expand(25, -1, -1), False),
    ("inference tensor", _inference, False),
]


@pytest.mark.parametrize("make,expected", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_can_overwrite(make, expected):
    x = make()
    assert inplace_policy.can_overwrite(x, [True], "a layer") is expected
    # The layer agrees, and computes what the out-of-place layer computes.
    layer = SyncBatchNorm(3, activation="leaky_relu", dtype=torch.float64)
    twin = SyncBatchNorm(3, activation="leaky_relu", dtype=torch.float64, inplace=False)
    want = twin(x.detach().clone())
    # Autograd saves no inference tensor: such inputs come under no_grad (as DataParallel's
    # replica threads see them, which do not inherit inference mode).
    with warnings.catch_warnings(), torch.set_grad_enabled(not x.is_inference()):
        warnings.simplefilter("ignore")  # the out-of-place fallback's warning
        out = layer(x)
    assert (out.data_ptr() == x.data_ptr() and out.stride() == x.stride()) is expected
    torch.testing.assert_close(out.detach(), want.detach(), rtol=1e-12, atol=1e-12)


def _overlapping_view(kind: str, base: torch.Tensor, n: int, c: int, length: int,
                      window: int) -> torch.Tensor:
    """A view of ``base`` (n * c * length elements) some of whose elements share memory."""
    grid = base.view(n, c, length)
    if kind == "unfold":  # windows that overlap: a step below the window
        return grid.unfold(2, window, window - 1)
    if kind == "as_strided":  # rows of `window` starting every `window - 1` elements
        rows = (length - window) // (window - 1) + 1
        return base.as_strided((n, c, rows, window), (c * length, length, window - 1, 1))
    return grid[:, :, :1].expand(n, c, window)  # expand: stride 0


@each_backend
@settings(max_examples=12, deadline=None, derandomize=True)
@given(kind=st.sampled_from(["unfold", "as_strided", "expand"]), n=st.integers(2, 4),
       c=st.integers(1, 3), length=st.integers(4, 9), window=st.integers(2, 4),
       activation=st.sampled_from(["identity", "leaky_relu", "elu"]))
def test_input_whose_elements_share_memory_runs_out_of_place(kind, n, c, length, window,
                                                             activation):
    """An in-place layer on a view whose elements share memory (overlapping unfold windows,
    as_strided rows, expand) computes out of place with the documented warning, leaves the
    tensor the view came from untouched, and gives the output and gradients an out-of-place
    layer gives on a copy of the view."""
    window = min(window, (length + 1) // 2)  # at least two windows or rows: overlapping
    gen = torch.Generator().manual_seed(n * 100 + c * 10 + length)
    leaf = torch.randn(n * c * length, dtype=torch.float64, generator=gen, requires_grad=True)
    dy = None
    results = []
    for inplace in (True, False):
        base = leaf * 1
        view = _overlapping_view(kind, base, n, c, length, window)
        source = view if inplace else view.clone()
        layer = SyncBatchNorm(c, activation=activation, dtype=torch.float64, inplace=inplace)
        before = base.detach().clone()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = layer(source)
        if inplace:
            assert [str(w.message) for w in caught if "share memory" in str(w.message)], \
                [str(w.message) for w in caught]
            assert out.data_ptr() != view.data_ptr()
            assert torch.equal(base.detach(), before)
        if dy is None:
            dy = torch.randn(out.shape, dtype=torch.float64, generator=gen)
        out.backward(dy)
        results.append((out.detach(), leaf.grad.clone()))
        leaf.grad = None
    for got, want in zip(*results):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
