"""backward_dx: one read of saved and dy, one write of dx."""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ..backend import BatchSums, DxCoefs, NormParams
from . import double_double as dd
from .backward_reduce import reduce_args, reduce_launch
from .plan import (
    Launch,
    OpPlan,
    Target,
    Tile,
    empty_dx,
    in_layout,
    plan_memo,
    plan_op,
    plan_op_memo,
    prepared_input,
)
from .tiles import (
    aligned_rows,
    channel_block,
    load_channel,
    load_norm_params,
    nth_tile,
    tile_range,
    tile_xhat_dz,
)


@triton.jit
def _double_coefs(weight, invstd, sum_dz_xhat, sum_dz, neg_inv_count):
    """float64's ``(scale, p * sum(dz * xhat), p * sum(dz))``, ``scale = w * invstd`` and ``p
    = -scale / n``, each rounded once from double-double: every element of dx takes them."""
    zero = tl.zeros_like(weight * invstd)
    scale, scale_lo = dd.two_prod(weight + zero, invstd + zero)
    # The count, an integer, from its rounded reciprocal (1 / fl(1 / n) is within ulps of n).
    count = zero + tl.floor(-1.0 / neg_inv_count + 0.5)
    p, p_lo = dd.quotient(-scale, -scale_lo, count)
    coef_xhat, coef_xhat_lo = dd.mul(p, p_lo, sum_dz_xhat + zero, zero)
    coef_const, coef_const_lo = dd.mul(p, p_lo, sum_dz + zero, zero)
    return scale, coef_xhat + coef_xhat_lo, coef_const + coef_const_lo


@triton.jit
def _wide_coefs(weight, invstd, sum_dz_xhat, sum_dz, neg_inv_count, ACC: tl.constexpr):
    """float32's ``(scale, p * sum(dz * xhat), p * sum(dz))`` (``_double_coefs``' order),
    taken in float64 and rounded once each, as ``backend.dx_coefs`` takes them: ``w *
    invstd`` is exact there, and every element of dx takes them, unaveraged."""
    scale = weight.to(tl.float64) * invstd.to(tl.float64)
    p = scale * neg_inv_count
    return (scale.to(ACC), (p * sum_dz_xhat.to(tl.float64)).to(ACC),
            (p * sum_dz.to(tl.float64)).to(ACC))


@triton.jit
def _backward_dx_kernel(saved_ptr, dy_ptr, dx_ptr, mean_ptr, invstd_ptr, weight_ptr, bias_ptr,
                        coef_dz_ptr, coef_xhat_ptr, coef_const_ptr, neg_inv_count: tl.float64,
                        activation_param: tl.float64, N, C, S, R, CS, tiles, tiles_s,
                        tiles_per_prog,
                        ACTIVATION: tl.constexpr, SAVED_IS_OUTPUT: tl.constexpr,
                        FROM_SUMS: tl.constexpr, CHANNELS_LAST: tl.constexpr,
                        CHANNEL_ROWS: tl.constexpr, BLOCK_A: tl.constexpr, BLOCK_B: tl.constexpr,
                        ALIGN: tl.constexpr, ACC: tl.constexpr):
    """dx = (coef_dz * dz + coef_xhat * xhat) + coef_const, written in saved's dtype; the
    xhat term 0 where coef_xhat is 0 (as ``torch_ops.backward_dx``).

    ``FROM_SUMS`` (``BatchSums``): coef_xhat_ptr and coef_const_ptr hold sum(dz * xhat) and
    sum(dz) of the batch, coef_dz_ptr is unread, and the coefficients are derived per channel
    in ``dx_coefs``' order: scale = w * invstd, p = scale * (-1/n), (scale, p * sum(dz *
    xhat), p * sum(dz)); float64's in double-double, rounded once each (``_double_coefs``),
    and dx with two fused multiply-adds.
    """
    C, S, CS = aligned_rows(C, S, CS, CHANNELS_LAST, ALIGN)
    c0 = channel_block(CHANNELS_LAST, CHANNEL_ROWS, BLOCK_A, BLOCK_B)
    mean, invstd, weight, bias = load_norm_params(mean_ptr, invstd_ptr, weight_ptr, bias_ptr,
                                                  c0, C, CHANNELS_LAST, CHANNEL_ROWS,
                                                  BLOCK_A, BLOCK_B)
    coef_xhat = load_channel(coef_xhat_ptr, c0, C, CHANNELS_LAST, CHANNEL_ROWS, BLOCK_A, BLOCK_B)
    coef_const = load_channel(coef_const_ptr, c0, C, CHANNELS_LAST, CHANNEL_ROWS, BLOCK_A, BLOCK_B)
    DOUBLE: tl.constexpr = ACC == tl.float64
    if FROM_SUMS:
        if DOUBLE:
            coef_dz, coef_xhat, coef_const = _double_coefs(weight, invstd, coef_xhat,
                                                           coef_const, neg_inv_count)
        else:
            coef_dz, coef_xhat, coef_const = _wide_coefs(weight, invstd, coef_xhat, coef_const,
                                                         neg_inv_count, ACC)
    else:
        coef_dz = load_channel(coef_dz_ptr, c0, C, CHANNELS_LAST, CHANNEL_ROWS, BLOCK_A, BLOCK_B)
    no_xhat_term = coef_xhat == 0.0
    param = tl.full([], activation_param, ACC)
    start, stop = tile_range(tiles, tiles_per_prog)
    for t in range(start, stop):
        base, local, mask = nth_tile(t, c0, N, C, S, R, CS, tiles_s, CHANNELS_LAST, CHANNEL_ROWS,
                                     BLOCK_A, BLOCK_B)
        xhat, dz = tile_xhat_dz(saved_ptr, dy_ptr, base + local, mask, mean, invstd, weight,
                                bias, param, ACTIVATION, SAVED_IS_OUTPUT, ACC)
        # A zero coef_xhat (constant statistics) drops the xhat term: NaN * 0 is no NaN of dx.
        # Two roundings, on a GPU and in the interpreter alike.
        dx = tl.fma(dz, coef_dz,
                    tl.where(no_xhat_term, coef_const, tl.fma(xhat, coef_xhat, coef_const)))
        tl.store(dx_ptr + base + local, dx.to(dx_ptr.dtype.element_ty), mask=mask)


def plan_backward_dx(saved: torch.Tensor, dy: torch.Tensor, params: NormParams,
                     saved_is_output: bool, coefs: DxCoefs | BatchSums, target: Target,
                     tile: Tile | None = None) -> tuple[list[Launch], torch.Tensor] | None:
    """From ``BatchSums`` of a non-empty batch the kernel derives the coefficients
    (``FROM_SUMS``); None: an empty input."""
    plan = plan_op(saved, target, reduction=False, tile=tile, activation=params.activation,
                   activation_param=params.activation_param,
                   saved_is_output=bool(saved_is_output))
    if plan is None:
        return None
    dx = empty_dx(saved, not plan.copy)
    saved = prepared_input(saved, plan)
    dy = in_layout(dy, saved.stride(), plan.geo.channels_last)
    if isinstance(coefs, BatchSums):
        count = coefs.count
        coefs = (params.weight, coefs.sum_dz_xhat, coefs.sum_dz)  # the dz slot unread
    else:
        count = 0
    from_sums = count > 0
    constexprs = _dx_constexprs(plan, from_sums)
    args = _dx_args(plan, saved, dy, dx, params[:4], coefs,
                    -1.0 / count if from_sums else 0.0)
    return [_dx_launch(plan, constexprs, (plan.token, from_sums),
                       _DX_FROM_SUMS_FIXED if from_sums else _DX_FIXED, args)], dx


def _dx_constexprs(plan: OpPlan, from_sums: bool) -> dict:
    """The dx kernel's constexprs: the plan's and ``FROM_SUMS``."""
    return {**plan.constexprs, "FROM_SUMS": from_sums}


# dx's arguments the launch key need not read (``Launch.fixed``): dx, its planner's; from sums,
# the weight again in the unread coef_dz slot; in ``batch_backward``, which it follows the
# reduction in, every one: the reduction's sums it derives its coefficients from, and the
# tensors the reduction's key read.
_DX_FIXED = (2,)
_DX_FROM_SUMS_FIXED = (2, 7)
_DX_FOLLOWING_FIXED = tuple(range(10))


def _dx_args(plan: OpPlan, saved: torch.Tensor, dy: torch.Tensor, dx: torch.Tensor,
             params: tuple[torch.Tensor, ...], coefs: tuple[torch.Tensor, ...],
             neg_inv_count: float) -> tuple:
    """The dx kernel's arguments as ``plan`` plans them, on ``saved`` and ``dy`` as it
    launches on them, into ``dx``; ``params``: (mean, invstd, weight, bias), ``coefs``:
    (coef_dz, coef_xhat, coef_const), or from sums (unread, sum(dz * xhat), sum(dz)) with
    ``neg_inv_count`` ``-1 / count`` (else unread)."""
    return (saved, dy, dx, *params, *coefs, neg_inv_count, plan.activation_param, *plan.args)


def _dx_launch(plan: OpPlan, constexprs: dict, token: object, fixed: tuple[int, ...],
               args: tuple, follows: bool = False) -> Launch:
    """The dx kernel's launch as ``plan`` plans it with ``args`` (:func:`_dx_args`;
    ``constexprs``: the plan's and ``FROM_SUMS``; ``token``, ``fixed`` and ``follows``:
    ``Launch``'s)."""
    return Launch(_backward_dx_kernel, plan.grid, args, constexprs, plan.num_warps, token,
                  fixed, follows)


# The token of dx's launch following the reduction: its own, apart from a lone dx launch
# from sums (``(token, True)``), whose key reads the tensors this one's fixes.
_FOLLOWING = "follows"


class _BackwardPlans(NamedTuple):
    reduce: OpPlan
    dx: OpPlan
    dx_constexprs: dict  # dx's, from the reduction's sums (FROM_SUMS)
    dx_token: object  # dx's launch's (``Launch.token``)


@plan_memo
def _batch_backward_plans(sizes: tuple[int, ...], strides: tuple[int, ...], dtype: torch.dtype,
                          target: Target, tile: Tile | None, activation: str,
                          activation_param: float, saved_is_output: bool
                          ) -> _BackwardPlans | None:
    """The reduction's and dx's plans, memoised together: one lookup a backward (None: an
    empty input)."""
    # Positional, as ``plan_op`` asks: the same memo entries as the ops' own plans.
    reduce, dx = (plan_op_memo(sizes, strides, dtype, target, reduction, tile, activation,
                               activation_param, saved_is_output)
                  for reduction in (True, False))
    if reduce is None:
        return None
    return _BackwardPlans(reduce, dx, _dx_constexprs(dx, from_sums=True),
                          (dx.token, _FOLLOWING))


def plan_batch_backward(saved: torch.Tensor, dy: torch.Tensor, params: NormParams,
                        saved_is_output: bool, count: int, target: Target,
                        tile: Tile | None = None
                        ) -> tuple[list[Launch], tuple[torch.Tensor, torch.Tensor, torch.Tensor]
                                    ] | None:
    """``batch_backward``: the reduction, then dx from its sums (``FROM_SUMS``, ``count``
    elements a channel), planned by one lookup; ``(dx, sum_dz, sum_dz_xhat)`` (None: an empty
    input, nothing to launch)."""
    plans = batch_backward_plans(saved, params, saved_is_output, target, tile)
    if plans is None:
        return None
    reduce, dx, result = batch_backward_args(plans, saved, dy, params, count)
    return batch_backward_launches(plans, reduce, dx), result


def batch_backward_plans(saved: torch.Tensor, params: NormParams, saved_is_output: bool,
                         target: Target, tile: Tile | None = None) -> _BackwardPlans | None:
    """``batch_backward``'s memoised plans on ``saved`` (None: an empty input)."""
    return _batch_backward_plans(saved.shape, saved.stride(), saved.dtype, target, tile,
                                 params.activation, params.activation_param,
                                 bool(saved_is_output))


def batch_backward_args(plans: _BackwardPlans, saved: torch.Tensor, dy: torch.Tensor,
                        params: NormParams, count: int
                        ) -> tuple[tuple, tuple, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """The reduction's and dx's arguments as ``plans`` plan them, with the outputs they
    allocate: ``(dx, sum_dz, sum_dz_xhat)``."""
    reduce = plans.reduce
    dx = empty_dx(saved, not reduce.copy)
    saved = prepared_input(saved, reduce)  # launched on a contiguous copy where planned so
    strides = saved.stride()
    if dy.stride() != strides:  # (``in_layout``'s first test, without its call)
        dy = in_layout(dy, strides, reduce.geo.channels_last)
    vectors = params[:4]
    reduce_args_, (sum_dz, sum_dz_xhat) = reduce_args(reduce, saved, dy, *vectors)
    dx_args = _dx_args(plans.dx, saved, dy, dx, vectors, (params.weight, sum_dz_xhat, sum_dz),
                       -1.0 / count)
    return reduce_args_, dx_args, (dx, sum_dz, sum_dz_xhat)


def batch_backward_launches(plans: _BackwardPlans, reduce_args: tuple, dx_args: tuple
                            ) -> list[Launch]:
    """The reduction's launch, then dx's following it, with their arguments
    (:func:`batch_backward_args`)."""
    return [reduce_launch(plans.reduce, reduce_args),
            _dx_launch(plans.dx, plans.dx_constexprs, plans.dx_token, _DX_FOLLOWING_FIXED,
                       dx_args, follows=True)]
