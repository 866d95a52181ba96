"""channel_stats: Welford per lane, Chan across lanes and programs."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .plan import (
    Launch,
    OpPlan,
    Target,
    Tile,
    _merge_launch,
    _prepare,
    plan_op,
)
from .tiles import _channel_block, _tile, _tile_range


@triton.jit
def _welford_combine(mean_a, m2_a, n_a, mean_b, m2_b, n_b):
    """Chan et al.: merge two (mean, M2, n) summaries of disjoint sets.

    n = n_a + n_b,  d = mean_b - mean_a,  mean = mean_a + d * n_b / n,
    M2 = M2_a + M2_b + d^2 * n_a * n_b / n.   Empty summaries (n = 0) are neutral.
    """
    n = n_a + n_b
    w_b = tl.where(n > 0.0, n_b / tl.maximum(n, 1.0), 0.0)
    d = mean_b - mean_a
    return mean_a + d * w_b, m2_a + m2_b + d * d * n_a * w_b, n


@triton.jit
def _merge_lanes(mean, m2, n, AXIS: tl.constexpr):
    """Chan's formula for all the (mean, M2, n) lanes along AXIS (None: every lane) at once:

        n = sum n_i,   mean = sum n_i mean_i / n,   M2 = sum M2_i + sum n_i (mean_i - mean)^2

    The mean is taken in two passes (the residual sum n_i (mean_i - m0) / n corrects the first
    estimate m0), so a large common offset costs no precision. Plain sums rather than
    tl.reduce with a tuple combine: the same math, and the interpreter runs tuple reductions
    as a Python loop over every element.
    """
    total = tl.sum(n, AXIS, keep_dims=True)
    inv = tl.where(total > 0.0, 1.0 / tl.maximum(total, 1.0), 0.0)
    m0 = tl.sum(n * mean, AXIS, keep_dims=True) * inv
    m1 = m0 + tl.sum(n * (mean - m0), AXIS, keep_dims=True) * inv
    # An infinite m0 makes the correction inf - inf: keep m0 (the sum's mean, as BatchNorm's).
    m1 = tl.where(m1 == m1, m1, m0)
    d = mean - m1
    # Summing the kept size-1 axes away only drops them.
    return tl.sum(m1, AXIS), tl.sum(m2 + n * d * d, AXIS), tl.sum(total, AXIS)


@triton.jit
def _channel_stats_kernel(x_ptr, part_ptr, plane, N, C, S, R, CS, tiles, tiles_s,
                          tiles_per_prog, CHANNELS_LAST: tl.constexpr, BLOCK_A: tl.constexpr,
                          BLOCK_B: tl.constexpr, ACC: tl.constexpr):
    """Partial (mean, M2, n) of each channel over this program's tiles -> row pid_1 of the
    [3, splits, C] buffer ``part`` (planes ``plane`` = splits * C elements apart).

    Every lane runs Welford's update over the elements it visits,
        n += 1,  d = x - mean,  mean += d / n,  M2 += d * (x - mean),
    then the lanes of a channel are merged with Chan's formula (:func:`_merge_lanes`).
    An infinite element turns a lane's Welford mean into inf - inf = NaN: such a lane takes
    the mean of its plain sum instead (inf, or NaN for both signs, as BatchNorm's mean).
    """
    c0 = _channel_block(CHANNELS_LAST, BLOCK_B)
    mean = tl.zeros([BLOCK_A, BLOCK_B], ACC)
    m2 = tl.zeros([BLOCK_A, BLOCK_B], ACC)
    cnt = tl.zeros([BLOCK_A, BLOCK_B], ACC)
    total = tl.zeros([BLOCK_A, BLOCK_B], ACC)
    start, stop = _tile_range(tiles, tiles_per_prog)
    for t in range(start, stop):
        base, local, mask = _tile(t, c0, N, C, S, R, CS, tiles_s, CHANNELS_LAST, BLOCK_A, BLOCK_B)
        x = tl.load(x_ptr + base + local, mask=mask, other=0.0).to(ACC)
        cnt += mask.to(ACC)
        total += x
        d = tl.where(mask, x - mean, 0.0)
        mean += d / tl.maximum(cnt, 1.0)
        m2 += d * (x - mean)
    mean = tl.where(mean == mean, mean, total / tl.maximum(cnt, 1.0))
    row_ptr = part_ptr + tl.program_id(1) * C
    if CHANNELS_LAST:
        mean_c, m2_c, cnt_c = _merge_lanes(mean, m2, cnt, 0)
        c = c0 + tl.arange(0, BLOCK_B)
        tl.store(row_ptr + c, mean_c, mask=c < C)
        tl.store(row_ptr + plane + c, m2_c, mask=c < C)
        tl.store(row_ptr + 2 * plane + c, cnt_c, mask=c < C)
    else:
        mean_c, m2_c, cnt_c = _merge_lanes(mean, m2, cnt, None)
        tl.store(row_ptr + c0, mean_c)
        tl.store(row_ptr + plane + c0, m2_c)
        tl.store(row_ptr + 2 * plane + c0, cnt_c)


@triton.jit
def _merge_partials(part_ptr, plane, splits, c, C, BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr):
    """(mean, M2) of the channels ``c`` (a block of BLOCK_C) from the [3, splits, C] partial
    (mean, M2, n) rows: one row as it is, more merged (Chan), BLOCK_P rows a step in a fixed
    order.

    Infinite partial means: as in the stats kernel, a lane whose merged mean is NaN takes the
    mean of the plain sums ``sum(n_p * mean_p) / n``.
    """
    # One return at the end, not an early one inside the runtime `if`: Triton 3.6 fails to
    # compile an early return there ("failed to legalize unresolved materialization").
    if splits == 1:
        mean_c = tl.load(part_ptr + c, mask=c < C, other=0.0)
        m2_c = tl.load(part_ptr + plane + c, mask=c < C, other=0.0)
    else:
        c2 = c[None, :]
        p = tl.arange(0, BLOCK_P)[:, None]
        acc_ty = part_ptr.dtype.element_ty
        mean = tl.zeros([BLOCK_P, BLOCK_C], acc_ty)
        m2 = tl.zeros([BLOCK_P, BLOCK_C], acc_ty)
        cnt = tl.zeros([BLOCK_P, BLOCK_C], acc_ty)
        total = tl.zeros([BLOCK_P, BLOCK_C], acc_ty)
        for p0 in range(0, splits, BLOCK_P):
            mask = (p0 + p < splits) & (c2 < C)
            offs = (p0 + p) * C + c2
            part_mean = tl.load(part_ptr + offs, mask=mask, other=0.0)
            part_cnt = tl.load(part_ptr + 2 * plane + offs, mask=mask, other=0.0)
            total += tl.where(part_cnt > 0.0, part_mean * part_cnt, 0.0)
            mean, m2, cnt = _welford_combine(
                mean, m2, cnt, part_mean, tl.load(part_ptr + plane + offs, mask=mask, other=0.0),
                part_cnt,
            )
        mean = tl.where(mean == mean, mean, total / tl.maximum(cnt, 1.0))
        mean_c, m2_c, _ = _merge_lanes(mean, m2, cnt, 0)
    return mean_c, m2_c


@triton.jit
def _welford_merge_kernel(part_ptr, plane, mean_ptr, m2_ptr, C, splits, BLOCK_P: tl.constexpr,
                          BLOCK_C: tl.constexpr):
    """(mean, M2) per channel from the [3, splits, C] partials (:func:`_merge_partials`)."""
    c = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    mean, m2 = _merge_partials(part_ptr, plane, splits, c, C, BLOCK_P, BLOCK_C)
    tl.store(mean_ptr + c, mean, mask=c < C)
    tl.store(m2_ptr + c, m2, mask=c < C)


def _plan_partial_stats(x: torch.Tensor, target: Target, tile: Tile | None = None
                        ) -> tuple[Launch, torch.Tensor] | None:
    """The statistics kernel's launch and its [3, splits, C] buffer of partial (mean, M2, n)
    (None: an empty x, nothing to launch)."""
    plan = plan_op(x, target, True, tile)
    if plan is None:
        return None
    x = _prepare(x, plan)
    part = torch.empty((3, plan.grid[1], plan.geo.c), dtype=plan.acc, device=x.device)
    return _partial_stats_launch(plan, x, part), part


def _partial_stats_launch(plan: OpPlan, x: torch.Tensor, part: torch.Tensor) -> Launch:
    """The statistics kernel's launch on ``x`` (as ``plan`` launches on it) into ``part``, a
    buffer of 3 * splits * C partials (planes of splits * C: means, M2s, counts)."""
    return Launch(_channel_stats_kernel, plan.grid, (x, part, plan.grid[1] * plan.geo.c,
                                                     *plan.args),
                  plan.constexprs, plan.num_warps)


def _plan_channel_stats(x: torch.Tensor, target: Target, tile: Tile | None = None
                        ) -> tuple[list[Launch], tuple[torch.Tensor, torch.Tensor]] | None:
    """The statistics kernel, then the merge kernel into (mean, M2) of their own (also for one
    row: outputs of a registered op may not share memory); None: an empty x."""
    planned = _plan_partial_stats(x, target, tile)
    if planned is None:
        return None
    launch, part = planned
    splits, c = part.shape[1:]
    mean = torch.empty(c, dtype=part.dtype, device=part.device)
    m2 = torch.empty_like(mean)
    merge = _merge_launch(_welford_merge_kernel, (part, splits * c), splits, c, (mean, m2))
    return [launch, merge], (mean, m2)
