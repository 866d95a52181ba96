"""normalize_act: one read, one write (in place when out is x)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .activations import _activate
from .plan import (
    Launch,
    Target,
    Tile,
    _geometry,
    _prepare,
    plan_op,
)
from .tiles import _channel_block, _load_channel, _tile, _tile_range


@triton.jit
def _normalize_act_kernel(x_ptr, out_ptr, mean_ptr, invstd_ptr, weight_ptr, bias_ptr,
                          slope: tl.float64, N, C, S, R, CS, tiles, tiles_s, tiles_per_prog,
                          ACTIVATION: tl.constexpr, CHANNELS_LAST: tl.constexpr,
                          BLOCK_A: tl.constexpr, BLOCK_B: tl.constexpr, ACC: tl.constexpr):
    """out = act((x - mean) * (invstd * weight) + bias), one read and one write per element.

    The mean is subtracted before scaling (no x * scale + shift: it cancels when |mean| >> std).
    ``out`` may be ``x``: each element is read and written by the same program.
    """
    c0 = _channel_block(CHANNELS_LAST, BLOCK_B)
    mean = _load_channel(mean_ptr, c0, C, CHANNELS_LAST, BLOCK_B)
    scale = _load_channel(invstd_ptr, c0, C, CHANNELS_LAST, BLOCK_B) * _load_channel(
        weight_ptr, c0, C, CHANNELS_LAST, BLOCK_B)
    bias = _load_channel(bias_ptr, c0, C, CHANNELS_LAST, BLOCK_B)
    alpha = tl.full([], slope, ACC)
    start, stop = _tile_range(tiles, tiles_per_prog)
    for t in range(start, stop):
        base, local, mask = _tile(t, c0, N, C, S, R, CS, tiles_s, CHANNELS_LAST, BLOCK_A, BLOCK_B)
        x = tl.load(x_ptr + base + local, mask=mask, other=0.0).to(ACC)
        y = _activate((x - mean) * scale + bias, alpha, ACTIVATION)
        tl.store(out_ptr + base + local, y.to(out_ptr.dtype.element_ty), mask=mask)


def _plan_normalize_act(x: torch.Tensor, mean: torch.Tensor, invstd: torch.Tensor,
                        weight: torch.Tensor, bias: torch.Tensor, activation: str, slope: float,
                        out: torch.Tensor, target: Target, tile: Tile | None = None
                        ) -> tuple[list[Launch], torch.Tensor] | None:
    """Plan into ``out`` when it lies like (the possibly copied) x, else into a temporary that
    the caller copies to ``out`` (returned as the tensor the kernel writes); None: an empty x,
    nothing to launch."""
    plan = plan_op(x, target, False, tile, activation, slope)
    if plan is None:
        return None
    x = _prepare(x, plan)
    same_layout = out is x or (out.shape == x.shape and _geometry(out) == plan.geo)
    dst = out if same_layout else torch.empty_like(x, dtype=out.dtype)
    launch = Launch(_normalize_act_kernel, plan.grid,
                    (x, dst, mean, invstd, weight, bias, plan.slope, *plan.args),
                    plan.constexprs, plan.num_warps)
    return [launch], dst
