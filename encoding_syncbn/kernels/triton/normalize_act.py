"""normalize_act and normalize_running: one read, one write (in place when out is x)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..backend import NormParams, RunningParams
from .activations import activate
from .finalize_stats import div_rn, sqrt_rn
from .plan import (
    Launch,
    OpPlan,
    Target,
    Tile,
    geometry_of,
    plan_op,
    prepared_input,
)
from .tiles import (
    aligned_rows,
    channel_block,
    load_channel,
    nth_tile,
    store_channel,
    tile_range,
)


@triton.jit
def _normalize_tiles(x_ptr, out_ptr, mean, scale, bias, activation_param, c0, N, C, S, R, CS, tiles,
                     tiles_s, tiles_per_prog, ACTIVATION: tl.constexpr,
                     CHANNELS_LAST: tl.constexpr, CHANNEL_ROWS: tl.constexpr, BLOCK_A: tl.constexpr,
                     BLOCK_B: tl.constexpr, ALIGN: tl.constexpr, ACC: tl.constexpr):
    """out = act((x - mean) * scale + bias) over this program's tiles, one read and one write
    per element.

    The mean is subtracted before scaling (no x * scale + shift: it cancels when |mean| >> std).
    ``out`` may be ``x``: each element is read and written by the same program.
    """
    C, S, CS = aligned_rows(C, S, CS, CHANNELS_LAST, ALIGN)
    param = tl.full([], activation_param, ACC)
    start, stop = tile_range(tiles, tiles_per_prog)
    for t in range(start, stop):
        base, local, mask = nth_tile(t, c0, N, C, S, R, CS, tiles_s, CHANNELS_LAST, CHANNEL_ROWS,
                                     BLOCK_A, BLOCK_B)
        x = tl.load(x_ptr + base + local, mask=mask, other=0.0).to(ACC)
        y = activate((x - mean) * scale + bias, param, ACTIVATION)
        tl.store(out_ptr + base + local, y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _normalize_act_kernel(x_ptr, out_ptr, mean_ptr, invstd_ptr, weight_ptr, bias_ptr,
                          activation_param: tl.float64, N, C, S, R, CS, tiles, tiles_s,
                          tiles_per_prog,
                          ACTIVATION: tl.constexpr, CHANNELS_LAST: tl.constexpr,
                          CHANNEL_ROWS: tl.constexpr, BLOCK_A: tl.constexpr,
                          BLOCK_B: tl.constexpr, ALIGN: tl.constexpr, ACC: tl.constexpr):
    """out = act((x - mean) * (invstd * weight) + bias) (:func:`_normalize_tiles`)."""
    c0 = channel_block(CHANNELS_LAST, CHANNEL_ROWS, BLOCK_A, BLOCK_B)
    mean = load_channel(mean_ptr, c0, C, CHANNELS_LAST, CHANNEL_ROWS, BLOCK_A, BLOCK_B)
    scale = (load_channel(invstd_ptr, c0, C, CHANNELS_LAST, CHANNEL_ROWS, BLOCK_A, BLOCK_B)
             * load_channel(weight_ptr, c0, C, CHANNELS_LAST, CHANNEL_ROWS, BLOCK_A, BLOCK_B))
    bias = load_channel(bias_ptr, c0, C, CHANNELS_LAST, CHANNEL_ROWS, BLOCK_A, BLOCK_B)
    _normalize_tiles(x_ptr, out_ptr, mean, scale, bias, activation_param, c0, N, C, S, R, CS, tiles,
                     tiles_s, tiles_per_prog, ACTIVATION, CHANNELS_LAST, CHANNEL_ROWS, BLOCK_A,
                     BLOCK_B, ALIGN, ACC)


@triton.jit
def _normalize_running_kernel(x_ptr, out_ptr, running_mean_ptr, running_var_ptr, eps: tl.float64,
                              weight_ptr, bias_ptr, mean_ptr, invstd_ptr,
                              activation_param: tl.float64, N, C, S, R, CS, tiles, tiles_s,
                              tiles_per_prog,
                              ACTIVATION: tl.constexpr, CHANNELS_LAST: tl.constexpr,
                              CHANNEL_ROWS: tl.constexpr, BLOCK_A: tl.constexpr,
                              BLOCK_B: tl.constexpr, ALIGN: tl.constexpr, ACC: tl.constexpr):
    """Evaluation: ``_normalize_act_kernel`` with the running statistics (buffers of any
    dtype), ``invstd = 1 / sqrt(running_var + eps)`` per channel (correctly rounded steps, as
    ``batch_stats``' and ATen's CPU rsqrt); the first program of each channel block also
    stores the mean and invstd it used (in ACC) for the backward."""
    c0 = channel_block(CHANNELS_LAST, CHANNEL_ROWS, BLOCK_A, BLOCK_B)
    mean = load_channel(running_mean_ptr, c0, C, CHANNELS_LAST, CHANNEL_ROWS, BLOCK_A, BLOCK_B)
    var = load_channel(running_var_ptr, c0, C, CHANNELS_LAST, CHANNEL_ROWS, BLOCK_A, BLOCK_B)
    mean, var = mean.to(ACC), var.to(ACC)
    invstd = div_rn(tl.full([], 1.0, ACC), sqrt_rn(var + tl.full([], eps, ACC)))
    if tl.program_id(1) == 0:
        store_channel(mean_ptr, mean, c0, C, CHANNELS_LAST, CHANNEL_ROWS, BLOCK_A, BLOCK_B)
        store_channel(invstd_ptr, invstd, c0, C, CHANNELS_LAST, CHANNEL_ROWS, BLOCK_A, BLOCK_B)
    scale = invstd * load_channel(weight_ptr, c0, C, CHANNELS_LAST, CHANNEL_ROWS, BLOCK_A, BLOCK_B)
    bias = load_channel(bias_ptr, c0, C, CHANNELS_LAST, CHANNEL_ROWS, BLOCK_A, BLOCK_B)
    _normalize_tiles(x_ptr, out_ptr, mean, scale, bias, activation_param, c0, N, C, S, R, CS, tiles,
                     tiles_s, tiles_per_prog, ACTIVATION, CHANNELS_LAST, CHANNEL_ROWS, BLOCK_A,
                     BLOCK_B, ALIGN, ACC)


def _destination(x: torch.Tensor, out: torch.Tensor, plan: OpPlan) -> torch.Tensor:
    """``out`` when it lies like ``x`` (as the plan launches on it), else a temporary that the
    caller copies to ``out``."""
    if out is x or (out.shape == x.shape and geometry_of(out) == plan.geo):
        return out
    return torch.empty_like(x, dtype=out.dtype)


# normalize_act in place: its output, x itself (or x's contiguous copy), read by the key as its
# input (``Launch.fixed``).
_IN_PLACE_FIXED = (1,)
_INTO_OUT = "out"


def plan_normalize_act(x: torch.Tensor, params: NormParams, out: torch.Tensor, target: Target,
                       tile: Tile | None = None) -> tuple[list[Launch], torch.Tensor] | None:
    """Plan into ``out`` when it lies like (the possibly copied) x, else into a temporary that
    the caller copies to ``out`` (returned as the tensor the kernel writes); None: an empty x,
    nothing to launch."""
    plan = normalize_act_plan(x, params, target, tile)
    if plan is None:
        return None
    args = normalize_act_args(plan, x, params, out)
    return [normalize_act_launch(plan, args)], args[1]


def normalize_act_plan(x: torch.Tensor, params: NormParams, target: Target,
                       tile: Tile | None = None) -> OpPlan | None:
    """``normalize_act``'s memoised plan on ``x`` (None: an empty x)."""
    return plan_op(x, target, reduction=False, tile=tile, activation=params.activation,
                   activation_param=params.activation_param)


def normalize_act_args(plan: OpPlan, x: torch.Tensor, params: NormParams,
                       out: torch.Tensor) -> tuple:
    """The kernel's arguments as ``plan`` plans them: x (its contiguous copy where
    ``plan.copy``) and the tensor it writes, ``out`` (in place: x as launched) where that
    lies like x, else a temporary (``_destination``)."""
    in_place = out is x
    x = prepared_input(x, plan)
    dst = x if in_place else _destination(x, out, plan)
    return (x, dst, *params[:4], plan.activation_param, *plan.args)


def normalize_act_launch(plan: OpPlan, args: tuple) -> Launch:
    """The launch of ``plan`` with ``args`` (:func:`normalize_act_args`)."""
    if args[1] is args[0]:
        return Launch(_normalize_act_kernel, plan.grid, args, plan.constexprs, plan.num_warps,
                      plan.token, _IN_PLACE_FIXED)
    # Into another tensor: a token of its own, for the key reads it (a token fixes the
    # tensors its launches' keys read).
    return Launch(_normalize_act_kernel, plan.grid, args, plan.constexprs, plan.num_warps,
                  (plan.token, _INTO_OUT))


# normalize_running's arguments allocated by its planner: the mean and invstd it writes
# (``Launch.fixed``).
_RUNNING_FIXED = (7, 8)


def plan_normalize_running(x: torch.Tensor, running: RunningParams, out: torch.Tensor,
                           target: Target, tile: Tile | None = None
                           ) -> tuple[list[Launch], torch.Tensor,
                                       tuple[torch.Tensor, torch.Tensor]] | None:
    """As ``plan_normalize_act``, from the running statistics (buffers of any strides, read
    contiguous), with the ``(mean, invstd)`` the launch writes (None: an empty x, nothing to
    launch)."""
    running_mean, running_var, eps, weight, bias, activation, activation_param = running
    plan = plan_op(x, target, reduction=False, tile=tile, activation=activation,
                   activation_param=activation_param)
    if plan is None:
        return None
    running_mean, running_var = running_mean.contiguous(), running_var.contiguous()
    x = prepared_input(x, plan)
    dst = _destination(x, out, plan)
    mean = x.new_empty(plan.geo.c, dtype=plan.acc)
    invstd = torch.empty_like(mean)
    launch = Launch(_normalize_running_kernel, plan.grid,
                    (x, dst, running_mean, running_var, float(eps), weight, bias, mean, invstd,
                     plan.activation_param, *plan.args),
                    plan.constexprs, plan.num_warps, plan.token, _RUNNING_FIXED)
    return [launch], dst, (mean, invstd)
