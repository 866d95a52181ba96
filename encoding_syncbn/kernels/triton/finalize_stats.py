"""finalize_stats: the per-channel step between the statistics and the normalisation, one launch.

``torch_ops.finalize_stats`` does it in some thirteen ATen calls on (C,) vectors (the inverse
standard deviation, the running statistics, the small-gamma flags), each costing more host time
than the arithmetic; here it is one kernel.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ..torch_ops import stats_dtype
from .plan import _TL_DTYPES, Launch, _channel_vectors

# Channels per step of the single program, one a thread (per-channel vectors are a few
# thousand at most; at two a thread, float64 specialisations spilled: fp64 division and sqrt
# are register-hungry subroutines).
_BLOCK_C = 128
_NUM_WARPS = 4


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
def _finalize_stats_kernel(mean_ptr, m2_ptr, invstd_ptr, count: tl.float64, eps: tl.float64,
                           running_mean_ptr, running_var_ptr, batches_ptr,
                           keep: tl.float64, momentum: tl.float64, var_alpha: tl.float64,
                           weight_ptr, bias_ptr, small_ptr, gamma_limit: tl.float64, C,
                           RUNNING: tl.constexpr, COUNTER: tl.constexpr,
                           CUMULATIVE: tl.constexpr, CHECK: tl.constexpr, ACC: tl.constexpr,
                           RUN_ACC: tl.constexpr, BLOCK_C: tl.constexpr):
    """One program walks every channel: it alone reads and increments the batch counter.

    invstd = 1 / sqrt(M2 / count + eps), correctly rounded steps (as ATen's CPU rsqrt);
    running, as ATen's two calls: r_mean = r_mean * keep + momentum * mean and r_var = r_var *
    keep + var_alpha * M2 (keep = 1 - momentum, var_alpha = momentum / (count - 1), from the
    host); cumulative: lerp(r, stat, 1 / batches), the variance's stat M2 * var_alpha
    (var_alpha = 1 / (count - 1): a float64 division fewer, which spilled on sm_90);
    small = |w| <= gamma_limit * max(1, |b|).
    """
    n = tl.full([], count, ACC)
    epsilon = tl.full([], eps, ACC)
    if COUNTER:
        batches = tl.load(batches_ptr) + 1
        tl.store(batches_ptr, batches)
    if CUMULATIVE:
        factor = _div(tl.full([], 1.0, RUN_ACC), batches.to(RUN_ACC))
    kept = tl.full([], keep, RUN_ACC)
    taken = tl.full([], momentum, RUN_ACC)
    taken_var = tl.full([], var_alpha, RUN_ACC)
    limit = tl.full([], gamma_limit, ACC)
    for c0 in range(0, C, BLOCK_C):
        c = c0 + tl.arange(0, BLOCK_C)
        valid = c < C
        m2 = tl.load(m2_ptr + c, mask=valid, other=0.0)
        invstd = _div(tl.full([], 1.0, ACC), _sqrt(_div(m2, n) + epsilon))
        tl.store(invstd_ptr + c, invstd, mask=valid)
        if RUNNING:
            mean = tl.load(mean_ptr + c, mask=valid, other=0.0).to(RUN_ACC)
            r_mean = tl.load(running_mean_ptr + c, mask=valid, other=0.0).to(RUN_ACC)
            r_var = tl.load(running_var_ptr + c, mask=valid, other=0.0).to(RUN_ACC)
            if CUMULATIVE:
                r_mean = _lerp(r_mean, mean, factor)
                r_var = _lerp(r_var, m2.to(RUN_ACC) * taken_var, factor)
            else:
                r_mean = r_mean * kept + taken * mean
                r_var = r_var * kept + taken_var * m2.to(RUN_ACC)
            _store(running_mean_ptr + c, r_mean, valid)
            _store(running_var_ptr + c, r_var, valid)
        if CHECK:
            w = tl.load(weight_ptr + c, mask=valid, other=1.0)
            b = tl.load(bias_ptr + c, mask=valid, other=0.0)
            bound = tl.maximum(tl.abs(b), 1.0, propagate_nan=tl.PropagateNan.ALL) * limit
            tl.store(small_ptr + c, (tl.abs(w) <= bound).to(tl.uint8), mask=valid)


def _plan_finalize_stats(mean: torch.Tensor, m2: torch.Tensor, count: int, eps: float,
                         running_mean: torch.Tensor | None, running_var: torch.Tensor | None,
                         batches: torch.Tensor | None, momentum: float | None,
                         weight: torch.Tensor | None, bias: torch.Tensor | None,
                         gamma_limit: float
                         ) -> tuple[list[Launch], tuple[torch.Tensor, torch.Tensor]]:
    """The launch, and ``(invstd, small)``: ``small`` has C uint8 flags given a ``weight``, else
    no element. An absent tensor is passed as ``mean`` (its constexpr keeps it unread)."""
    acc, c = mean.dtype, mean.shape[0]
    invstd = torch.empty_like(mean)
    check = weight is not None
    small = torch.empty(c if check else 0, dtype=torch.uint8, device=mean.device)
    weight, bias = _channel_vectors(acc, weight, bias) if check else (mean, mean)
    running = running_mean is not None
    scalars, constexprs = _constants(acc, running_mean.dtype if running else None,
                                     batches is not None, momentum, check, count, eps,
                                     gamma_limit)
    counts, rates, limit = scalars
    args = (mean, m2, invstd, *counts, running_mean if running else mean,
            running_var if running else mean, batches if constexprs["COUNTER"] else mean,
            *rates, weight, bias, small, limit, c)
    return [Launch(_finalize_stats_kernel, (1, 1), args, constexprs, _NUM_WARPS)], (invstd, small)


@functools.lru_cache(maxsize=256)
def _constants(acc: torch.dtype, running_dtype: torch.dtype | None, has_counter: bool,
               momentum: float | None, check: bool, count: int, eps: float, gamma_limit: float):
    """The launch's scalar arguments ``((count, eps), (keep, momentum, var_alpha), limit)``
    and constexprs: host ints and floats only, the same from call to call (memoised)."""
    running = running_dtype is not None
    counter = running and has_counter
    cumulative = running and momentum is None
    if cumulative and not counter:
        raise ValueError("momentum=None (a cumulative average) needs num_batches_tracked")
    run_acc = (torch.float64 if torch.float64 in (acc, running_dtype) else torch.float32
               ) if running else acc
    momentum = 0.0 if momentum is None else float(momentum)
    scalars = ((float(count), float(eps)),
               (1.0 - momentum, momentum, (1.0 if cumulative else momentum) / max(count - 1, 1)),
               float(gamma_limit))
    constexprs = {"RUNNING": running, "COUNTER": counter, "CUMULATIVE": cumulative,
                  "CHECK": check, "ACC": _TL_DTYPES[stats_dtype(acc)],
                  "RUN_ACC": _TL_DTYPES[run_acc], "BLOCK_C": _BLOCK_C}
    return scalars, constexprs
