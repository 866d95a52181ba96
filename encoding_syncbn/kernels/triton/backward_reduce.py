"""backward_reduce: sum(dz) and sum(dz * xhat); split reductions merged by their last program
(one launch)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import double_double as dd
from .activations import xhat_dz
from .partials import merge_split, merge_split_double, split_buffers
from .plan import (
    Launch,
    OpPlan,
    Target,
    Tile,
    in_layout,
    plan_op,
    prepared_input,
)
from .tiles import (
    aligned_rows,
    block_channels,
    channel_block,
    channel_sums,
    channel_sums_double,
    load_norm_params,
    nth_tile,
    tile_range,
    tile_xhat_dz,
)


@triton.jit
def _exact_dz_xhat(saved, dz, xhat, mean, invstd, SAVED_IS_OUTPUT: tl.constexpr):
    """float64's ``dz * xhat`` as a double-double ``(p, e)``: from the input, of the exact
    ``xhat = (x - mean) invstd`` (the deviation and both products exact, but the deviation's
    low part times invstd, a rounding some 2^-106 of xhat); from the output, of its
    rounded xhat (the rebuild's own rounding is larger)."""
    if SAVED_IS_OUTPUT:
        p, e = dd.two_prod(dz, xhat)
    else:
        centred, centred_lo = dd.two_sum(saved, -mean)
        exact_xhat, exact_xhat_lo = dd.two_prod(centred, invstd)
        p, e = dd.two_prod(dz, exact_xhat)
        e = tl.fma(dz, tl.fma(centred_lo, invstd, exact_xhat_lo), e)
    return p, e


@triton.jit
def _backward_reduce_kernel(saved_ptr, dy_ptr, mean_ptr, invstd_ptr, weight_ptr, bias_ptr,
                            sum_dz_ptr, sum_dz_xhat_ptr, part_ptr, counter_ptr,
                            activation_param: tl.float64, N, C, S, R, CS, tiles, tiles_s,
                            tiles_per_prog,
                            ACTIVATION: tl.constexpr, SAVED_IS_OUTPUT: tl.constexpr,
                            CHANNELS_LAST: tl.constexpr, CHANNEL_ROWS: tl.constexpr,
                            BLOCK_A: tl.constexpr, BLOCK_B: tl.constexpr, ALIGN: tl.constexpr,
                            ACC: tl.constexpr, SPLIT: tl.constexpr, BLOCK_P: tl.constexpr,
                            GROUPS: tl.constexpr):
    """sum(dz) and sum(dz * xhat) per channel over this program's tiles -> ``sum_dz``,
    ``sum_dz_xhat``. ``SPLIT``: each program stores its sums in row pid_1 of the [2, splits,
    C] float64 buffer ``part`` (float64 inputs: [4, splits, C]), and the last of a channel
    block to finish sums the rows in index order (``partials``). The lanes sum in ACC, their
    sums across the tile and the split in float64, rounded once to ACC, as the channel
    statistics (``channel_stats._block_stats``; ATen's BatchNorm backward sums float32 in
    float64 on the CPU): with dz along xhat, sum(dz * xhat) sets the xhat term of every
    element of dx. float64, which has no wider dtype to sum in: dz * xhat exact
    (``_exact_dz_xhat``), both sums in double-double, rounded once."""
    C, S, CS = aligned_rows(C, S, CS, CHANNELS_LAST, ALIGN)
    c0 = channel_block(CHANNELS_LAST, CHANNEL_ROWS, BLOCK_A, BLOCK_B)
    mean, invstd, weight, bias = load_norm_params(mean_ptr, invstd_ptr, weight_ptr, bias_ptr,
                                                  c0, C, CHANNELS_LAST, CHANNEL_ROWS,
                                                  BLOCK_A, BLOCK_B)
    param = tl.full([], activation_param, ACC)
    DOUBLE: tl.constexpr = ACC == tl.float64
    acc_dz = tl.zeros([BLOCK_A, BLOCK_B], ACC)
    acc_dz_xhat = tl.zeros([BLOCK_A, BLOCK_B], ACC)
    if DOUBLE:
        acc_dz_lo = tl.zeros([BLOCK_A, BLOCK_B], ACC)
        acc_dz_xhat_lo = tl.zeros([BLOCK_A, BLOCK_B], ACC)
    start, stop = tile_range(tiles, tiles_per_prog)
    for t in range(start, stop):
        base, local, mask = nth_tile(t, c0, N, C, S, R, CS, tiles_s, CHANNELS_LAST, CHANNEL_ROWS,
                                     BLOCK_A, BLOCK_B)
        # Padding lanes may hold inf/nan (0 / weight); keep them out of the sums.
        if DOUBLE:
            s = tl.load(saved_ptr + base + local, mask=mask, other=0.0)
            dy = tl.load(dy_ptr + base + local, mask=mask, other=0.0)
            xhat, dz = xhat_dz(s, dy, mean, invstd, weight, bias, param, ACTIVATION,
                               SAVED_IS_OUTPUT)
            dz = tl.where(mask, dz, 0.0)
            product, product_lo = _exact_dz_xhat(s, dz, xhat, mean, invstd, SAVED_IS_OUTPUT)
            acc_dz, acc_dz_lo = dd.accumulate(acc_dz, acc_dz_lo, dz, 0.0)
            acc_dz_xhat, acc_dz_xhat_lo = dd.accumulate(acc_dz_xhat, acc_dz_xhat_lo,
                                                        tl.where(mask, product, 0.0),
                                                        tl.where(mask, product_lo, 0.0))
        else:
            xhat, dz = tile_xhat_dz(saved_ptr, dy_ptr, base + local, mask, mean, invstd, weight,
                                    bias, param, ACTIVATION, SAVED_IS_OUTPUT, ACC)
            acc_dz += tl.where(mask, dz, 0.0)
            acc_dz_xhat += tl.where(mask, dz * xhat, 0.0)
    c = block_channels(c0, CHANNELS_LAST, CHANNEL_ROWS, BLOCK_A, BLOCK_B)
    if DOUBLE:
        sum_dz, sum_dz_lo = channel_sums_double(acc_dz, acc_dz_lo, CHANNELS_LAST, CHANNEL_ROWS)
        sum_dz_xhat, sum_dz_xhat_lo = channel_sums_double(acc_dz_xhat, acc_dz_xhat_lo,
                                                          CHANNELS_LAST, CHANNEL_ROWS)
        sum_dz, sum_dz_lo, sum_dz_xhat, sum_dz_xhat_lo, finishing = merge_split_double(
            sum_dz, sum_dz_lo, sum_dz_xhat, sum_dz_xhat_lo, part_ptr, counter_ptr + c0, c, C,
            SPLIT, BLOCK_P)
        sum_dz = sum_dz + sum_dz_lo
        sum_dz_xhat = sum_dz_xhat + sum_dz_xhat_lo
    else:
        sum_dz = channel_sums(acc_dz.to(tl.float64), CHANNELS_LAST, CHANNEL_ROWS)
        sum_dz_xhat = channel_sums(acc_dz_xhat.to(tl.float64), CHANNELS_LAST, CHANNEL_ROWS)
        sum_dz, sum_dz_xhat, finishing = merge_split(sum_dz, sum_dz_xhat, part_ptr,
                                                     counter_ptr + c0, counter_ptr, c, C, SPLIT,
                                                     BLOCK_P, GROUPS)
    if finishing:
        tl.store(sum_dz_ptr + c, sum_dz.to(ACC), mask=c < C)
        tl.store(sum_dz_xhat_ptr + c, sum_dz_xhat.to(ACC), mask=c < C)


def plan_backward_reduce(saved: torch.Tensor, dy: torch.Tensor, mean: torch.Tensor,
                         invstd: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                         activation: str, activation_param: float, saved_is_output: bool,
                         target: Target, tile: Tile | None = None
                         ) -> tuple[list[Launch], tuple[torch.Tensor, torch.Tensor]] | None:
    """The reduction's launches and their ``(sum_dz, sum_dz_xhat)`` (None: an empty input)."""
    plan = plan_op(saved, target, reduction=True, tile=tile, activation=activation,
                   activation_param=activation_param, saved_is_output=bool(saved_is_output))
    if plan is None:
        return None
    saved = prepared_input(saved, plan)
    dy = in_layout(dy, saved.stride(), plan.geo.channels_last)
    args, sums = reduce_args(plan, saved, dy, mean, invstd, weight, bias)
    return [reduce_launch(plan, args)], sums


# The reduction's arguments its planner allocates or keeps: its sums, and the stream's partials
# and counters (``partials.split_buffers``: buffers of their own, part in float64)
# (``Launch.fixed``).
_REDUCE_FIXED = (6, 7, 8, 9)


def reduce_args(plan: OpPlan, saved: torch.Tensor, dy: torch.Tensor, mean: torch.Tensor,
                invstd: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor
                ) -> tuple[tuple, tuple[torch.Tensor, torch.Tensor]]:
    """The reduction's arguments as ``plan`` plans them, on ``saved`` and ``dy`` as it
    launches on them (prepared, in the planned layout), and its ``(sum_dz, sum_dz_xhat)``."""
    c = plan.geo.c
    sum_dz = saved.new_empty(c, dtype=plan.acc)
    sum_dz_xhat = torch.empty_like(sum_dz)  # fewer arguments to parse than new_empty's
    # Split: the planes of partial sums, in the stream's buffer; else unread.
    counters, part = split_buffers(saved.device, plan.counters, plan.part)
    return (saved, dy, mean, invstd, weight, bias, sum_dz, sum_dz_xhat,
            sum_dz if part is None else part, counters, plan.activation_param,
            *plan.args), (sum_dz, sum_dz_xhat)


def reduce_launch(plan: OpPlan, args: tuple) -> Launch:
    """The reduction's launch as ``plan`` plans it, with ``args`` (:func:`reduce_args`)."""
    return Launch(_backward_reduce_kernel, plan.grid, args, plan.constexprs, plan.num_warps,
                  plan.token, _REDUCE_FIXED)
