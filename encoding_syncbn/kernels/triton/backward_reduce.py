"""backward_reduce: sum(dz) and sum(dz * xhat), partials then a fixed-order sum."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .plan import (
    Launch,
    OpPlan,
    Target,
    Tile,
    _in_layout,
    _merge_launch,
    _prepare,
    plan_op,
)
from .tiles import (
    _channel_block,
    _load_norm_params,
    _store_channel_sum,
    _tile,
    _tile_range,
    _tile_xhat_dz,
)


@triton.jit
def _backward_reduce_kernel(saved_ptr, dy_ptr, mean_ptr, invstd_ptr, weight_ptr, bias_ptr,
                            sum_dz_ptr, sum_dz_xhat_ptr, plane, slope: tl.float64, N, C, S, R, CS,
                            tiles, tiles_s, tiles_per_prog, ACTIVATION: tl.constexpr,
                            SAVED_IS_OUTPUT: tl.constexpr, CHANNELS_LAST: tl.constexpr,
                            BLOCK_A: tl.constexpr, BLOCK_B: tl.constexpr, ACC: tl.constexpr):
    """Partial sum(dz) and sum(dz * xhat) per channel over this program's tiles -> row pid_1 of
    ``sum_dz`` and of ``sum_dz_xhat + plane`` (split: one [2, splits, C] buffer passed as both,
    ``plane`` = splits * C; not split: the two outputs, ``plane`` = 0)."""
    c0 = _channel_block(CHANNELS_LAST, BLOCK_B)
    mean, invstd, weight, bias = _load_norm_params(mean_ptr, invstd_ptr, weight_ptr, bias_ptr,
                                                   c0, C, CHANNELS_LAST, BLOCK_B)
    alpha = tl.full([], slope, ACC)
    acc_dz = tl.zeros([BLOCK_A, BLOCK_B], ACC)
    acc_dz_xhat = tl.zeros([BLOCK_A, BLOCK_B], ACC)
    start, stop = _tile_range(tiles, tiles_per_prog)
    for t in range(start, stop):
        base, local, mask = _tile(t, c0, N, C, S, R, CS, tiles_s, CHANNELS_LAST, BLOCK_A, BLOCK_B)
        xhat, dz = _tile_xhat_dz(saved_ptr, dy_ptr, base + local, mask, mean, invstd, weight,
                                 bias, alpha, ACTIVATION, SAVED_IS_OUTPUT, ACC)
        # Padding lanes may hold inf/nan (0 / weight); keep them out of the sums.
        acc_dz += tl.where(mask, dz, 0.0)
        acc_dz_xhat += tl.where(mask, dz * xhat, 0.0)
    row = tl.program_id(1)
    _store_channel_sum(sum_dz_ptr, acc_dz, row, c0, C, CHANNELS_LAST, BLOCK_B)
    _store_channel_sum(sum_dz_xhat_ptr + plane, acc_dz_xhat, row, c0, C, CHANNELS_LAST, BLOCK_B)


@triton.jit
def _sum_merge_kernel(part_ptr, plane, a_ptr, b_ptr, C, splits, BLOCK_P: tl.constexpr,
                      BLOCK_C: tl.constexpr):
    """From the [2, splits, C] partials ``part``: a[c] = sum_p part[0, p, c] and
    b[c] = sum_p part[1, p, c], always in the same order."""
    c = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)[None, :]
    p = tl.arange(0, BLOCK_P)[:, None]
    acc_ty = part_ptr.dtype.element_ty
    acc_a = tl.zeros([BLOCK_P, BLOCK_C], acc_ty)
    acc_b = tl.zeros([BLOCK_P, BLOCK_C], acc_ty)
    for p0 in range(0, splits, BLOCK_P):
        mask = (p0 + p < splits) & (c < C)
        offs = (p0 + p) * C + c
        acc_a += tl.load(part_ptr + offs, mask=mask, other=0.0)
        acc_b += tl.load(part_ptr + plane + offs, mask=mask, other=0.0)
    c1 = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    tl.store(a_ptr + c1, tl.sum(acc_a, 0), mask=c1 < C)
    tl.store(b_ptr + c1, tl.sum(acc_b, 0), mask=c1 < C)


def _plan_backward_reduce(saved: torch.Tensor, dy: torch.Tensor, mean: torch.Tensor,
                          invstd: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                          activation: str, slope: float, saved_is_output: bool, target: Target,
                          tile: Tile | None = None
                          ) -> tuple[list[Launch], tuple[torch.Tensor, torch.Tensor]] | None:
    """The reduction's launches and their ``(sum_dz, sum_dz_xhat)`` (None: an empty input)."""
    plan = plan_op(saved, target, True, tile, activation, slope, bool(saved_is_output))
    if plan is None:
        return None
    saved = _prepare(saved, plan)
    dy = _in_layout(dy, saved.stride(), plan.geo.channels_last)
    return _reduce_launches(plan, saved, dy, mean, invstd, weight, bias)


def _reduce_launches(plan: OpPlan, saved: torch.Tensor, dy: torch.Tensor, mean: torch.Tensor,
                     invstd: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor
                     ) -> tuple[list[Launch], tuple[torch.Tensor, torch.Tensor]]:
    """The reduction's launches as ``plan`` plans them, on ``saved`` and ``dy`` as it
    launches on them (prepared, in the planned layout), and their ``(sum_dz, sum_dz_xhat)``."""
    acc, grid, c = plan.acc, plan.grid, plan.geo.c
    splits = grid[1]
    sum_dz = saved.new_empty(c, dtype=acc)
    sum_dz_xhat = saved.new_empty(c, dtype=acc)
    if splits == 1:
        rows, merge = (sum_dz, sum_dz_xhat, 0), []
    else:  # one buffer of two planes, passed whole (no views of its planes to make), merged
        part = saved.new_empty(2 * splits * c, dtype=acc)
        rows = (part, part, splits * c)
        merge = [_merge_launch(_sum_merge_kernel, (part, splits * c), splits, c,
                               (sum_dz, sum_dz_xhat))]
    reduce = Launch(_backward_reduce_kernel, grid,
                    (saved, dy, mean, invstd, weight, bias, *rows, plan.slope, *plan.args),
                    plan.constexprs, plan.num_warps)
    return [reduce, *merge], (sum_dz, sum_dz_xhat)
