"""The layer's ops in plain ATen calls: four elementwise/reduction passes, and the per-channel
step between the statistics and the normalisation (``finalize_stats``; with the statistics,
``batch_stats``).

This is the CPU path and the reference every other backend is tested against. The ops take
their arguments in the bundles of ``kernels.backend`` (``NormParams``, ``DxCoefs``, ...). All
per-channel vectors (``mean``, ``invstd``, ``weight``, ``bias`` and the coefficients) are in the
statistics dtype: float32 for half, bfloat16 and float32 inputs, float64 for float64 inputs. Element
tensors (``x``, ``y``, ``dy``, ``dx``) have shape ``(N, C, *)`` in any memory format.

Notation, per channel c and element e of that channel::

    z     = (x - mean) * invstd * weight + bias          pre-activation
    y     = act(z)                                        what the layer returns
    dz    = dy * act'(z)                                  gradient at the pre-activation
    xhat  = (x - mean) * invstd = (z - bias) / weight     normalised input

``saved`` is what the layer kept for backward: the input ``x`` (``saved_is_output=False``) or
the output ``y`` (``saved_is_output=True``, the in-place case), from which ``z`` and ``xhat``
are rebuilt by inverting the activation.

A tensor of at most a slab's elements (``_slab_elements``) is processed whole, in as few ATen
calls as the math allows: on small inputs the per-call overhead is the cost (and, with replicas
in threads, every call is a chance to lose the GIL). A larger one is walked in slabs of about
that many elements along an ``(A, C, B)`` view, through small scratch buffers reused
from slab to slab, with ``out=`` and in-place ATen calls: full-size temporaries would cost
memory (the layer's point is to keep one activation, not three) and, on the CPU, more time
in page faults than the arithmetic itself. Pieces are viewed channel-last, so that the (C,)
vectors broadcast against them as they are.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from .. import activations
from . import double_double
from .backend import (
    BatchSums,
    DxCoefs,
    GammaCheck,
    NormParams,
    RunningParams,
    RunningStats,
    Spread,
    batch_spread,
    dx_coefs,
)

#: The input dtypes the layer computes in, on every backend.
INPUT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
#: Those of half precision, whose rounding an in-place layer's rebuilt input must not amplify.
HALF_DTYPES = (torch.float16, torch.bfloat16)


def stats_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 stays float64; every other floating dtype accumulates in float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def widest_dtype(device: torch.device) -> torch.dtype:
    """float64, where ``device`` computes in it (mps has none: float32 there)."""
    return torch.float32 if device.type == "mps" else torch.float64


# Elements per slab on the CPU: large enough to amortise the per-call overhead, small enough to
# stay in cache between the few ops applied to it. On other devices (a GPU without Triton)
# every ATen call of a slab is a kernel launch and there is no cache to stay in: slabs there
# are as large as a bounded scratch buffer allows.
_SLAB_ELEMENTS = 1 << 17
_DEVICE_SLAB_ELEMENTS = 1 << 24


def _slab_elements(t: torch.Tensor) -> int:
    """Elements per slab for a walk over ``t``, by its device."""
    return _SLAB_ELEMENTS if t.is_cpu else _DEVICE_SLAB_ELEMENTS


def _as_rows(t: torch.Tensor) -> torch.Tensor | None:
    """A view of ``(N, C, *)`` as ``(A, C, B)`` with the channel in the middle, or None.

    NCHW-contiguous gives ``(N, C, H*W)``; channels_last gives ``(N*H*W, C, 1)``.
    """
    channels = t.shape[1]
    if t.is_contiguous():
        return t.view(t.shape[0], channels, -1)
    moved = t.movedim(1, -1)
    if moved.is_contiguous():
        return moved.view(-1, channels, 1)
    return None


def _channel_last(t: torch.Tensor) -> torch.Tensor:
    """A view of ``(N, C, *)`` with the channel dim last, so that (C,) vectors broadcast
    against it as they are (one view of the piece instead of one per vector)."""
    return t if t.dim() == 2 else t.movedim(1, -1)


def _cuts(count: int, columns: int, channels: int, slab: int
          ) -> list[tuple[slice, slice]]:
    """The slabs of an ``(A, B)`` grid of ``channels``-value cells, each as ``(rows, columns)``
    slices: runs of whole rows, or runs of columns of one row where a row alone is larger
    than ``slab`` elements (an NCHW sample's map)."""
    per_row = max(1, columns * channels)
    if per_row > slab:
        step = max(1, slab // max(1, channels))
        return [(slice(a, a + 1), slice(b, b + step))
                for a in range(count) for b in range(0, columns, step)]
    step = slab // per_row
    return [(slice(a, a + step), slice(None)) for a in range(0, count, step)]


def _pieces(*tensors: torch.Tensor, first_only: bool = False
            ) -> list[tuple[torch.Tensor, ...]]:
    """Matching channel-last pieces of same-shaped tensors: the whole tensors when they are
    one slab, else slabs of their ``(A, C, B)`` views (which must have the same strides):
    runs of whole rows, or runs of columns of one row where a row alone is larger than a
    slab (an NCHW sample's map), so that a piece and its scratch stay in cache between the
    ops applied to them. ``first_only``: the first piece alone (its views cost host time)."""
    views: dict[int, torch.Tensor] = {}  # one view per distinct tensor (out may be x)
    slab = _slab_elements(tensors[0])
    if tensors[0].numel() <= slab:
        return [tuple(_view_once(views, t, _channel_last) for t in tensors)]
    rows = [_view_once(views, t, lambda t: _as_rows(t).transpose(1, 2)) for t in tensors]
    count, columns, channels = rows[0].shape
    cuts = _cuts(count, columns, channels, slab)
    pieces = []
    for cut in (cuts[:1] if first_only else cuts):
        # A tensor given twice (an in-place call's input and output) is cut once.
        cut_views: dict[int, torch.Tensor] = {}
        pieces.append(tuple(_view_once(cut_views, r, lambda r, cut=cut: r[cut]) for r in rows))
    return pieces


def _fitted(buffer: torch.Tensor, piece: torch.Tensor) -> torch.Tensor:
    """``buffer``, a scratch buffer shaped like the first piece, cut to ``piece``'s shape (the
    last piece of a walk may be smaller)."""
    if buffer.shape == piece.shape:
        return buffer
    return buffer[tuple(slice(0, size) for size in piece.shape)]


def _view_once(views: dict[int, torch.Tensor], t: torch.Tensor, make) -> torch.Tensor:
    if id(t) not in views:
        views[id(t)] = make(t)
    return views[id(t)]


def _in_rows_layout(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself if it is one slab or has an ``(A, C, B)`` view, else a contiguous copy."""
    if t.numel() <= _slab_elements(t) or _as_rows(t) is not None:
        return t
    return t.contiguous()


def _target_for(out: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
    """``out`` if a walk over ``source`` can write into it piece by piece, else a temporary in
    ``source``'s layout, for the caller to copy into ``out`` afterwards."""
    if source.numel() <= _slab_elements(source):
        return out
    rows = _as_rows(out)
    if rows is not None and rows.stride() == _as_rows(source).stride():
        return out
    return torch.empty_like(source, dtype=out.dtype)


def _reduced_dims(piece: torch.Tensor) -> list[int]:
    """Every dim of a channel-last piece but the channel's."""
    return list(range(piece.dim() - 1))


def _add_piece(total: torch.Tensor | None, piece: torch.Tensor) -> torch.Tensor:
    """``total + piece`` for a walk's per-channel sums: the first piece's sum as it is, then
    the sum in float64 (where the device has it; ``as_dtype`` rounds it back once at the
    end). Why: added one after another in float32, hundreds of pieces' sums would err by as
    many roundings of the total, where each piece's own sum (ATen's cascade) errs by a few of
    its own."""
    if total is None:
        return piece
    wide = widest_dtype(piece.device)
    return (total if total.dtype == wide else total.to(wide)).add_(piece)


def channel_stats(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Per-channel ``(mean, M2, count)`` with ``M2 = sum((x - mean)^2)``.

    One slab: float32 and half inputs as ``_one_slab_moments``; a float64 input has no wider
    accumulator, and Welford's updates then round M2 by up to tens of ulps where the centred
    sum of squares rounds by a few: float64 takes its mean and that sum (the input gradient
    scales with invstd, so its rounding decides how the gradient compares with
    nn.BatchNorm2d's).
    Larger, on the CPU: around a shift ``K``, the first slab's mean, in one ATen call where
    the input suits it (``_fused_stats``), else in one pass in the statistics dtype over the
    deviations ``d = x - K`` (``_shifted_stats``), unless that pass finds ``K`` further than a
    standard deviation from the mean or a sum not finite; then, as on other devices, two
    passes (``_centred_stats``). Never ``E[x^2] - E[x]^2``. An empty batch gives zeros, so
    that it drops out of any Chan merge.
    """
    channels = x.shape[1]
    count = x.numel() // channels if channels else 0
    acc = stats_dtype(x.dtype)
    if count == 0:
        mean = torch.zeros(channels, dtype=acc, device=x.device)
        return mean, torch.zeros_like(mean), 0
    if x.numel() <= _slab_elements(x):
        wide, dims = as_dtype(x, acc), [0, *range(2, x.dim())]
        if acc != torch.float64:
            return (*_one_slab_moments(wide, dims, count), count)
        mean = wide.mean(dim=dims)
        return mean, _float64_m2(_channel_last(wide), mean), count
    rows = _as_rows(_in_rows_layout(x))
    if acc == torch.float64:
        return (*_float64_slab_stats(_pieces(rows)), count)
    if x.is_cpu:
        shift, first_mean_square = _first_slab_moments(rows, acc)
        fused = _fused_stats(x, shift, first_mean_square, count)
        if fused is not None:
            return (*fused, count)
    slabs = _pieces(rows)
    scratch = torch.empty_like(slabs[0][0], dtype=acc)
    if x.is_cpu:
        shifted = _shifted_stats(slabs, scratch, shift, count)
        if shifted is not None:
            return (*shifted, count)
    return (*_centred_stats(rows, slabs, scratch, count), count)


def _one_slab_moments(wide: torch.Tensor, dims: list[int], count: int
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(mean, M2)`` of a float32 tensor of one slab (half inputs widened to it).

    On the CPU in one ATen call, ``var_mean``, whose Welford updates accumulate float32 in
    double: the mean rounded once, as nn.BatchNorm2d's. Why: a mean summed in float32 errs
    by several of its ulps, and a mean's error shifts every normalised value of its channel
    alike, by the error over the standard deviation (hundreds of ulps of xhat at |mean| a
    thousand standard deviations), which the backward's sums carry unaveraged. Welford's
    mean of an infinite value is NaN where BatchNorm's is inf: such channels (read on the
    host: no pass over x where every mean is finite) take ``mean``'s. On other devices ATen
    accumulates in float32, as nn.BatchNorm2d does there: ``mean`` and ``var``."""
    if not wide.is_cpu:
        return wide.mean(dim=dims), wide.var(dim=dims, correction=0).mul_(count)
    variance, mean = torch.var_mean(wide, dim=dims, correction=0)
    if type(mean) is torch.Tensor and np.isnan(_host(mean)).any():
        mean = torch.where(mean.isnan(), wide.mean(dim=dims), mean)
    return mean, variance.mul_(count)


#: Squares ``_float64_m2`` adds in one ATen sum before the exact part of its sum.
_SQUARES_RUN = 16


def _float64_m2(piece: torch.Tensor, mean: torch.Tensor) -> torch.Tensor:
    """Per channel, ``M2 = sum((x - mean)^2)`` of a float64 channel-last piece around the
    (C,) ``mean``, to about one rounding.

    Why: invstd carries half of M2's relative error, and every element of the input gradient
    all of invstd's. Summed as float64 squares of rounded deviations, M2 errs by the
    deviations' roundings (about one each, which few values do not average out) and by the
    sum's (about sqrt(n) at n values), as nn.BatchNorm2d's own sums do; the README bounds the
    input gradient by 3x nn.BatchNorm2d's error, which its luckier channels make smaller than
    that. Here each deviation is exact as ``d + e`` and its square as ``p + q`` (error-free
    transformations, ``double_double``); ATen sums runs of ``_SQUARES_RUN`` of the ``p``, and
    the runs' sums are added in double-double: a run's error is relative to the run's sum,
    and n / ``_SQUARES_RUN`` independent ones (at least ``_SQUARES_RUN``; fewer values are
    added in double-double one by one) average down to a fraction of a rounding of the
    whole. The small terms ``q + 2 d e`` are summed in float64, their rounding far below M2's.
    Where the squares' sum is not finite (a deviation beyond about 2^512, an inf or NaN), it is
    M2, as nn.BatchNorm2d's sum of squares: the terms' errors are taken unguarded
    (``double_double.square``) and may be NaN only there.
    """
    channels = piece.shape[-1]
    d, e = double_double.two_sum(piece, -mean)
    p, q = double_double.square(d)
    values = p.reshape(-1, channels)
    # Fewer runs than a run's squares would not average their errors: all in double-double.
    run = _SQUARES_RUN if values.shape[0] >= _SQUARES_RUN * _SQUARES_RUN else 1
    whole = values.shape[0] // run * run
    runs = [values[:whole].view(-1, run, channels).sum(1)]
    if whole < values.shape[0]:
        runs.append(values[whole:].sum(0, keepdim=True))
    runs = torch.cat(runs).t()
    high, low = double_double.channel_sum((runs, torch.zeros_like(runs)))
    small = q.addcmul_(d, e, value=2.0).sum(dim=_reduced_dims(q))
    high = high.view(channels)
    return torch.where(high.isfinite(), high + (low.view(channels) + small), high)


def _float64_slab_stats(slabs) -> tuple[torch.Tensor, torch.Tensor]:
    """``(mean, M2)`` of float64 slabs: each slab's mean and ``_float64_m2``, merged as
    Chan's (``sync.stats``) with the slab means' errors, the M2 terms added in
    double-double: as precise as one slab's, for the few passes a slab of ``_float64_m2``.

    Why the errors: a slab's rounded mean m_i costs M2 ``2 n_i (m_i - mean) e_i`` (e_i: its
    error); far from zero (|mean| a thousand standard deviations) that is several ulps of
    M2, and invstd carries half of it into every element's gradient."""
    counts, means, m2s, errors = [], [], [], []
    for (slab,) in slabs:
        mean = slab.mean(dim=(0, 1))
        counts.append(slab.numel() // slab.shape[-1])
        means.append(mean)
        m2s.append(_float64_m2(slab, mean))
        if len(slabs) > 1:  # each x - mean is exact near the mean (``residual_mean``)
            errors.append((slab - mean).mean(dim=(0, 1)))
    if len(slabs) == 1:
        return means[0], m2s[0]
    column = torch.tensor(counts, dtype=torch.float64, device=means[0].device).unsqueeze(1)
    means = torch.stack(means)
    mean = (means * column).sum(0) / sum(counts)
    deviation = means - mean + torch.stack(errors)
    deviation -= (deviation * column).sum(0) / sum(counts)
    terms = torch.stack(m2s).addcmul_(deviation * column, deviation).t()
    high, low = double_double.channel_sum((terms, torch.zeros_like(terms)))
    return mean, (high + low).view(-1)


def residual_mean(x: torch.Tensor, mean: torch.Tensor) -> torch.Tensor:
    """Per channel, ``mean(x - mean)`` of ``x`` (N, C, *) around its own rounded (C,) mean:
    the mean's error, to be added to it, in ``mean``'s dtype.

    Why: a rounded mean shifts every normalised value by its error times invstd, the same in
    every element of a channel, and the backward's sums do not average that out; with |mean|
    a thousand standard deviations that is hundreds of ulps of xhat (float64 has no wider
    dtype to take the mean in). Each ``x - mean`` is exact where x lies within a factor 2 of
    the mean (Sterbenz), which is where the shift is large; the sum rounds at the size of
    the deviations, far below the mean's ulp."""
    channels = x.shape[1]
    count = x.numel() // channels if channels else 0
    if count == 0:
        return torch.zeros_like(mean)
    if torch.compiler.is_compiling():  # traced (custom ops' path): Dynamo takes no out= walk
        centred = x - mean.view(1, channels, *([1] * (x.dim() - 2)))
        return centred.mean(dim=[0, *range(2, x.dim())])
    slabs = _pieces(_in_rows_layout(x))
    scratch = torch.empty_like(slabs[0][0], dtype=mean.dtype)
    total = None
    for (slab,) in slabs:
        deviation = torch.sub(slab, mean, out=_fitted(scratch, slab))
        total = _add_piece(total, deviation.sum(dim=_reduced_dims(deviation)))
    return as_dtype(total, mean.dtype).div_(count)


def float64_invstd(m2: torch.Tensor, count: float, eps: float) -> torch.Tensor:
    """``1 / sqrt(M2 / count + eps)`` of float64 (C,) ``m2``, rounded once: the variance in
    double-double, then float64's rsqrt and a Newton step (``double_double.rsqrt``).

    Why: float64 has no wider dtype to take invstd in and round once (as narrower inputs
    do, ``finalize_stats``); its division, sum and root round three times, and the input
    gradient scales with invstd in every element."""
    zero = torch.zeros_like(m2)
    variance = double_double.add(double_double.quotient((m2, zero), float(count)),
                                 (torch.full_like(m2, eps), zero))
    high, low = double_double.rsqrt(variance)
    return high + low


def _sums_around(slabs, scratch: torch.Tensor, shift: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per channel, ``(sum(d), sum(d^2))`` of the deviations ``d = x - shift`` over the slabs,
    in the statistics dtype (the slabs' sums added as ``_add_piece``)."""
    total = squares = None
    for (slab,) in slabs:
        deviation = torch.sub(slab, shift, out=_fitted(scratch, slab))
        total = _add_piece(total, deviation.sum(dim=(0, 1)))
        squares = _add_piece(squares, deviation.mul_(deviation).sum(dim=(0, 1)))
    return as_dtype(total, shift.dtype), as_dtype(squares, shift.dtype)


def _first_slab(rows: torch.Tensor) -> torch.Tensor:
    """The first piece of ``_pieces(rows)``, as an ``(A, C, B)`` view (not channel-last)."""
    count, channels, columns = rows.shape
    slab = _slab_elements(rows)
    if rows.numel() <= slab:
        return rows
    samples, run = _cuts(count, columns, channels, slab)[0]
    return rows[samples, :, run]


def _first_slab_moments(rows: torch.Tensor, dtype: torch.dtype
                        ) -> tuple[torch.Tensor, np.ndarray | None]:
    """Per channel, the mean of the first slab of ``rows`` (an ``(A, C, B)`` view) in ``dtype``,
    0 where it is not finite: the shift the one-pass statistics are taken around; and that
    slab's mean square, in float64 on the host (None where ``rows`` is not in ``dtype`` or
    has no values: a tracer's fakes), with which ``_fused_stats`` checks the shift.

    In ``dtype``, both come from one ATen call, BatchNorm's fused backward with the slab as
    its gradient and its input, centred at 0 (it sums x and x * x per channel); the rest is
    numpy's, on (C,) vectors (an ATen call costs more host time than such a vector's
    arithmetic)."""
    first = _first_slab(rows)
    values = first.numel() // first.shape[1]
    if first.dtype != dtype or type(first) is not torch.Tensor:
        shift = first.sum(dim=(0, 2), dtype=dtype).div_(values)
        return shift.nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0), None
    zeros = torch.zeros(first.shape[1], dtype=dtype)
    _, squares, total = torch.ops.aten.native_batch_norm_backward(
        first, first, None, None, None, zeros, torch.ones_like(zeros), True, 0.0,
        [False, True, True])
    mean = _host(total) / values
    shift = np.where(np.isfinite(mean), mean, 0).astype(zeros.numpy().dtype)
    return torch.from_numpy(shift), _host(squares) / values


def _sums_fit(t: np.ndarray, s: np.ndarray, count: int) -> bool:
    """Whether per-channel ``sum(d)`` and ``sum(d^2)`` of the deviations from a shift, read on
    the host (``_host``), are all finite and the shift lies within a standard deviation of
    every channel's mean (``sum(d)^2 / n <= M2``, with a margin)."""
    return bool(np.isfinite(s).all() and np.isfinite(t).all() and (2 * t * t <= s * count).all())


def _host(t: torch.Tensor) -> np.ndarray:
    """A CPU tensor's values as a float64 numpy array, read without an ATen op of its own
    where nothing records the tensor's history (every op costs host time)."""
    return (t.detach() if t.requires_grad else t).numpy().astype(np.float64)


#: ``_fused_stats``' bounds on its input: its sums run along a sample's channel (at most
#: ``_FUSED_PLANE`` elements) and then across at most ``_FUSED_SAMPLES`` samples, in the
#: statistics dtype; longer runs would lose more digits than the slab walk's sums.
_FUSED_PLANE = 1 << 12
_FUSED_SAMPLES = 1 << 8
#: How far from 0 ``_fused_stats`` takes the shift, in standard deviations: its terms are
#: ``x * d = d^2 + K * d``, whose ``K * d`` parts cancel in the sum, and their roundings grow
#: with ``|K|``.
_FUSED_SHIFT = 2.0


def _fused_stats(x: torch.Tensor, shift: torch.Tensor, first_mean_square: np.ndarray | None,
                 count: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(mean, M2)`` from one read of x, or None where x does not suit it: ATen's fused
    BatchNorm backward with x as both its gradient and its input, centred at the shift
    ``K``, sums ``x`` and ``x * (x - K)`` per channel in one pass; then ``sum(d) = sum(x) -
    n K``, ``sum(d^2) = sum(x * (x - K)) - K sum(d)`` for ``d = x - K``, and as
    ``_shifted_stats``, in float64 on the host (per-channel arithmetic: numpy's calls cost
    less than ATen's), rounded once.

    For an NCHW-contiguous input in the statistics dtype within ``_FUSED_PLANE`` and
    ``_FUSED_SAMPLES``, whose every channel has ``|K|`` within ``_FUSED_SHIFT`` standard
    deviations and within one of its mean, and finite sums: there the result is within a
    few roundings of the slab walk's, for one ATen call instead of four a slab. The shift's
    distance from 0 is first estimated on the first slab (``first_mean_square``, None where
    x is not in the statistics dtype), so that a clearly far one costs that slab's read, not
    the input's."""
    if (first_mean_square is None or x.dim() < 3 or not x.is_contiguous()
            or math.prod(x.shape[2:]) > _FUSED_PLANE or x.shape[0] > _FUSED_SAMPLES):
        return None
    # |K| <= s std, std^2 = E[x^2] - K^2 over the first slab (rough where it cancels, and
    # then rightly refused): (1 + s^2) K^2 <= s^2 E[x^2].
    k = _host(shift)
    if not ((1 + _FUSED_SHIFT ** 2) * k * k <= _FUSED_SHIFT ** 2 * first_mean_square).all():
        return None
    _, product, total = torch.ops.aten.native_batch_norm_backward(
        x, x, None, None, None, shift, torch.ones_like(shift), True, 0.0, [False, True, True])
    # Non-finite inputs make non-finite sums, which ``_sums_fit`` refuses: numpy's warnings
    # on them would reach the user's log for a case handled here.
    with np.errstate(invalid="ignore", over="ignore"):
        deviation = _host(total) - count * k
        squares = _host(product) - k * deviation
    if not _sums_fit(deviation, squares, count):
        return None
    if not (k * k * count <= _FUSED_SHIFT ** 2 * squares).all():
        return None
    mean_deviation = deviation / count
    m2 = squares - deviation * mean_deviation
    dtype = shift.numpy().dtype  # shift: made from numpy, recording no history
    return (torch.from_numpy((mean_deviation + k).astype(dtype)),
            torch.from_numpy(m2.astype(dtype)))


def _shifted_stats(slabs, scratch: torch.Tensor, shift: torch.Tensor, count: int
                   ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(mean, M2)`` in one pass over the slabs, ``mean = K + sum(d) / n`` and ``M2 = sum(d^2)
    - sum(d)^2 / n`` for ``d = x - K``, with ``K = shift`` (``_first_slab_moments``);
    None where a channel's ``K`` lies further than a standard deviation from its mean
    (``sum(d)^2 / n > M2``: the subtraction would cost more digits than the centred passes
    lose) or a sum is not finite (NaN and inf inputs take the centred passes' conventions).

    Near the mean, ``sum(d^2)`` is at most twice M2 and the subtraction exact to a few
    roundings, so that the result is as precise as the centred passes', for one read of x
    instead of two."""
    total, squares = _sums_around(slabs, scratch, shift)
    if type(total) is not torch.Tensor:  # a tracer's fakes: no values to check
        return None
    if not _sums_fit(_host(total), _host(squares), count):
        return None
    mean_deviation = total / count
    m2 = squares.addcmul_(total, mean_deviation, value=-1.0)
    return mean_deviation.add_(shift), m2


def _centred_stats(rows: torch.Tensor, slabs, scratch: torch.Tensor, count: int
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(mean, M2)`` in two passes over x (``rows``: its ``(A, C, B)`` view, cut in
    ``slabs``) in the statistics dtype: the sum, then the deviations ``c`` from its mean and
    their squares. The mean's error (an fp32 sum's) would add n * error^2 to M2 and shift
    every normalised value of its channel alike (``_one_slab_moments``): the centred sum
    takes it out of both, ``M2 = sum(c^2) - sum(c)^2 / n`` and the mean ``+ sum(c) / n`` in
    float64, rounded once (an infinite mean, BatchNorm's, stays as it is)."""
    mean = rows.sum(dim=(0, 2), dtype=scratch.dtype).div_(count)
    centred_sum, m2 = _sums_around(slabs, scratch, mean)
    corrected = (centred_sum.to(widest_dtype(mean.device)) / count).add_(mean).to(mean.dtype)
    return (torch.where(centred_sum.isfinite(), corrected, mean),
            m2.addcmul_(centred_sum, centred_sum, value=-1.0 / count))


@torch.no_grad()
def finalize_stats(mean: torch.Tensor, m2: torch.Tensor, count: int, eps: float,
                   running: RunningStats | None, check: GammaCheck | None
                   ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """What follows a batch's statistics, per channel: ``invstd = 1 / sqrt(M2 / count + eps)``;
    the running statistics folded in (``track_batch``; skipped when ``running`` is None);
    and, given a ``check``, the flags ``small_gamma(*check)`` (else None).
    The Triton backend does all three in ``batch_stats``' second launch.

    ``invstd`` is taken in float64 and rounded once, as nn.BatchNorm2d takes it on the CPU:
    the input gradient scales with it, and three float32 roundings (the division, the sum,
    the root) would leave it coarser than nn.BatchNorm2d's, for a (C,) vector's cost; float64
    in double-double (``float64_invstd``)."""
    if m2.dtype == torch.float64:
        invstd = float64_invstd(m2, count, eps)
    else:
        invstd = torch.rsqrt(m2.to(widest_dtype(m2.device)) / count + eps).to(m2.dtype)
    if running is not None:
        track_batch(*running, mean, m2, count)
    small = small_gamma(*check, batch_spread(m2, count, invstd)) if check is not None else None
    return invstd, small


def batch_stats(x: torch.Tensor, eps: float, running: RunningStats | None,
                check: GammaCheck | None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """A single-replica training forward's statistics: ``channel_stats`` then
    ``finalize_stats``, as ``(mean, invstd, small)``."""
    mean, m2, count = channel_stats(x)
    invstd, small = finalize_stats(mean, m2, count, eps, running, check)
    return mean, invstd, small


@torch.no_grad()
def track_batch(running_mean: torch.Tensor, running_var: torch.Tensor,
                batches: torch.Tensor | None, momentum: float | None,
                mean: torch.Tensor | None, m2: torch.Tensor | None,
                count: int | torch.Tensor) -> None:
    """Count the batch and, unless it is empty, fold it into the running statistics, in place
    (buffers are never rebound): ``r = (1 - f) r + f * stat``, the variance unbiased
    (``M2 / (count - 1)``), ``f = momentum`` or the cumulative average's ``1 / batches``
    (read on the device: ``float()`` of the counter would wait for it).

    Computed in the wider of the buffers' and the statistics' dtypes and rounded to the
    buffers' once, as ``nn.BatchNorm`` does: a half-precision model's buffers updated in
    place would be rounded at each step of the update (1-2 ulp off nn.BatchNorm's a call).

    ``count`` a 0-dim tensor (a compiled synchronised call: the group's count, never read
    back to the host): the same update, selected where the count is not 0.
    """
    if batches is not None:
        batches.add_(1)
    if isinstance(count, torch.Tensor):
        dtype = torch.promote_types(running_mean.dtype, mean.dtype)
        factor = batches.to(dtype).reciprocal() if momentum is None else momentum
        empty = count == 0
        for buffer, stat in ((running_mean, mean), (running_var, m2 / (count - 1))):
            updated = torch.lerp(buffer.to(dtype), stat.to(dtype), factor)
            buffer.copy_(torch.where(empty, buffer.to(dtype), updated))
        return
    if count == 0:
        return
    dtype = torch.promote_types(running_mean.dtype, mean.dtype)
    r_mean, r_var = running_mean.to(dtype), running_var.to(dtype)
    if momentum is None:
        factor = batches.to(dtype).reciprocal()
        r_mean.lerp_(mean.to(dtype), factor)
        r_var.lerp_((m2 / (count - 1)).to(dtype), factor)
    else:
        r_mean.mul_(1 - momentum).add_(mean, alpha=momentum)
        r_var.mul_(1 - momentum).add_(m2, alpha=momentum / (count - 1))
    if r_mean is not running_mean:  # narrower buffers: rounded once
        running_mean.copy_(r_mean)
        running_var.copy_(r_var)


#: ``small_gamma``'s floor for a limit above it: a gamma this small is too small to divide by
#: whatever beta (float16 outputs under 6e-5 are subnormal, and a gamma near zero may cross it
#: between a check and its use). Limits at most this (those of float32 and float64 outputs)
#: are their own floor.
SMALL_GAMMA_FLOOR = 0.02


def small_gamma(weight: torch.Tensor, bias: torch.Tensor, limit: float,
                spread: Spread | None = None) -> torch.Tensor:
    """Per channel: not ``max(limit * |bias|, min(limit, SMALL_GAMMA_FLOOR)) < |weight| < inf``,
    or, given the ``spread`` s of its normalised input, ``|weight| * s < limit * |bias|``
    (bool; no host sync): for a limit up to the floor, ``|weight| <= limit * max(1, |bias|)``.

    Rebuilding the input from the output divides by gamma and multiplies the output's rounding
    by ``|bias| / |weight|``: ``limit`` is the smallest ``|weight| / |bias|`` a channel is
    rebuilt at (``inplace_policy.gamma_limit``). That takes xhat of order 1; in a
    near-constant channel (variance not far above eps) xhat's root mean square
    ``s = sqrt(var / (var + eps))`` is well under 1, the output carries xhat in its low digits
    only, and the weight's gradient ``sum(dz * xhat)`` loses it: the rebuild's error against
    xhat's own size is ``|bias| / (|weight| * s)``, which the second test bounds, squared and
    multiplied out (``w^2 * numerator < (limit * b)^2 * denominator``, at least in float32):
    the Triton finalize kernel takes the same products, and flags the same channels to the
    bit.
    A NaN or infinite weight or bias is flagged too: rebuilding xhat = (z - bias) / weight from
    such a channel's output gives NaN where nn.BatchNorm's gradients have none; a NaN
    variance does not flag a channel (its gradients are NaN either way).
    """
    with torch.no_grad():
        magnitude = weight.abs().nan_to_num_(nan=0.0, posinf=0.0)
        bound = bias.abs().mul_(limit)
        small = (magnitude > bound.clamp_min(min(limit, SMALL_GAMMA_FLOOR))).logical_not_()
        if spread is not None:
            wide = torch.promote_types(spread.numerator.dtype, torch.float32)
            rebuilt_size = magnitude.to(wide).square_().mul_(spread.numerator)
            lost = bound.to(wide).square_().mul_(spread.denominator)
            small.logical_or_(rebuilt_size < lost)
        return small


def as_dtype(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t`` in ``dtype``; no call into torch (which would release the GIL) if it is already."""
    return t if t.dtype == dtype else t.to(dtype)


def normalize_act(x: torch.Tensor, params: NormParams, out: torch.Tensor) -> torch.Tensor:
    """``out = act((x - mean) * (invstd * weight) + bias)``; ``out`` may be ``x`` itself.

    The mean is subtracted before scaling: ``x * scale + shift`` loses the normalised value
    to cancellation when |mean| >> std.
    """
    mean, invstd, weight, bias, activation, activation_param = params
    if x.numel() == 0:
        return out
    source = _in_rows_layout(x)
    target = _target_for(out, source)
    scale = invstd * weight
    activate_ = activations.ACTIVATIONS[activation].forward_
    for piece_in, piece_out in _pieces(source, target):
        # Computed in the statistics dtype: straight into the output when it has that dtype.
        if piece_out.dtype == mean.dtype:
            z = torch.sub(piece_in, mean, out=piece_out)
        else:
            z = torch.sub(piece_in, mean)
        activate_(z.mul_(scale).add_(bias), activation_param)
        if z is not piece_out:
            piece_out.copy_(z)
    if target is not out:
        out.copy_(target)
    return out


def normalize_running(x: torch.Tensor, running: RunningParams,
                      out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Evaluation: ``normalize_act`` with ``mean = running.mean`` and ``invstd =
    1 / sqrt(running.var + eps)`` (buffers of any dtype, taken in the statistics dtype);
    returns that ``(mean, invstd)`` as new tensors (the buffers may change before a
    backward reads them)."""
    running_mean, running_var, eps, weight, bias, activation, activation_param = running
    acc = stats_dtype(x.dtype)
    mean = running_mean.to(acc, copy=True)
    invstd = torch.rsqrt(running_var.to(acc) + eps)
    normalize_act(x, NormParams(mean, invstd, weight, bias, activation, activation_param), out)
    return mean, invstd


def _centred_dz(saved, dy, mean, scale, bias, activation: str, activation_param: float,
                saved_is_output: bool, scratch) -> tuple[torch.Tensor, torch.Tensor]:
    """``(centred, dz)`` of one channel-last piece, written into ``scratch = (centred, dz,
    aux)``, buffers of the piece's shape in the statistics dtype, with ``centred = xhat /
    unit`` for the per-channel ``unit`` of ``_in_xhat_units``: ``z - bias`` rebuilt from the
    output, or ``x - mean``. The unit is applied to the per-channel sums and coefficients
    instead, not to every element (``scale``: ``weight * invstd``). ``aux`` is None where
    neither a widened piece nor the output's inverse uses it (``_scratch``).

    ``dz`` and the inverse are the activation's definition (``activations.py``). Half-precision
    pieces are widened first (ATen's activation backwards compute in their inputs' dtype).
    """
    centred, dz, aux = scratch
    definition = activations.ACTIVATIONS[activation]
    widen = saved.dtype != mean.dtype or dy.dtype != mean.dtype
    if widen:
        dy = aux.copy_(dy)
    if saved_is_output:
        # Without widening, y is the layer's output itself: read it, never write it.
        y = centred.copy_(saved) if widen else saved
        definition.inverse(y, dy, activation_param, centred, dz, aux)
        return centred.sub_(bias), dz
    torch.sub(saved, mean, out=centred)
    if definition.derivative is None:
        dz.copy_(dy)
    else:
        # z as the forward computed it: (x - mean) * scale + bias.
        z = torch.mul(centred, scale, out=dz).add_(bias)
        definition.derivative(dy, z, activation_param, dz)
    return centred, dz


def _in_xhat_units(v: torch.Tensor, params: NormParams, saved_is_output: bool
                   ) -> torch.Tensor:
    """The per-channel ``v`` times ``xhat / centred`` (see ``_centred_dz``): ``1 / weight``
    where xhat is rebuilt from the output, ``invstd`` where it comes from the input; taken
    in float64 and rounded once to the statistics dtype (a (C,) vector: its roundings would
    reach every element)."""
    wide = widest_dtype(v.device)
    unit = (params.weight.to(wide).reciprocal() if saved_is_output
            else params.invstd.to(wide))
    return (v.to(wide) * unit).to(params.mean.dtype)


def _backward_pieces(saved, dy, params: NormParams, saved_is_output: bool, *outs):
    """Yield ``(centred, dz, *out_pieces)`` for each piece of ``saved``, ``dy`` and ``outs``
    (``centred``: see ``_centred_dz``).

    ``saved`` must be one slab or have an ``(A, C, B)`` view, and ``outs`` its layout. The
    ``(centred, dz)`` of a piece are valid until the next one is yielded. Where the first of
    ``outs`` has the statistics dtype, ``centred`` is written into its piece (``_scratch``).
    """
    mean, invstd, weight, bias, activation, activation_param = params
    if saved_is_output and activations.ACTIVATIONS[activation].inverse is None:
        raise ValueError(f"activation {activation!r} cannot be inverted from its output")
    if saved.numel() > _slab_elements(saved) and (
        _as_rows(dy) is None or _as_rows(dy).stride() != _as_rows(saved).stride()
    ):
        # One copy of dy into saved's layout, so that both walk in step.
        dy = torch.empty_like(saved, dtype=dy.dtype).copy_(dy)
    pieces = _pieces(saved, dy, *outs)
    into_out = bool(outs) and outs[0].dtype == mean.dtype
    scratch = _scratch(pieces[0][0], dy, mean.dtype, saved_is_output, into_out)
    scale = None if saved_is_output else weight * invstd
    for s, d, *out_pieces in pieces:
        buffers = [None if b is None else _fitted(b, s) for b in scratch]
        if into_out:
            buffers[0] = out_pieces[0]
        yield (*_centred_dz(s, d, mean, scale, bias, activation, activation_param, saved_is_output,
                            buffers),
               *out_pieces)


def _scratch(piece: torch.Tensor, dy: torch.Tensor, dtype: torch.dtype, saved_is_output: bool,
             into_out: bool) -> list[torch.Tensor | None]:
    """The buffers ``(centred, dz, aux)`` of a backward walk whose first piece is ``piece``
    (``_centred_dz``), in ``dtype``; None for those it needs not: ``centred`` where it goes
    into the output's piece (``into_out``: dx, whose terms are then summed over it), ``aux``
    where nothing is widened into it and no inverse of the output may use it. Why: on one
    slab each buffer is as large as the input, and the fused backward that
    ``batch_backward`` runs elsewhere keeps only dz beside dx.

    In the pieces' own layout (a transposed view for slabs): mixed layouts would stop
    TensorIterator from walking the memory in order."""
    widen = piece.dtype != dtype or dy.dtype != dtype
    return [None if into_out else torch.empty_like(piece, dtype=dtype),
            torch.empty_like(piece, dtype=dtype),
            torch.empty_like(piece, dtype=dtype) if widen or saved_is_output else None]


def backward_reduce(saved: torch.Tensor, dy: torch.Tensor, params: NormParams,
                    saved_is_output: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel ``(sum(dz), sum(dz * xhat))`` in the statistics dtype."""
    if saved.numel() == 0:
        return torch.zeros_like(params.mean), torch.zeros_like(params.mean)
    saved = _in_rows_layout(saved)
    sum_dz = sum_dz_centred = None
    for centred, dz in _backward_pieces(saved, dy, params, saved_is_output):
        dims = _reduced_dims(dz)
        sum_dz = _add_piece(sum_dz, dz.sum(dim=dims))
        sum_dz_centred = _add_piece(sum_dz_centred, centred.mul_(dz).sum(dim=dims))
    return (as_dtype(sum_dz, params.mean.dtype),
            _in_xhat_units(sum_dz_centred, params, saved_is_output))


def _channels_without_xhat_term(coef_xhat: torch.Tensor) -> torch.Tensor | bool:
    """The channels whose ``coef_xhat`` is 0: False where none, True where all, else their
    indices, read from the (C,) vector where it lies in host memory (through numpy: no ATen
    op, so a step's no-sync check sees no host read); on other devices, whose read would wait
    for the device, and for tensors without values (a tracer's fakes), a (C,) mask.

    Evaluation has no xhat term in any channel; training has one in every channel but where
    gamma is 0 or a sum cancels exactly (a BatchNorm feeding another one: its sum(dz * xhat)
    is about 0), so the mask of the NaN pattern costs the channels it applies to, not a pass.
    """
    zero = coef_xhat == 0
    if type(zero) is not torch.Tensor or not zero.is_cpu:
        return zero
    flags = zero.numpy()
    if flags.all() or not flags.any():
        return bool(flags.all())
    return torch.from_numpy(flags.nonzero()[0])


def _drop_xhat_term(term: torch.Tensor, channels: torch.Tensor | bool,
                    coef_const: torch.Tensor) -> None:
    """``term = coef_const`` in ``channels`` (``_channels_without_xhat_term``) of a
    channel-last piece."""
    if channels is False:
        return
    if channels.dtype == torch.bool:
        torch.where(channels, coef_const, term, out=term)
        return
    values = coef_const[channels]
    term.index_copy_(term.dim() - 1, channels, values.expand(*term.shape[:-1], len(values)))


def backward_dx(saved: torch.Tensor, dy: torch.Tensor, params: NormParams,
                saved_is_output: bool, coefs: DxCoefs | BatchSums) -> torch.Tensor:
    """``dx = coef_dz * dz + coef_xhat * xhat + coef_const``, in ``saved``'s dtype, with the
    coefficients ``coefs`` (``dx_coefs`` derives them from ``BatchSums``); where
    ``coef_xhat`` is 0 the xhat term is 0, even where xhat is NaN or inf.

    Every input gradient of the layer has this form (see ``functional.py`` for the
    coefficients of the local and the synchronised case). With constant statistics
    (evaluation) ``coef_xhat`` is 0: dx is ``w * invstd * dz``, as ATen's, which reads no x,
    so that a NaN input element or running mean makes no NaN input gradient by itself.

    Per element, ``coef_xhat * xhat + coef_const`` is ``centred * (coef_xhat * unit) +
    coef_const`` (``_centred_dz``), each op taking at most one per-channel vector (ATen's
    loops vectorise only those). The NaN pattern costs no element pass on the CPU
    (``_channels_without_xhat_term``).
    """
    coef_dz, coef_xhat, coef_const = dx_coefs(params, coefs)
    # In saved's own layout, as the compiled path's fake implementation promises.
    dx = torch.empty_like(saved)
    if saved.numel() == 0:
        return dx
    walked = _in_rows_layout(saved)
    target = _target_for(dx, walked)
    without = _channels_without_xhat_term(coef_xhat)
    coef_centred = _in_xhat_units(coef_xhat, params, saved_is_output)
    for centred, dz, piece_dx in _backward_pieces(walked, dy, params, saved_is_output, target):
        if without is True:
            torch.add(dz.mul_(coef_dz), coef_const, out=piece_dx)
            continue
        term = centred.mul_(coef_centred).add_(coef_const)
        _drop_xhat_term(term, without, coef_const)
        torch.addcmul(term, dz, coef_dz, out=piece_dx)
    if target is not dx:
        dx.copy_(target)
    return dx


def _rebuilt_scale(weight: torch.Tensor, invstd: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(unit, bn_weight)``: the inverse deviation and the weight ATen's BatchNorm backward
    takes for xhat rebuilt as ``(z - bias) * unit``. ``unit`` is ``1 / weight`` taken in
    float64 and rounded once to the weight's dtype, as ATen takes it; ``bn_weight`` is
    ``weight * invstd / unit`` with that rounded unit, so that the product ATen scales dx by,
    ``unit * bn_weight``, is ``weight * invstd`` to ``bn_weight``'s one rounding: unit's
    own rounding, which would reach every element of dx alike, is taken out. In float32,
    taken in float64 and rounded once; in float64, in double-double."""
    wide = weight.to(widest_dtype(weight.device))
    unit = wide.reciprocal().to(weight.dtype)
    if weight.dtype != torch.float64:  # (invstd and unit promoted to wide's dtype)
        return unit, (wide * invstd / unit).to(weight.dtype)
    high, low = double_double.quotient(double_double.two_prod(weight, invstd), unit)
    return unit, high + low


def batch_backward(saved: torch.Tensor, dy: torch.Tensor, params: NormParams,
                   saved_is_output: bool, count: int, overwrite_saved: bool = False
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dx, sum(dz), sum(dz * xhat))`` of a layer normalised with its own batch's
    statistics: ``backward_reduce``, then ``backward_dx`` from ``BatchSums(..., count)``.

    Where ``saved`` and ``dy`` are in the statistics dtype, in one call of ATen's fused
    BatchNorm backward (two passes in C++, where the walk over pieces makes a dozen ATen
    calls a piece), on the pre-activation rebuilt whole: ``native_batch_norm_backward(dz,
    z, ...)`` with ``z - bias`` and ``1 / weight`` as its centre and inverse deviation (from
    the output), or on x itself with the batch's mean and invstd: nn.BatchNorm's own backward.
    Its weight is chosen so that its dx is ``w * invstd * (dz - sum(dz) / n - xhat * sum(dz *
    xhat) / n)``, and its weight gradient is ``sum(dz * xhat)``. The rebuilt z and dz are
    full-size temporaries of this call (where act' is 1, none: z is y and dz is dy), except
    that with ``overwrite_saved`` (nothing reads the output after this call) z is rebuilt over
    the output itself, sparing a full-size allocation (memory and, on the CPU, page faults).
    """
    mean, invstd, weight, bias, activation, activation_param = params
    if saved.numel() == 0 or saved.dtype != mean.dtype or dy.dtype != mean.dtype:
        sums = backward_reduce(saved, dy, params, saved_is_output)
        return backward_dx(saved, dy, params, saved_is_output, BatchSums(*sums, count)), *sums
    definition = activations.ACTIVATIONS[activation]
    if saved_is_output and definition.inverse is None:
        raise ValueError(f"activation {activation!r} cannot be inverted from its output")
    z, dz = saved, dy
    if definition.derivative is not None:  # else act(z) = z: z is y, dz is dy
        if saved_is_output:
            z = saved if overwrite_saved else torch.empty_like(saved)
            dz = torch.empty_like(saved)
            definition.inverse(saved, dy, activation_param, z, dz, None)
        else:
            dz = torch.empty_like(saved)
            affine = NormParams(mean, invstd, weight, bias, "none", activation_param)
            normalize_act(saved, affine, dz)
            definition.derivative(dy, dz, activation_param, dz)
    # As xhat = (z - centre) * unit, and unit * bn_weight = weight * invstd: (C,) vectors
    # taken in float64 and rounded once each, as nn.BatchNorm2d's own are.
    if saved_is_output:
        centre, (unit, bn_weight) = bias, _rebuilt_scale(weight, invstd)
    else:
        centre, unit, bn_weight = mean, invstd, weight
    dx, sum_dz_xhat, sum_dz = torch.ops.aten.native_batch_norm_backward(
        dz, z, bn_weight, None, None, centre, unit, True, 0.0, [True, True, True])
    return dx, sum_dz, sum_dz_xhat
