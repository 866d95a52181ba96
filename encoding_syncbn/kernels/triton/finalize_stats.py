"""finalize_stats: a batch's statistics finished in one launch after the statistics kernel.

From the statistics kernel's partial ``(mean, M2, n)`` rows, a program per block of channels
merges each channel's rows (Chan), computes ``invstd``, folds the batch into the running
statistics and flags the channels whose gamma is too small to invert.
``torch_ops.finalize_stats`` does the last three in some thirteen ATen calls on (C,) vectors,
each costing more host time than the arithmetic; here the whole single-replica forward's
statistics are two launches (``batch_stats``).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ..torch_ops import SMALL_GAMMA_FLOOR, stats_dtype
from .channel_stats import _merge_partials, _partial_stats_launch
from .plan import (
    _MERGE_ROWS,
    _TL_DTYPES,
    Launch,
    OpPlan,
    Target,
    Tile,
    _plan_op_memo,
    _prepare,
    plan_memo,
)

# Channels per program (per step of the single program of a cumulative average). Merging the
# partial rows keeps [_MERGE_ROWS, BLOCK_C] lanes of four accumulators live: at 64 channels a
# step (8 lanes a thread) the AOT check found float32 specialisations spilling on sm_90, at 32
# none.
_BLOCK_C = 32
_NUM_WARPS = 4
_SMALL_GAMMA_FLOOR = tl.constexpr(SMALL_GAMMA_FLOOR)


@triton.jit
def _div(a, b):
    """``a / b`` correctly rounded (float64's division is; float32's must be asked for)."""
    if a.dtype == tl.float32:
        return tl.div_rn(a, b)
    return a / b


@triton.jit
def _sqrt(a):
    """``sqrt(a)`` correctly rounded."""
    if a.dtype == tl.float32:
        return tl.sqrt_rn(a)
    return tl.sqrt(a)


@triton.jit
def _store(ptr, value, mask):
    """Store in ``ptr``'s dtype; half types from float32 (Triton's interpreter turns float64
    into bfloat16 wrongly; on a GPU the extra rounding step is below the result's own)."""
    ty = ptr.dtype.element_ty
    if ty == tl.float16 or ty == tl.bfloat16:
        value = value.to(tl.float32)
    tl.store(ptr, value.to(ty), mask=mask)


@triton.jit
def _lerp(start, end, weight):
    """ATen's lerp: ``start + w (end - start)``, from the end when ``w >= 0.5`` (exact at 1)."""
    return tl.where(weight < 0.5, start + weight * (end - start),
                    end - (end - start) * (1.0 - weight))


@triton.jit
def _small_gamma(w, b, limit):
    """``torch_ops.small_gamma``'s test, in ``limit``'s dtype: ``|w| <= max(limit * |b|,
    min(limit, SMALL_GAMMA_FLOOR))`` (a NaN beta flags nothing, as there)."""
    floor = tl.minimum(limit, tl.full([], _SMALL_GAMMA_FLOOR, limit.dtype))
    bound = tl.maximum(tl.abs(b) * limit, floor, propagate_nan=tl.PropagateNan.ALL)
    return tl.abs(w) <= bound


@triton.jit
def _finalize_stats_kernel(part_ptr, plane, splits, mean_ptr, invstd_ptr, count: tl.float64,
                           eps: tl.float64, running_mean_ptr, running_var_ptr, batches_ptr,
                           keep: tl.float64, momentum: tl.float64, var_alpha: tl.float64,
                           weight_ptr, bias_ptr, small_ptr, gamma_limit: tl.float64, C,
                           RUNNING: tl.constexpr, COUNTER: tl.constexpr,
                           CUMULATIVE: tl.constexpr, CHECK: tl.constexpr, ACC: tl.constexpr,
                           RUN_ACC: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr):
    """A program per block of BLOCK_C channels; the first increments the batch counter. With a
    cumulative average every channel needs the incremented counter: one program then walks
    every channel (no program may read a counter another has already incremented). A block's
    channels past C are masked.

    (mean, M2) from the [3, splits, C] partials ``part``, as ``channel_stats``' merge kernel
    takes them (:func:`_merge_partials`: both give the same bits);
    invstd = 1 / sqrt(M2 / count + eps), correctly rounded steps (as ATen's CPU rsqrt);
    running, as ATen's two calls: r_mean = r_mean * keep + momentum * mean and r_var = r_var *
    keep + var_alpha * M2 (keep = 1 - momentum, var_alpha = momentum / (count - 1), from the
    host); cumulative: lerp(r, stat, 1 / batches), the variance's stat M2 * var_alpha
    (var_alpha = 1 / (count - 1): a float64 division fewer, which spilled on sm_90);
    small = _small_gamma(w, b, gamma_limit).
    """
    n = tl.full([], count, ACC)
    epsilon = tl.full([], eps, ACC)
    if COUNTER:
        batches = tl.load(batches_ptr) + 1
        if tl.program_id(0) == 0:  # the only program of a cumulative average
            tl.store(batches_ptr, batches)
    if CUMULATIVE:
        factor = _div(tl.full([], 1.0, RUN_ACC), batches.to(RUN_ACC))
    kept = tl.full([], keep, RUN_ACC)
    taken = tl.full([], momentum, RUN_ACC)
    taken_var = tl.full([], var_alpha, RUN_ACC)
    limit = tl.full([], gamma_limit, ACC)
    # Compiled as two loops, not one with the program's bounds: the latter spilled a float64
    # cumulative specialisation on sm_80.
    if CUMULATIVE:
        c_start, c_stop = 0, C
    else:
        c_start = tl.program_id(0) * BLOCK_C
        c_stop = c_start + BLOCK_C
    for c0 in range(c_start, c_stop, BLOCK_C):
        c = c0 + tl.arange(0, BLOCK_C)
        valid = c < C
        mean, m2 = _merge_partials(part_ptr, plane, splits, c, C, BLOCK_P, BLOCK_C)
        tl.store(mean_ptr + c, mean, mask=valid)
        # invstd last: nothing else is live across its division and square root (subroutine
        # calls, around which live values spilled).
        if RUNNING:
            r_mean = tl.load(running_mean_ptr + c, mask=valid, other=0.0).to(RUN_ACC)
            r_var = tl.load(running_var_ptr + c, mask=valid, other=0.0).to(RUN_ACC)
            if CUMULATIVE:
                r_mean = _lerp(r_mean, mean.to(RUN_ACC), factor)
                r_var = _lerp(r_var, m2.to(RUN_ACC) * taken_var, factor)
            else:
                r_mean = r_mean * kept + taken * mean.to(RUN_ACC)
                r_var = r_var * kept + taken_var * m2.to(RUN_ACC)
            _store(running_mean_ptr + c, r_mean, valid)
            _store(running_var_ptr + c, r_var, valid)
        if CHECK:
            w = tl.load(weight_ptr + c, mask=valid, other=1.0)
            b = tl.load(bias_ptr + c, mask=valid, other=0.0)
            tl.store(small_ptr + c, _small_gamma(w, b, limit).to(tl.uint8), mask=valid)
        invstd = _div(tl.full([], 1.0, ACC), _sqrt(_div(m2, n) + epsilon))
        tl.store(invstd_ptr + c, invstd, mask=valid)


class _FinalizePlan(NamedTuple):
    """Everything about a finalising launch but its tensors (memoised by
    :func:`_finalize_plan`)."""

    grid: tuple[int, int]
    # (plane, splits, count, eps, keep, momentum, var_alpha, gamma_limit, C), the launch's
    # scalar arguments in the kernel's order.
    scalars: tuple
    constexprs: dict
    flags: int  # the small-gamma flags it writes: C with the check, else none


@plan_memo
def _finalize_plan(acc: torch.dtype, splits: int, c: int, count: int, eps: float,
                   running_dtype: torch.dtype | None, has_counter: bool, momentum: float | None,
                   check: bool, gamma_limit: float) -> _FinalizePlan:
    """The launch's grid, scalars and constexprs: host ints and floats only, the same from
    call to call (memoised)."""
    running = running_dtype is not None
    counter = running and has_counter
    cumulative = running and momentum is None
    if cumulative and not counter:
        raise ValueError("momentum=None (a cumulative average) needs num_batches_tracked")
    run_acc = (torch.float64 if torch.float64 in (acc, running_dtype) else torch.float32
               ) if running else acc
    momentum = 0.0 if momentum is None else float(momentum)
    scalars = (splits * c, splits, float(count), float(eps), 1.0 - momentum, momentum,
               (1.0 if cumulative else momentum) / max(count - 1, 1), float(gamma_limit), c)
    constexprs = {"RUNNING": running, "COUNTER": counter, "CUMULATIVE": cumulative,
                  "CHECK": check, "ACC": _TL_DTYPES[stats_dtype(acc)],
                  "RUN_ACC": _TL_DTYPES[run_acc], "BLOCK_P": _MERGE_ROWS,
                  "BLOCK_C": _BLOCK_C}
    programs = 1 if cumulative else -(-c // _BLOCK_C)
    return _FinalizePlan((programs, 1), scalars, constexprs, c if check else 0)


def _finalize_launch(plan: _FinalizePlan, part: torch.Tensor, running_mean: torch.Tensor | None,
                     running_var: torch.Tensor | None, batches: torch.Tensor | None,
                     weight: torch.Tensor | None, bias: torch.Tensor | None
                     ) -> tuple[Launch, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """The launch over ``part`` (the statistics kernel's partials, in the statistics dtype),
    and ``(mean, invstd, small)``: ``small`` has C uint8 flags given a ``weight``, else no
    element. An absent tensor is passed as ``mean`` (its constexpr keeps it unread)."""
    plane, splits, count, eps, keep, momentum, var_alpha, limit, c = plan.scalars
    mean = part.new_empty(c)
    invstd = part.new_empty(c)
    small = part.new_empty(plan.flags, dtype=torch.uint8)
    args = (part, plane, splits, mean, invstd, count, eps,
            mean if running_mean is None else running_mean,
            mean if running_var is None else running_var,
            batches if plan.constexprs["COUNTER"] else mean, keep, momentum, var_alpha,
            mean if weight is None else weight, mean if bias is None else bias, small, limit, c)
    return Launch(_finalize_stats_kernel, plan.grid, args, plan.constexprs, _NUM_WARPS), (
        mean, invstd, small)


def _plan_finalize_stats(part: torch.Tensor, count: int, eps: float,
                         running_mean: torch.Tensor | None, running_var: torch.Tensor | None,
                         batches: torch.Tensor | None, momentum: float | None,
                         weight: torch.Tensor | None, bias: torch.Tensor | None,
                         gamma_limit: float
                         ) -> tuple[Launch, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """:func:`_finalize_launch` over ``part``, the statistics kernel's [3, splits, C]
    partials."""
    splits, c = part.shape[1:]
    plan = _finalize_plan(part.dtype, splits, c, count, eps,
                          running_mean.dtype if running_mean is not None else None,
                          batches is not None, momentum, weight is not None, gamma_limit)
    return _finalize_launch(plan, part, running_mean, running_var, batches, weight, bias)


@plan_memo
def _batch_stats_plan(sizes: tuple[int, ...], strides: tuple[int, ...], dtype: torch.dtype,
                      target: Target, tile: Tile | None, eps: float,
                      running_dtype: torch.dtype | None, has_counter: bool,
                      momentum: float | None, check: bool, gamma_limit: float
                      ) -> tuple[OpPlan, _FinalizePlan] | None:
    """Both launches' plans, memoised together: one lookup a call (None: an empty x)."""
    stats = _plan_op_memo(sizes, strides, dtype, target, True, tile, None, 0.0, None)
    if stats is None:
        return None
    geo = stats.geo
    return stats, _finalize_plan(stats.acc, stats.grid[1], geo.c, geo.n * geo.s, eps,
                                 running_dtype, has_counter, momentum, check, gamma_limit)


def _plan_batch_stats(x: torch.Tensor, eps: float, running_mean: torch.Tensor | None,
                      running_var: torch.Tensor | None, batches: torch.Tensor | None,
                      momentum: float | None, weight: torch.Tensor | None,
                      bias: torch.Tensor | None, gamma_limit: float, target: Target,
                      tile: Tile | None = None
                      ) -> tuple[list[Launch], tuple[torch.Tensor, torch.Tensor, torch.Tensor]
                                 ] | None:
    """``batch_stats``: the statistics kernel, then the finalising one over its partials; two
    launches whatever the split (None: an empty x, nothing to launch)."""
    plans = _batch_stats_plan(
        x.shape, x.stride(), x.dtype, target, tile, eps,
        running_mean.dtype if running_mean is not None else None, batches is not None,
        momentum, weight is not None, gamma_limit)
    if plans is None:
        return None
    stats, finalize = plans
    x = _prepare(x, stats)
    part = x.new_empty(3 * finalize.scalars[0], dtype=stats.acc)  # planes of splits * C
    launch, result = _finalize_launch(finalize, part, running_mean, running_var, batches,
                                      weight, bias)
    return [_partial_stats_launch(stats, x, part), launch], result
