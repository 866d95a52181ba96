"""The statistics of the whole batch: ``torch_ops.channel_stats`` against float64, and the
Chan merge (``merge.merge_stats``) against them."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from merge import merge_stats

from encoding_syncbn.kernels import torch_ops
from encoding_syncbn.sync import stats

# Group sizes along dim 0, zeros included (an empty replica or rank).
SPLITS = [(3,), (1, 4), (2, 0, 5, 1), (0, 0, 6)]


def groups_of(x: torch.Tensor, split: tuple[int, ...]):
    pieces = torch.split(x, list(split))
    per_group = [torch_ops.channel_stats(piece) for piece in pieces]
    means = torch.stack([mean for mean, _, _ in per_group])
    m2s = torch.stack([m2 for _, m2, _ in per_group])
    return means, m2s, [count for _, _, count in per_group]


@pytest.mark.parametrize("split", SPLITS, ids=str)
@pytest.mark.parametrize("counts_as", ["ints", "tensor"])
def test_merge_gives_the_whole_batch_statistics(split, counts_as):
    x = torch.randn(sum(split), 3, 4, dtype=torch.float64) * 0.5 + 1e4
    means, m2s, counts = groups_of(x, split)
    given = counts if counts_as == "ints" else torch.tensor(counts, dtype=torch.float64)
    mean, m2, invstd = merge_stats(means, m2s, given, 1e-5)
    whole = x.transpose(0, 1).reshape(3, -1)
    torch.testing.assert_close(mean, whole.mean(1), rtol=1e-14, atol=0)
    torch.testing.assert_close(m2, whole.var(1, correction=0) * whole.shape[1],
                               rtol=1e-10, atol=0)
    torch.testing.assert_close(invstd, torch.rsqrt(whole.var(1, correction=0) + 1e-5),
                               rtol=1e-10, atol=0)


def test_all_counts_zero_merge_to_zeros():
    means, m2s = torch.zeros(2, 3), torch.zeros(2, 3)
    mean, m2, invstd = merge_stats(means, m2s, [0, 0], 1e-5)
    assert torch.equal(mean, torch.zeros(3)) and torch.equal(m2, torch.zeros(3))
    torch.testing.assert_close(invstd, torch.full((3,), 1e-5) ** -0.5)


def test_counts_given_as_ints_become_tensors_once():
    """Replicas' counts repeat from step to step: their tensors are built (on the GPU, a
    host-to-device copy that waits for the device) the first time only."""
    means, m2s = torch.randn(3, 4), torch.rand(3, 4)
    merge_stats(means, m2s, [5, 6, 7], 1e-5)
    built = stats._counts_from_ints.cache_info().misses
    for _ in range(3):
        merge_stats(means, m2s, [5, 6, 7], 1e-5)
    assert stats._counts_from_ints.cache_info().misses == built


def test_groups_as_separate_tensors_or_stacked_merge_alike():
    means, m2s = torch.randn(3, 4, dtype=torch.float64), torch.rand(3, 4, dtype=torch.float64)
    stacked = merge_stats(means, m2s, [2, 5, 1], 1e-5)
    separate = merge_stats(list(means), list(m2s), [2, 5, 1], 1e-5)
    for got, expected in zip(separate, stacked):
        torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_mismatched_or_no_groups_are_refused():
    with pytest.raises(ValueError, match="as many means, M2s and counts, got 3, 3 and 2"):
        merge_stats(torch.zeros(3, 4), torch.zeros(3, 4), [1, 2], 1e-5)
    with pytest.raises(ValueError, match="at least one group, got none"):
        merge_stats([], [], [], 1e-5)


def test_groups_m2_gradients_stay_apart_when_accumulated():
    """Every M2_i gets the same gradient tensor from the merge's backward: leaves that
    accumulate it over two backward passes must each own their ``.grad``."""
    means = [torch.randn(4, dtype=torch.float64, requires_grad=True) for _ in range(3)]
    m2s = [(torch.rand(4, dtype=torch.float64) + 1).requires_grad_() for _ in range(3)]
    grads = []
    for _ in range(2):
        _, m2, invstd = merge_stats(means, m2s, [2, 5, 1], 1e-5)
        (m2.sum() + invstd.sum()).backward()
        grads.append(m2s[0].grad.clone())
    torch.testing.assert_close(grads[1], 2 * grads[0], rtol=1e-14, atol=0)
    assert len({m2.grad.data_ptr() for m2 in m2s}) == len(m2s)
    for m2 in m2s[1:]:
        torch.testing.assert_close(m2.grad, grads[1], rtol=0, atol=0)


# Elements per slab in the tests of the slab walk: the shapes below are cut in several slabs.
_SLAB = 24
_STATS_RTOL = {torch.float64: 1e-12, torch.float32: 2e-6, torch.float16: 2e-6,
               torch.bfloat16: 2e-6}


def _layouts(x: torch.Tensor, layout: str) -> torch.Tensor:
    if layout == "channels_last":
        return x.contiguous(memory_format=torch.channels_last)
    if layout == "strided":
        return torch.cat([x, x], dim=-1)[..., ::2]
    return x


def _walked_stats(x: torch.Tensor, monkeypatch) -> tuple[tuple, int]:
    """``channel_stats(x)`` walked in slabs, and how many times it took the centred passes."""
    monkeypatch.setattr(torch_ops, "_SLAB_ELEMENTS", _SLAB)
    centred = torch_ops._centred_stats
    calls = []
    monkeypatch.setattr(torch_ops, "_centred_stats", lambda *a: calls.append(1) or centred(*a))
    return torch_ops.channel_stats(x), len(calls)


@settings(max_examples=30, deadline=None, derandomize=True)
@given(shape=st.tuples(st.integers(1, 5), st.integers(1, 6), st.integers(1, 5),
                       st.integers(2, 6)),
       layout=st.sampled_from(["contiguous", "channels_last", "strided"]),
       dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16, torch.float64]),
       offset=st.sampled_from([0.0, 3.0, 1e3]), sample_offset=st.sampled_from([0.0, 0.5, 50.0]),
       seed=st.integers(0, 2**16))
def test_channel_stats_in_slabs_match_float64(shape, layout, dtype, offset, sample_offset,
                                              seed):
    """Per channel, (mean, M2) of an input walked in slabs, whether its first slab's mean lies
    near the channel's mean (one pass) or not (samples offset from one another by up to 50
    standard deviations: the centred passes), against float64 on the same values."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen, dtype=torch.float64) + offset
    x += torch.randn(shape[0], 1, 1, 1, generator=gen, dtype=torch.float64) * sample_offset
    x = _layouts(x.to(dtype), layout)
    with pytest.MonkeyPatch.context() as patch:
        (mean, m2, count), _ = _walked_stats(x, patch)
    exact = x.double().transpose(0, 1).reshape(shape[1], -1)
    assert count == exact.shape[1]
    spread = exact.std(1, correction=0)
    rtol = _STATS_RTOL[dtype]
    torch.testing.assert_close(mean.double(), exact.mean(1), rtol=0,
                               atol=rtol * float(exact.abs().max()) + 1e-300)
    expected_m2 = exact.var(1, correction=0) * count
    assert ((m2.double() - expected_m2).abs() <= 8 * rtol * expected_m2
            + rtol * (spread * 1e-3) ** 2 * count).all(), (m2, expected_m2)


@pytest.mark.parametrize("sample_offset, centred_passes", [(0.0, 0), (20.0, 1)])
def test_channel_stats_take_one_pass_where_the_shift_is_near(sample_offset, centred_passes,
                                                               monkeypatch):
    """One pass where the first slab's mean lies within a standard deviation of the
    channel's mean; the centred passes where it does not (the first samples' offset). (A
    float64 input takes each slab's statistics around its own mean instead.)"""
    x = torch.randn(6, 3, 4, 5, dtype=torch.float64) + 1e3
    x[:2] += sample_offset
    (mean, m2, _), calls = _walked_stats(x.float(), monkeypatch)
    assert calls == centred_passes
    exact = x.float().double().transpose(0, 1).reshape(3, -1)
    rtol = _STATS_RTOL[torch.float32]
    torch.testing.assert_close(mean.double(), exact.mean(1), rtol=rtol, atol=0)
    torch.testing.assert_close(m2.double(), exact.var(1, correction=0) * exact.shape[1],
                               rtol=4 * rtol, atol=0)


@pytest.mark.parametrize("layout, offset, fused", [
    ("contiguous", 0.0, True), ("contiguous", 1.0, True),
    ("contiguous", 5.0, False),  # the shift further than two standard deviations from 0
    ("channels_last", 0.0, False), ("strided", 0.0, False),
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_channel_stats_in_one_fused_call_where_the_input_suits_it(layout, offset, fused, dtype,
                                                                  monkeypatch):
    """An NCHW-contiguous input near 0 takes its statistics in one fused ATen call, within a
    few roundings of the slab walk's; any other goes on walking the slabs (one pass). float64
    takes neither: its slabs' statistics are summed exactly (``_float64_slab_stats``)."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(6, 3, 4, 5, generator=gen, dtype=torch.float64) + offset
    x = _layouts(x.to(dtype), layout)
    monkeypatch.setattr(torch_ops, "_SLAB_ELEMENTS", 120)  # the first slab: 40 values a channel
    walked = []
    real = torch_ops._shifted_stats
    monkeypatch.setattr(torch_ops, "_shifted_stats", lambda *a: walked.append(1) or real(*a))
    mean, m2, count = torch_ops.channel_stats(x)
    if dtype == torch.float64:  # each slab around its own mean (``_float64_slab_stats``)
        assert not walked
    else:
        assert (not walked) == fused, walked
    exact = x.double().transpose(0, 1).reshape(3, -1)
    rtol = _STATS_RTOL[dtype]
    torch.testing.assert_close(mean.double(), exact.mean(1), rtol=0,
                               atol=rtol * float(exact.std(1).max()))
    torch.testing.assert_close(m2.double(), exact.var(1, correction=0) * count, rtol=4 * rtol,
                               atol=0)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("where", ["first slab", "last slab", "inf and -inf"])
@pytest.mark.filterwarnings("error::RuntimeWarning")  # handled inputs warn nothing
def test_channel_stats_of_non_finite_inputs_are_the_centred_passes(value, where, monkeypatch):
    """A NaN or infinite input element gives the (mean, M2) of the centred passes (those the
    layer's NaN and inf patterns were set against), wherever it lies."""
    x = torch.randn(4, 3, 3, 4)
    if where == "first slab":
        x[0, 1, 0, 0] = value
    elif where == "last slab":
        x[-1, 2, -1, -1] = value
    else:
        x[0, 1, 0, 0], x[-1, 1, -1, -1] = value, -value
    (mean, m2, count), calls = _walked_stats(x, monkeypatch)
    assert calls == 1
    rows = torch_ops._as_rows(x)
    slabs = torch_ops._pieces(rows)
    expected = torch_ops._centred_stats(rows, slabs, torch.empty_like(slabs[0][0]), count)
    for got, want in zip((mean, m2), expected):
        torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("channels_last", [False, True])
def test_slab_walks_off_the_cpu_take_a_few_large_slabs(channels_last):
    """On the CPU a large activation is walked in cache-sized slabs; on another device (a GPU
    without Triton) each slab's ATen calls are kernel launches, so the walk takes few large
    slabs there. Meta tensors stand in for a GPU's: the walk only cuts views."""
    shape, format = (8, 256, 128, 128), torch.channels_last if channels_last else None
    kwargs = {"memory_format": format} if format else {}
    on_cpu = torch_ops._pieces(torch.empty(shape, **kwargs))
    on_device = torch_ops._pieces(torch.empty(shape, device="meta", **kwargs))
    elements = torch.Size(shape).numel()
    assert len(on_cpu) >= elements // torch_ops._SLAB_ELEMENTS
    assert len(on_device) <= -(-elements // torch_ops._DEVICE_SLAB_ELEMENTS)
    assert sum(piece.numel() for (piece,) in on_device) == elements
