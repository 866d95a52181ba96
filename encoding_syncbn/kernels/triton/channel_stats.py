"""channel_stats and batch_stats: sums of deviations from a shift taken from the data; the last
program of a channel block finishes the block's statistics (one launch)."""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from . import double_double as dd
from .finalize_stats import FinishPlan, finish_batch_stats, finish_plan
from .partials import merge_split, merge_split_double, split_buffers
from .plan import (
    Launch,
    Target,
    Tile,
    plan_memo,
    plan_op,
    plan_op_memo,
    prepared_input,
)
from .tiles import (
    aligned_rows,
    as_block_vector,
    block_channels,
    channel_block,
    channel_sums,
    channel_sums_double,
    next_tile,
    tile_at,
    tile_coordinates,
    tile_range,
)


@triton.jit
def _mean_near(values, origin, mask, AXIS: tl.constexpr):
    """Per channel along ``AXIS``, the mean of the masked ``values`` taken as ``origin`` plus
    their mean deviation from it (``origin`` where none is masked in)."""
    count = tl.maximum(tl.sum(mask.to(values.dtype), AXIS, keep_dims=True), 1.0)
    return origin + tl.sum(tl.where(mask, values - origin, 0.0), AXIS, keep_dims=True) / count


@triton.jit
def _exact_deviation_sums(x, k):
    """``(d, e, p, q)``: the deviation ``x - k = d + e`` exactly, and its square ``p + q``
    (``(d + e)^2`` but ``e^2``, some 2^-106 of it)."""
    d, e = dd.two_sum(x, -k)
    p, q = dd.two_prod(d, d)
    return d, e, p, tl.fma(d + d, e, q)


@triton.jit
def _double_moments(s1, s1_lo, s2, s2_lo, k, part_ptr, block_counter_ptr, c, C, R,
                    CHANNELS_LAST: tl.constexpr, CHANNEL_ROWS: tl.constexpr,
                    SPLIT: tl.constexpr, BLOCK_P: tl.constexpr):
    """float64's ``(mean, M2, finishing)`` from the lanes' double-double sums of the exact
    deviations ``d`` from ``k`` and of their squares (:func:`_block_stats`): the lanes and the
    split's programs added in double-double, ``mean = k + sum(d) / n`` and ``M2 = sum(d^2) -
    sum(d)^2 / n`` in double-double, each rounded once. Where ``mean`` is not finite (an
    infinite input, or the sum's overflow), float64's ``k + sum(d) / n``: inf as
    BatchNorm's mean, where double-double's corrections would make NaN of it."""
    sum_d, sum_d_lo = channel_sums_double(s1, s1_lo, CHANNELS_LAST, CHANNEL_ROWS)
    sum_d2, sum_d2_lo = channel_sums_double(s2, s2_lo, CHANNELS_LAST, CHANNEL_ROWS)
    sum_d, sum_d_lo, sum_d2, sum_d2_lo, finishing = merge_split_double(
        sum_d, sum_d_lo, sum_d2, sum_d2_lo, part_ptr, block_counter_ptr, c, C, SPLIT, BLOCK_P)
    k = as_block_vector(k, CHANNELS_LAST, CHANNEL_ROWS)
    n = tl.zeros_like(k) + R.to(tl.float64)
    zero = tl.zeros_like(k)
    q, q_lo = dd.quotient(sum_d, sum_d_lo, n)
    mean, mean_lo = dd.add(k, zero, q, q_lo)
    mean = tl.where(mean - mean == 0.0, mean + mean_lo, k + sum_d / n)
    square, square_lo = dd.mul(sum_d, sum_d_lo, q, q_lo)
    m2, m2_lo = dd.add(sum_d2, sum_d2_lo, -square, -square_lo)
    m2 = tl.maximum(m2 + m2_lo, 0.0, propagate_nan=tl.PropagateNan.ALL)
    # Squares that overflow (a finite mean): M2 is inf, as nn.BatchNorm2d's sum of squared
    # deviations, where sum(d^2) - sum(d)^2 / n may be inf - inf (M2 >= sum(d^2) / n, d the
    # deviations from one of the values).
    m2 = tl.where((sum_d2 > 1.7976931348623157e308) & (mean - mean == 0.0), sum_d2, m2)
    return mean, m2, finishing


@triton.jit
def _block_stats(x_ptr, part_ptr, counter_ptr, N, C, S, R, CS, tiles, tiles_s, tiles_per_prog,
                 CHANNELS_LAST: tl.constexpr, CHANNEL_ROWS: tl.constexpr, BLOCK_A: tl.constexpr,
                 BLOCK_B: tl.constexpr, ALIGN: tl.constexpr, ACC: tl.constexpr,
                 SPLIT: tl.constexpr, BLOCK_P: tl.constexpr, GROUPS: tl.constexpr,
                 LOADS: tl.constexpr):
    """``(c, mean, M2, finishing)``: this program's channels ``c`` (a block: ``block_channels``)
    and, where ``finishing``, their (mean, M2) over the batch.

    Each channel's values are taken as deviations d = x - K from a shift K: the mean of the
    channel's values in the block's first tile (split: in its first 8 rows or columns, so that every
    program reading them adds little traffic; 0 where that is not finite), which every
    program of the block computes alike (a division a program, none in the loop). Every lane
    sums d and d^2 over the tiles it visits; with the sums over the channel's n values (R of
    them: N * S),
        mean = K + sum(d) / n,   M2 = sum(d^2) - sum(d)^2 / n.
    K lies close to the mean (a mean of many of the channel's values), so sum(d) is small and
    M2 loses no digits to a large offset, while the loop does no division: an element costs a
    subtraction, an add and a fused multiply-add. K is rounded to x's dtype and masked lanes
    load it: their d is 0. Infinities: K = 0 then, or the sums turn inf / NaN, giving
    BatchNorm's mean (inf, or NaN for both signs) and a NaN M2.
    The lanes sum in ACC; their sums across the tile and the split, and the moments, in
    float64, mean and M2 each rounded once to ACC (``batch_stats`` finishes from the M2
    that ``channel_stats`` stores, as the synchronised layer does).
    Why: each lane sums few values, and their roundings average out over the lanes, but
    float32 sums over a whole tile and split, and float32 moments, would err by several
    roundings in invstd and the mean where nn.BatchNorm2d's (and the torch backend's) err by
    one, and the input gradient carries invstd's error twice.
    float64, which has no wider dtype to sum in: d and d^2 exact (d + e, p + q), summed in
    double-double, mean and M2 rounded once (:func:`_double_moments`).
    ``LOADS``: the tiles a step of the loop loads before it sums any (``plan._STATS_LOADS``):
    that many loads in flight a lane, where one leaves the memory idle while its sums run;
    they are summed in tile order, so the sums are those of one tile a step.
    ``SPLIT``: the channel block's tiles are split over the programs of grid axis 1; each
    stores its two sums in row pid_1 of the [2, splits, C] float64 buffer ``part`` (float64
    inputs: [4, splits, C], each sum's high and low parts) and the last to
    finish adds the rows up in index order (``partials``): only it is ``finishing``.
    """
    C, S, CS = aligned_rows(C, S, CS, CHANNELS_LAST, ALIGN)
    c0 = channel_block(CHANNELS_LAST, CHANNEL_ROWS, BLOCK_A, BLOCK_B)
    # The shift, from tile 0: its first row's value plus the tile's mean deviation from it (a
    # constant channel's shift is its value exactly; no sum near the dtype's largest values
    # overflows). Split, every program of the block reads it: then only its first 8 rows
    # (with channel rows: 8 positions of each channel).
    HEAD_ONLY: tl.constexpr = SPLIT and (BLOCK_B if CHANNEL_ROWS else BLOCK_A) > 8
    HEAD_A: tl.constexpr = 8 if HEAD_ONLY and not CHANNEL_ROWS else BLOCK_A
    HEAD_B: tl.constexpr = 8 if HEAD_ONLY and CHANNEL_ROWS else BLOCK_B
    head, head_local, head_mask = tile_at(0, 0, c0, N, C, S, R, CS, CHANNELS_LAST,
                                          CHANNEL_ROWS, HEAD_A, HEAD_B)
    first = tl.load(x_ptr + head + head_local, mask=head_mask, other=0.0).to(ACC)
    # (A block's channels past C have no values: their shift is 0.)
    if CHANNELS_LAST:
        b = tl.arange(0, BLOCK_B)[None, :]
        origin = tl.load(x_ptr + head + b, mask=b < C - c0, other=0.0).to(ACC)
        shift = _mean_near(first, origin, head_mask, 0)
    elif CHANNEL_ROWS:
        a = tl.arange(0, BLOCK_A)[:, None]
        origin = tl.load(x_ptr + head + a * S, mask=a < C - c0, other=0.0).to(ACC)
        shift = _mean_near(first, origin, head_mask, 1)
    else:
        origin = tl.load(x_ptr + head).to(ACC)
        count = tl.sum(head_mask.to(ACC))
        shift = origin + tl.sum(tl.where(head_mask, first - origin, 0.0)) / count
    shift = tl.where(shift - shift == 0.0, shift, 0.0).to(x_ptr.dtype.element_ty)
    k = shift.to(ACC)
    DOUBLE: tl.constexpr = ACC == tl.float64
    start, stop = tile_range(tiles, tiles_per_prog)
    if HEAD_ONLY:
        s1 = tl.zeros([BLOCK_A, BLOCK_B], ACC)
        s2 = tl.zeros([BLOCK_A, BLOCK_B], ACC)
        if DOUBLE:
            s1_lo = tl.zeros([BLOCK_A, BLOCK_B], ACC)
            s2_lo = tl.zeros([BLOCK_A, BLOCK_B], ACC)
    else:
        # The whole of tile 0 was read: the program that starts there takes it from its
        # registers, and walks the rest.
        if DOUBLE:
            head = tl.where(head_mask & (start == 0), first, shift)
            s1, s1_lo, s2, s2_lo = _exact_deviation_sums(head, k)
        else:
            s1 = tl.where(head_mask & (start == 0), first - k, 0.0)
            s2 = s1 * s1
        start = tl.where(start == 0, 1, start)
    tn, ts = tile_coordinates(start, tiles_s, CHANNELS_LAST)
    for t in range(start, stop, LOADS):
        for j in tl.static_range(LOADS):
            base, local, mask = tile_at(tn, ts, c0, N, C, S, R, CS, CHANNELS_LAST,
                                        CHANNEL_ROWS, BLOCK_A, BLOCK_B)
            if LOADS > 1:  # (``mask & scalar`` is not a mask to Triton's interpreter)
                mask = tl.where(t + j < stop, mask, False)
            x = tl.load(x_ptr + base + local, mask=mask, other=shift).to(ACC)
            if DOUBLE:
                t1, t1_lo, t2, t2_lo = _exact_deviation_sums(x, k)
                s1, s1_lo = dd.accumulate(s1, s1_lo, t1, t1_lo)
                s2, s2_lo = dd.accumulate(s2, s2_lo, t2, t2_lo)
            else:
                d = x - k
                s1 += d
                s2 += d * d
            tn, ts = next_tile(tn, ts, tiles_s, CHANNELS_LAST)
    c = block_channels(c0, CHANNELS_LAST, CHANNEL_ROWS, BLOCK_A, BLOCK_B)
    if DOUBLE:
        mean, m2, finishing = _double_moments(s1, s1_lo, s2, s2_lo, k, part_ptr,
                                              counter_ptr + tl.program_id(0), c, C, R,
                                              CHANNELS_LAST, CHANNEL_ROWS, SPLIT, BLOCK_P)
    else:
        sum_d = channel_sums(s1.to(tl.float64), CHANNELS_LAST, CHANNEL_ROWS)
        sum_d2 = channel_sums(s2.to(tl.float64), CHANNELS_LAST, CHANNEL_ROWS)
        sum_d, sum_d2, finishing = merge_split(sum_d, sum_d2, part_ptr,
                                               counter_ptr + tl.program_id(0), counter_ptr, c,
                                               C, SPLIT, BLOCK_P, GROUPS)
        n = R.to(tl.float64)
        mean = (as_block_vector(k, CHANNELS_LAST, CHANNEL_ROWS).to(tl.float64)
                + sum_d / n).to(ACC)
        # Rounding may leave a constant channel's M2 a hair below 0 (NaN stays NaN).
        m2 = tl.maximum(sum_d2 - sum_d * (sum_d / n), 0.0,
                        propagate_nan=tl.PropagateNan.ALL).to(ACC)
    return c, mean, m2, finishing


@triton.jit
def _channel_stats_kernel(x_ptr, part_ptr, counter_ptr, mean_ptr, m2_ptr, N, C, S, R, CS, tiles,
                          tiles_s, tiles_per_prog, CHANNELS_LAST: tl.constexpr,
                          CHANNEL_ROWS: tl.constexpr,
                          BLOCK_A: tl.constexpr, BLOCK_B: tl.constexpr, ALIGN: tl.constexpr,
                          ACC: tl.constexpr, SPLIT: tl.constexpr, BLOCK_P: tl.constexpr,
                          GROUPS: tl.constexpr, LOADS: tl.constexpr):
    """Per channel (mean, M2) of x (:func:`_block_stats`)."""
    c, mean, m2, finishing = _block_stats(x_ptr, part_ptr, counter_ptr, N, C, S, R, CS, tiles,
                                          tiles_s, tiles_per_prog, CHANNELS_LAST, CHANNEL_ROWS,
                                          BLOCK_A, BLOCK_B, ALIGN, ACC, SPLIT, BLOCK_P,
                                          GROUPS, LOADS)
    if finishing:
        tl.store(mean_ptr + c, mean, mask=c < C)
        tl.store(m2_ptr + c, m2, mask=c < C)


@triton.jit
def _batch_stats_kernel(x_ptr, part_ptr, counter_ptr, mean_ptr, invstd_ptr, count: tl.float64,
                        eps: tl.float64, running_mean_ptr, running_var_ptr, batches_ptr,
                        keep: tl.float64, momentum: tl.float64, var_alpha: tl.float64,
                        weight_ptr, bias_ptr, small_ptr, gamma_limit: tl.float64, N, C, S, R,
                        CS, tiles, tiles_s, tiles_per_prog, CHANNELS_LAST: tl.constexpr,
                        CHANNEL_ROWS: tl.constexpr,
                        BLOCK_A: tl.constexpr, BLOCK_B: tl.constexpr, ALIGN: tl.constexpr,
                        ACC: tl.constexpr, SPLIT: tl.constexpr, BLOCK_P: tl.constexpr,
                        GROUPS: tl.constexpr, LOADS: tl.constexpr, RUNNING: tl.constexpr,
                        COUNTER: tl.constexpr, CUMULATIVE: tl.constexpr, CHECK: tl.constexpr,
                        RUN_ACC: tl.constexpr):
    """A batch's (mean, invstd), running statistics and small-gamma flags
    (:func:`_block_stats`, then ``finalize_stats.finish_batch_stats``)."""
    c, mean, m2, finishing = _block_stats(x_ptr, part_ptr, counter_ptr, N, C, S, R, CS, tiles,
                                          tiles_s, tiles_per_prog, CHANNELS_LAST, CHANNEL_ROWS,
                                          BLOCK_A, BLOCK_B, ALIGN, ACC, SPLIT, BLOCK_P,
                                          GROUPS, LOADS)
    if finishing:
        finish_batch_stats(c, mean, m2, counter_ptr, mean_ptr, invstd_ptr, count, eps,
                           running_mean_ptr, running_var_ptr, batches_ptr, keep, momentum,
                           var_alpha, weight_ptr, bias_ptr, small_ptr, gamma_limit, C,
                           RUNNING, COUNTER, CUMULATIVE, CHECK, ACC, RUN_ACC)


# The statistics kernels' arguments their planners allocate or keep: part and counters (the
# stream's, ``partials.split_buffers``: buffers of their own, part in float64), mean and
# M2 or invstd (``Launch.fixed``).
_CHANNEL_STATS_FIXED = (1, 2, 3, 4)
# batch_stats': those, the small-gamma flags, and where absent (passed as ``mean``, unread)
# the running buffers, the counter and the parameters.
_BATCH_STATS_FLAGS = 15
_BATCH_STATS_RUNNING = (7, 8)
_BATCH_STATS_COUNTER = 9
_BATCH_STATS_PARAMETERS = (13, 14)


def _batch_stats_fixed(finish: FinishPlan) -> tuple[int, ...]:
    constexprs = finish.constexprs
    return (*_CHANNEL_STATS_FIXED, _BATCH_STATS_FLAGS,
            *(() if constexprs["RUNNING"] else _BATCH_STATS_RUNNING),
            *(() if constexprs["COUNTER"] else (_BATCH_STATS_COUNTER,)),
            *(() if constexprs["CHECK"] else _BATCH_STATS_PARAMETERS))


def plan_channel_stats(x: torch.Tensor, target: Target, tile: Tile | None = None
                       ) -> tuple[list[Launch], tuple[torch.Tensor, torch.Tensor]] | None:
    """The statistics kernel's launch and its (mean, M2); None: an empty x."""
    plan = plan_op(x, target, reduction=True, tile=tile)
    if plan is None:
        return None
    x = prepared_input(x, plan)
    mean = x.new_empty(plan.geo.c, dtype=plan.acc)
    m2 = torch.empty_like(mean)
    # Split: a plane of splits * C partial sums for each of the sums' parts (float64: high
    # and low), in the stream's buffer; else ``mean``, unread.
    counters, part = split_buffers(x.device, plan.counters, plan.part)
    return [Launch(_channel_stats_kernel, plan.grid,
                   (x, mean if part is None else part, counters, mean, m2, *plan.args),
                   plan.constexprs, plan.num_warps, plan.token, _CHANNEL_STATS_FIXED)], (mean, m2)


class _BatchStatsPlan(NamedTuple):
    """Everything about a ``batch_stats`` launch but its tensors (memoised by
    :func:`_batch_stats_plan`)."""

    copy: bool  # launched on a contiguous copy of x (``OpPlan.copy``)
    channels: int
    acc: torch.dtype  # the statistics dtype
    part: int  # the split partials' elements (0: not split, ``mean`` passed unread)
    counters: int  # the counters it uses (``OpPlan.counters``)
    flags: int  # the small-gamma flags it writes: C with the check, else none
    scalars: tuple  # (count, eps, keep, momentum, var_alpha, gamma_limit)
    running: bool  # whether the running buffers are read (else ``mean`` is passed, unread)
    counter: bool  # whether num_batches_tracked is
    check: bool  # whether weight and bias are
    grid: tuple[int, int]
    args: tuple[int, ...]  # the geometry arguments (``OpPlan.args``)
    constexprs: dict
    num_warps: int
    token: object  # ``Launch.token``
    fixed: tuple[int, ...]  # ``Launch.fixed``


@plan_memo
def _batch_stats_plan(sizes: tuple[int, ...], strides: tuple[int, ...], dtype: torch.dtype,
                      target: Target, tile: Tile | None, eps: float,
                      running_dtype: torch.dtype | None, has_counter: bool,
                      momentum: float | None, check: bool, gamma_limit: float
                      ) -> _BatchStatsPlan | None:
    """The launch's plan: the statistics' (:func:`plan_op`) and the finishing step's
    (``finish_plan``) together; one lookup a call (None: an empty x)."""
    stats = plan_op_memo(sizes, strides, dtype, target, reduction=True, tile=tile,
                         activation=None, activation_param=0.0, saved_is_output=None)
    if stats is None:
        return None
    geo = stats.geo
    finish = finish_plan(stats.acc, geo.c, geo.n * geo.s, eps, running_dtype,
                         has_counter=has_counter, momentum=momentum, check=check,
                         gamma_limit=gamma_limit)
    flags = finish.constexprs
    return _BatchStatsPlan(stats.copy, geo.c, stats.acc, stats.part,
                           stats.counters, finish.flags, finish.scalars, flags["RUNNING"],
                           flags["COUNTER"], flags["CHECK"], stats.grid, stats.args,
                           {**stats.constexprs, **finish.constexprs}, stats.num_warps, object(),
                           _batch_stats_fixed(finish))


def plan_batch_stats(x: torch.Tensor, eps: float, running_mean: torch.Tensor | None,
                     running_var: torch.Tensor | None, batches: torch.Tensor | None,
                     momentum: float | None, weight: torch.Tensor | None,
                     bias: torch.Tensor | None, gamma_limit: float, target: Target,
                     tile: Tile | None = None
                     ) -> tuple[list[Launch], tuple[torch.Tensor, torch.Tensor, torch.Tensor]
                                 ] | None:
    """``batch_stats`` in one launch, whatever the split: ``(mean, invstd, small)``; ``small``
    has C uint8 flags given a ``weight``, else no element (None: an empty x, nothing to
    launch). An absent tensor is passed as ``mean``, which its constexpr keeps unread."""
    plan = batch_stats_plan(x, eps, running_mean, batches, momentum, weight, gamma_limit,
                            target, tile)
    if plan is None:
        return None
    if plan.copy:
        x = x.contiguous()
    args, result = batch_stats_args(plan, x, running_mean, running_var, batches, weight, bias)
    return [batch_stats_launch(plan, args)], result


def batch_stats_plan(x: torch.Tensor, eps: float, running_mean: torch.Tensor | None,
                     batches: torch.Tensor | None, momentum: float | None,
                     weight: torch.Tensor | None, gamma_limit: float, target: Target,
                     tile: Tile | None = None) -> _BatchStatsPlan | None:
    """``batch_stats``' memoised plan on ``x`` (None: an empty x)."""
    return _batch_stats_plan(x.shape, x.stride(), x.dtype, target, tile, eps,
                             running_mean.dtype if running_mean is not None else None,
                             batches is not None, momentum, weight is not None, gamma_limit)


def batch_stats_launch(plan: _BatchStatsPlan, args: tuple) -> Launch:
    """The launch of ``plan`` with ``args`` (:func:`batch_stats_args`)."""
    return Launch(_batch_stats_kernel, plan.grid, args, plan.constexprs, plan.num_warps,
                  plan.token, plan.fixed)


def batch_stats_args(plan: _BatchStatsPlan, x: torch.Tensor, running_mean: torch.Tensor | None,
                     running_var: torch.Tensor | None, batches: torch.Tensor | None,
                     weight: torch.Tensor | None, bias: torch.Tensor | None
                     ) -> tuple[tuple, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """The statistics kernel's arguments as ``plan`` plans them on ``x`` (prepared: the
    contiguous copy where ``plan.copy``), with the outputs it allocates: ``(mean, invstd,
    small)``. An absent tensor is passed as ``mean``, which its constexpr keeps unread."""
    mean = x.new_empty(plan.channels, dtype=plan.acc)
    invstd = torch.empty_like(mean)
    small = mean.new_empty(plan.flags, dtype=torch.uint8)
    counters, part = split_buffers(x.device, plan.counters, plan.part)
    if not plan.running:
        running_mean = running_var = mean
    if not plan.counter:
        batches = mean
    if not plan.check:
        weight = bias = mean
    count, eps, keep, momentum, var_alpha, limit = plan.scalars
    return (x, mean if part is None else part, counters, mean, invstd, count, eps,
            running_mean, running_var, batches, keep, momentum, var_alpha, weight, bias, small,
            limit, *plan.args), (mean, invstd, small)
