"""finalize_stats: what follows a batch's statistics, per channel, done by the statistics
kernel's program that has a channel block's (mean, M2) (``channel_stats``' batch kernel).

It computes ``invstd``, folds the batch into the running statistics and flags the channels
whose gamma is too small (or not finite) to invert. ``torch_ops.finalize_stats`` does the same
in some thirteen ATen calls on (C,) vectors, each costing more host time than the arithmetic; here a
single-replica forward's statistics are one launch (``batch_stats``).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ..torch_ops import SMALL_GAMMA_FLOOR
from . import double_double as dd
from .plan import TL_DTYPES, plan_memo

_INF = tl.constexpr(float("inf"))
_SMALL_GAMMA_FLOOR = tl.constexpr(SMALL_GAMMA_FLOOR)


@triton.jit
def div_rn(a, b):
    """``a / b`` correctly rounded (float64's division is; float32's must be asked for)."""
    if a.dtype == tl.float32:
        return tl.div_rn(a, b)
    return a / b


@triton.jit
def sqrt_rn(a):
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
def _small_gamma(w, b, limit, m2, n, invstd):
    """``torch_ops.small_gamma``'s test with the batch's spread, in ``limit``'s dtype: not
    ``max(limit * |b|, min(limit, SMALL_GAMMA_FLOOR)) < |w| < inf`` (a NaN or infinite w or b
    is flagged, as there), or ``w^2 * (invstd^2 * m2) < (limit * |b|)^2 * n`` (the rebuild's
    error against xhat's spread; the same products, so the same flags)."""
    floor = tl.minimum(limit, tl.full([], _SMALL_GAMMA_FLOOR, limit.dtype))
    bound = tl.abs(b) * limit
    magnitude = tl.abs(w)
    rebuilt = ((magnitude > tl.maximum(bound, floor, propagate_nan=tl.PropagateNan.ALL))
               & (magnitude < _INF))  # False for any NaN
    rebuilt_size = magnitude * magnitude * (invstd * invstd * m2)
    return ~rebuilt | (rebuilt_size < bound * bound * n.to(bound.dtype))


@triton.jit
def _float64_invstd(m2, n, epsilon):
    """``torch_ops.float64_invstd``, step for step (the same bits): ``1 / sqrt(M2 / n +
    eps)`` of float64 M2 rounded once (the variance in double-double, then float64's rsqrt
    and a Newton step); float64 has no wider dtype to take it in."""
    zero = tl.zeros_like(m2)
    q, q_lo = dd.quotient(m2, zero, zero + n)
    variance, variance_lo = dd.add(q, q_lo, zero + epsilon, zero)
    invstd, invstd_lo = dd.rsqrt(variance, variance_lo)
    return invstd + invstd_lo


@triton.jit
def finish_batch_stats(c, mean, m2, counter_ptr, mean_ptr, invstd_ptr, count: tl.float64,
                       eps: tl.float64, running_mean_ptr, running_var_ptr, batches_ptr,
                       keep: tl.float64, momentum: tl.float64, var_alpha: tl.float64,
                       weight_ptr, bias_ptr, small_ptr, gamma_limit: tl.float64, C,
                       RUNNING: tl.constexpr, COUNTER: tl.constexpr,
                       CUMULATIVE: tl.constexpr, CHECK: tl.constexpr, ACC: tl.constexpr,
                       RUN_ACC: tl.constexpr):
    """A channel block's batch statistics finished, by the program that has its (mean, M2):
    stored mean, invstd, running statistics and small-gamma flags of the channels ``c`` (a
    block; those past C masked).

    invstd = 1 / sqrt(M2 / count + eps) in float64, correctly rounded steps, then rounded
    once to ACC (as ``torch_ops.finalize_stats``: the input gradient scales with it); a
    float64 ACC in double-double (:func:`_float64_invstd`);
    running, as ATen's two calls: r_mean = r_mean * keep + momentum * mean and r_var = r_var *
    keep + var_alpha * M2 (keep = 1 - momentum, var_alpha = momentum / (count - 1), from the
    host); cumulative: lerp(r, stat, 1 / batches), the variance's stat M2 * var_alpha
    (var_alpha = 1 / (count - 1));
    small = _small_gamma(w, b, gamma_limit, m2, count, invstd).

    The batch counter is incremented once: by channel block 0, or, for a cumulative average
    (where every block reads it), by the last block to finish (``counter_ptr + C``: the
    counter after the channels' own), once every other block has read it.
    """
    valid = c < C
    n = tl.full([], count, tl.float64)
    epsilon = tl.full([], eps, tl.float64)
    # The divisions and the square root first, while little is live: in float64 they are
    # subroutine calls, and values live across them spill.
    if COUNTER:
        batches = tl.load(batches_ptr) + 1
    if CUMULATIVE:
        factor = div_rn(tl.full([], 1.0, RUN_ACC), batches.to(RUN_ACC))
    if ACC == tl.float64:
        invstd = _float64_invstd(m2, n, epsilon)
    else:
        invstd = div_rn(tl.full([], 1.0, tl.float64),
                        sqrt_rn(div_rn(m2.to(tl.float64), n) + epsilon)).to(ACC)
    tl.store(invstd_ptr + c, invstd, mask=valid)
    tl.store(mean_ptr + c, mean, mask=valid)
    if RUNNING:
        r_mean = tl.load(running_mean_ptr + c, mask=valid, other=0.0).to(RUN_ACC)
        r_var = tl.load(running_var_ptr + c, mask=valid, other=0.0).to(RUN_ACC)
        taken_var = tl.full([], var_alpha, RUN_ACC)
        if CUMULATIVE:
            r_mean = _lerp(r_mean, mean.to(RUN_ACC), factor)
            r_var = _lerp(r_var, m2.to(RUN_ACC) * taken_var, factor)
        else:
            kept = tl.full([], keep, RUN_ACC)
            taken = tl.full([], momentum, RUN_ACC)
            r_mean = r_mean * kept + taken * mean.to(RUN_ACC)
            r_var = r_var * kept + taken_var * m2.to(RUN_ACC)
        _store(running_mean_ptr + c, r_mean, valid)
        _store(running_var_ptr + c, r_var, valid)
        if COUNTER:
            if CUMULATIVE:
                blocks = tl.num_programs(0)
                tl.debug_barrier()
                finished = tl.atomic_add(counter_ptr + C, 1, sem="acq_rel", scope="gpu")
                if finished == blocks - 1:
                    tl.store(batches_ptr, batches)
                    tl.store(counter_ptr + C, 0)
            else:
                if tl.program_id(0) == 0:
                    tl.store(batches_ptr, batches)
    if CHECK:
        w = tl.load(weight_ptr + c, mask=valid, other=1.0)
        b = tl.load(bias_ptr + c, mask=valid, other=0.0)
        limit = tl.full([], gamma_limit, ACC)
        small = _small_gamma(w, b, limit, m2, n, invstd)
        tl.store(small_ptr + c, small.to(tl.uint8), mask=valid)


class FinishPlan(NamedTuple):
    """The finishing step's scalars and constexprs (memoised by :func:`finish_plan`)."""

    # (count, eps, keep, momentum, var_alpha, gamma_limit): the kernel's scalar arguments.
    scalars: tuple
    constexprs: dict
    flags: int  # the small-gamma flags it writes: C with the check, else none


@plan_memo
def finish_plan(acc: torch.dtype, c: int, count: int, eps: float,
                running_dtype: torch.dtype | None, *, has_counter: bool,
                momentum: float | None, check: bool, gamma_limit: float) -> FinishPlan:
    """Host ints and floats only, the same from call to call (memoised)."""
    running = running_dtype is not None
    counter = running and has_counter
    cumulative = running and momentum is None
    if cumulative and not counter:
        raise ValueError("momentum=None (a cumulative average) needs num_batches_tracked")
    run_acc = (torch.float64 if torch.float64 in (acc, running_dtype) else torch.float32
               ) if running else acc
    momentum = 0.0 if momentum is None else float(momentum)
    scalars = (float(count), float(eps), 1.0 - momentum, momentum,
               (1.0 if cumulative else momentum) / max(count - 1, 1), float(gamma_limit))
    constexprs = {"RUNNING": running, "COUNTER": counter, "CUMULATIVE": cumulative,
                  "CHECK": check, "RUN_ACC": TL_DTYPES[run_acc]}
    return FinishPlan(scalars, constexprs, c if check else 0)
