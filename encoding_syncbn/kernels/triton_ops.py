"""Triton kernels for the four ops of :mod:`encoding_syncbn.kernels.torch_ops`.

Same names, signatures, semantics and dtype rules as ``torch_ops`` (the reference); read its
docstring for the notation (``z``, ``y``, ``dz``, ``xhat``). Each kernel sits next to its launch
planner. Memory traffic per element of an activation of B bytes (see DESIGN.md):

    forward   channel_stats (read x)             + normalize_act (read x, write y)      = 3B
    backward  backward_reduce (read saved, dy)   + backward_dx (read saved, dy, write dx) = 5B

Tensor geometry. An ``(N, C, *)`` input is handled as ``N`` images of ``C`` channels and
``S = prod(*)`` positions, read where it lies:

* NCHW (contiguous): element ``(n, c, s)`` at ``(n*C + c)*S + s``. A program owns one channel and
  walks tiles of ``[BLOCK_A images, BLOCK_B positions]``.
* channels_last (C innermost, also 3-D/5-D and 2-D inputs): element at ``r*C + c`` with the row
  ``r = n*S + s``. A program owns ``BLOCK_B`` channels and walks tiles of ``[BLOCK_A rows,
  BLOCK_B channels]``.

Any other strides are copied once to NCHW. The grid is ``(channel blocks, splits)``: the tiles of
a channel block are dealt out to ``splits`` programs in contiguous ranges. The reductions write
one partial result per program into a ``[splits, C]`` buffer, merged by a second small kernel
when ``splits > 1`` (deterministic: no atomics).

Accumulation is in float32 for half, bfloat16 and float32 inputs and in float64 for float64
inputs; per-channel vectors come in (and go out) in that statistics dtype.
"""

from __future__ import annotations

import functools
import math
import threading
from collections.abc import Iterator
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .. import _compat
from .torch_ops import elu_inverse_floor, stats_dtype

#: Whether kernels run in Triton's CPU interpreter (fixed when ``triton.jit`` wrapped them).
INTERPRET: bool = _compat.triton_interpreting()

#: Input dtypes the kernels are built for.
DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)

#: Activations the kernels are specialised on. "none" and "identity" run as leaky_relu with
#: slope 1, which is exact (z * 1 == z, y / 1 == y) and saves a specialisation of every kernel.
KERNEL_ACTIVATIONS = ("leaky_relu", "elu", "relu")
#: (saved_is_output, activation) pairs the backward kernels are built for: relu has no inverse.
BACKWARD_VARIANTS = tuple((False, a) for a in KERNEL_ACTIVATIONS) + tuple(
    (True, a) for a in KERNEL_ACTIVATIONS if a != "relu"
)

_TL_DTYPES = {torch.float32: tl.float32, torch.float64: tl.float64}

# Elements per tile, 8 (fp64: 1) per thread. fp64's divisions, exp and log are register-hungry
# subroutines: at 2, 4 and 8 elements a thread the AOT check found fp64 specialisations of the
# backward reduction and the statistics spilling (8-16 bytes, sm_80 and sm_90); at 1 none.
# (fp64 on a GPU is for checking, not speed.) The interpreter pays per program and per operation,
# not per element, so it gets bigger tiles (and fewer programs, below).
_GPU_TILE_ELEMS = 2048
_GPU_TILE_ELEMS_FP64 = 128
_INTERPRET_TILE_ELEMS = 8192
_NUM_WARPS = 8
_NUM_WARPS_FP64 = 4


def _num_warps(dtype: torch.dtype) -> int:
    return _NUM_WARPS_FP64 if dtype == torch.float64 else _NUM_WARPS


# Tile widths. NCHW: rows of 64 positions over many images (small and medium maps), or one long
# run of a single image. channels_last: rows of 16 channels (C <= 16) or 64.
_NCHW_WIDTH = 64
_CHANNELS_LAST_WIDTHS = (16, 64)
# Programs per launch to aim for, per SM on a GPU / in total in the interpreter.
_REDUCE_PROGRAMS_PER_SM = 4
_ELEMENTWISE_PROGRAMS_PER_SM = 16
_INTERPRET_PROGRAMS = 16
# CUDA limits grid axis 1 to 65535; splits beyond that take more tiles each instead.
_MAX_SPLITS = 65535
_INT32_MAX = 2**31 - 1
# The partial-merge kernels: [_MERGE_ROWS splits, _MERGE_CHANNELS channels] per step.
_MERGE_ROWS = 16
_MERGE_CHANNELS = 64

_ELU_FLOOR_FP32 = tl.constexpr(elu_inverse_floor(torch.float32))
_ELU_FLOOR_FP64 = tl.constexpr(elu_inverse_floor(torch.float64))


# --------------------------------------------------------------------------------------------
# Device functions shared by the kernels
# --------------------------------------------------------------------------------------------


@triton.jit
def _tile(t, c0, N, C, S, R, CS, tiles_s, CHANNELS_LAST: tl.constexpr, BLOCK_A: tl.constexpr,
          BLOCK_B: tl.constexpr):
    """``(base, local, mask)`` of tile ``t`` of the channel block starting at ``c0``.

    ``base`` is a scalar int64 element offset, ``local`` the int32 offsets inside the tile:
    per-element address arithmetic stays 32-bit while tensors may exceed 2**31 elements
    (``_pick_tile`` only picks tiles whose offsets fit).
    """
    a = tl.arange(0, BLOCK_A)[:, None]
    b = tl.arange(0, BLOCK_B)[None, :]
    if CHANNELS_LAST:
        r0 = tl.cast(t, tl.int64) * BLOCK_A
        base = r0 * C + c0
        local = a * C + b
        mask = (a < R - r0) & (b < C - c0)
    else:
        tn = t // tiles_s
        n0 = tl.cast(tn, tl.int64) * BLOCK_A
        # One plane may pass 2**31 elements: the position offset is int64 too.
        s0 = tl.cast(t - tn * tiles_s, tl.int64) * BLOCK_B
        base = n0 * CS + tl.cast(c0, tl.int64) * S + s0
        local = a * CS + b
        mask = (a < N - n0) & (b < S - s0)
    return base, local, mask


@triton.jit
def _channel_block(CHANNELS_LAST: tl.constexpr, BLOCK_B: tl.constexpr):
    """First channel of this program: channels_last programs own BLOCK_B channels, NCHW one."""
    if CHANNELS_LAST:
        c0 = tl.program_id(0) * BLOCK_B
    else:
        c0 = tl.program_id(0)
    return c0


@triton.jit
def _load_channel(ptr, c0, C, CHANNELS_LAST: tl.constexpr, BLOCK_B: tl.constexpr):
    """A per-channel vector, shaped to broadcast over a tile: [1, BLOCK_B] or a scalar."""
    if CHANNELS_LAST:
        c = c0 + tl.arange(0, BLOCK_B)[None, :]
        v = tl.load(ptr + c, mask=c < C, other=1.0)
    else:
        v = tl.load(ptr + c0)
    return v


@triton.jit
def _store_channel_sum(ptr, acc, row, c0, C, CHANNELS_LAST: tl.constexpr, BLOCK_B: tl.constexpr):
    """``ptr[row, c] = sum of acc over its lanes of channel c`` (partial buffer [splits, C])."""
    if CHANNELS_LAST:
        c = c0 + tl.arange(0, BLOCK_B)
        tl.store(ptr + row * C + c, tl.sum(acc, 0), mask=c < C)
    else:
        tl.store(ptr + row * C + c0, tl.sum(acc))


@triton.jit
def _tile_range(tiles, tiles_per_prog):
    """This program's contiguous range of tiles in its channel block."""
    start = tl.program_id(1) * tiles_per_prog
    return start, tl.minimum(start + tiles_per_prog, tiles)


@triton.jit
def _expm1_nonpos(z):
    """``expm1(z)`` for ``z <= 0`` to full relative precision near 0.

    With ``u = exp(z)`` as rounded, ``(u - 1) * z / log(u)`` is accurate (Kahan): the rounding
    error of ``u`` cancels between numerator and denominator. ``u == 1`` gives ``z``, an
    underflowed ``u == 0`` gives -1.
    """
    u = tl.exp(z)
    d = u - 1.0
    ok = (d != 0.0) & (u > 0.0)
    q = z / tl.log(tl.where(ok, u, 0.5))
    return tl.where(ok, d * q, tl.where(u > 0.0, z, -1.0))


@triton.jit
def _log1p(r):
    """``log1p(r)`` for ``r > -1``: ``log(u) * r / (u - 1)`` with ``u = 1 + r`` (Goldberg).

    ``log(1 + r)`` alone loses all of ``r`` below the rounding of 1; the quotient restores it.
    """
    u = 1.0 + r
    d = u - 1.0
    return tl.where(d == 0.0, r, tl.log(u) * (r / tl.where(d == 0.0, 1.0, d)))


@triton.jit
def _activate(z, slope, ACTIVATION: tl.constexpr):
    """``act(z)`` for one of KERNEL_ACTIVATIONS, positive branch for ``z > 0`` exactly as torch
    (``slope`` is ELU's alpha)."""
    if ACTIVATION == "leaky_relu":
        y = tl.where(z > 0.0, z, z * slope)
    elif ACTIVATION == "elu":
        # NaN passes through, as in torch's elu.
        y = tl.where(z <= 0.0, slope * _expm1_nonpos(tl.minimum(z, 0.0)), z)
    else:
        # relu. NaN passes through, as in torch.relu.
        y = tl.where((z > 0.0) | (z != z), z, 0.0)
    return y


@triton.jit
def _xhat_dz(s, dy, mean, invstd, weight, bias, slope, ACTIVATION: tl.constexpr,
             SAVED_IS_OUTPUT: tl.constexpr):
    """``(xhat, dz)`` from the saved input ``x`` or output ``y``.

    from y:  leaky_relu  z = y if y > 0 else y / slope        dz = dy  or dy * slope
             elu         z = y if y > 0 else log1p(max(y / alpha, -1 + ulp))
                                                                dz = dy  or dy * (y + alpha)
             xhat = (z - bias) / weight
    from x:  xhat = (x - mean) * invstd,  z = xhat * weight + bias,  dz = dy * act'(z)
    """
    if SAVED_IS_OUTPUT:
        positive = s > 0.0
        if ACTIVATION == "leaky_relu":
            z = tl.where(positive, s, s / slope)
            dz = tl.where(positive, dy, dy * slope)
        else:
            # elu (relu has no inverse; the launchers refuse it)
            if s.dtype == tl.float64:
                floor = tl.full([], _ELU_FLOOR_FP64, s.dtype)
            else:
                floor = tl.full([], _ELU_FLOOR_FP32, s.dtype)
            ratio = tl.maximum(s / slope, floor)
            z = tl.where(positive, s, _log1p(ratio))
            dz = tl.where(positive, dy, dy * (s + slope))
        xhat = (z - bias) / weight
    else:
        xhat = (s - mean) * invstd
        z = xhat * weight + bias
        # Branch tests as ATen's CPU kernels, so that a NaN z takes the same branch (relu's
        # threshold_backward passes dy unless z <= 0).
        if ACTIVATION == "leaky_relu":
            dz = tl.where(z > 0.0, dy, dy * slope)
        elif ACTIVATION == "elu":
            # Not tl.minimum(z, 0): it turns a NaN into 0 (ATen's exp(NaN) gives NaN).
            dz = tl.where(z > 0.0, dy, dy * (slope * tl.exp(tl.where(z > 0.0, 0.0, z))))
        else:
            dz = tl.where(z <= 0.0, 0.0, dy)
    return xhat, dz



@triton.jit
def _load_norm_params(mean_ptr, invstd_ptr, weight_ptr, bias_ptr, c0, C,
                      CHANNELS_LAST: tl.constexpr, BLOCK_B: tl.constexpr):
    """``(mean, invstd, weight, bias)`` of this program's channels, as ``_load_channel``."""
    return (_load_channel(mean_ptr, c0, C, CHANNELS_LAST, BLOCK_B),
            _load_channel(invstd_ptr, c0, C, CHANNELS_LAST, BLOCK_B),
            _load_channel(weight_ptr, c0, C, CHANNELS_LAST, BLOCK_B),
            _load_channel(bias_ptr, c0, C, CHANNELS_LAST, BLOCK_B))


@triton.jit
def _tile_xhat_dz(saved_ptr, dy_ptr, offsets, mask, mean, invstd, weight, bias, alpha,
                  ACTIVATION: tl.constexpr, SAVED_IS_OUTPUT: tl.constexpr, ACC: tl.constexpr):
    """``(xhat, dz)`` of one tile: saved and dy read once, widened to ``ACC``."""
    s = tl.load(saved_ptr + offsets, mask=mask, other=0.0).to(ACC)
    dy = tl.load(dy_ptr + offsets, mask=mask, other=0.0).to(ACC)
    return _xhat_dz(s, dy, mean, invstd, weight, bias, alpha, ACTIVATION, SAVED_IS_OUTPUT)

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


# --------------------------------------------------------------------------------------------
# Launch planning shared by the ops
# --------------------------------------------------------------------------------------------


class Tile(NamedTuple):
    """Tile shape: [block_a images or rows, block_b positions or channels]."""

    block_a: int
    block_b: int


class Target(NamedTuple):
    """What block sizes and grids are planned for."""

    interpret: bool
    sm_count: int


class Launch(NamedTuple):
    """One kernel launch, fully planned (``check.py`` compiles these ahead of time)."""

    kernel: object
    grid: tuple[int, int]
    args: tuple
    constexprs: dict
    num_warps: int


class _Geometry(NamedTuple):
    channels_last: bool
    n: int
    c: int
    s: int


def _cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` in plain ints (``triton.cdiv`` is a jitted function: ~10 us a call)."""
    return -(-a // b)


def tile_choices(channels_last: bool, dtype: torch.dtype, interpret: bool = INTERPRET
                 ) -> tuple[Tile, ...]:
    """Every tile shape the launchers may pick (the AOT check compiles each)."""
    if interpret:
        elems = _INTERPRET_TILE_ELEMS
    else:
        elems = _GPU_TILE_ELEMS_FP64 if dtype == torch.float64 else _GPU_TILE_ELEMS
    if channels_last:
        return tuple(Tile(elems // w, w) for w in _CHANNELS_LAST_WIDTHS)
    return Tile(elems // _NCHW_WIDTH, _NCHW_WIDTH), Tile(1, elems)


def _offsets_fit(geo: _Geometry, tile: Tile) -> bool:
    """Whether every element a tile reads lies within int32 of the tile's start: ``_tile``
    keeps the in-tile offsets (rows times the row stride, C*S in NCHW) in 32 bits."""
    row_stride, rows = (geo.c, geo.n * geo.s) if geo.channels_last else (geo.c * geo.s, geo.n)
    return (min(tile.block_a, rows) - 1) * row_stride + tile.block_b - 1 <= _INT32_MAX


def _pick_tile(geo: _Geometry, dtype: torch.dtype, interpret: bool) -> Tile:
    """The tile with the least padding over the (rows, channels) or (images, positions) extent;
    ties go to the wider tile (longer contiguous runs, fewer channel blocks). Only tiles whose
    offsets fit in int32: NCHW's one-row tile always does."""
    extent_a, extent_b = (geo.n * geo.s, geo.c) if geo.channels_last else (geo.n, geo.s)

    def cost(t: Tile) -> tuple[int, int]:
        padded = _cdiv(extent_a, t.block_a) * t.block_a
        return padded * _cdiv(extent_b, t.block_b) * t.block_b, -t.block_b

    choices = [t for t in tile_choices(geo.channels_last, dtype, interpret)
               if _offsets_fit(geo, t)]
    if not choices:
        raise ValueError(
            f"{geo.c} channels are too many for the Triton kernels' 32-bit in-tile offsets "
            "in channels_last; use a contiguous (NCHW) input or the torch backend"
        )
    return min(choices, key=cost)


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _target(device: torch.device) -> Target:
    if INTERPRET or device.type != "cuda":
        return Target(INTERPRET, 0)
    return Target(False, _sm_count(device.index if device.index is not None else 0))


def _geometry(x: torch.Tensor) -> _Geometry | None:
    """How ``x`` lies in memory, or None when it is neither NCHW nor channels_last dense."""
    sizes, strides = tuple(x.shape), x.stride()
    try:
        return _layout(sizes, strides)
    except TypeError:  # symbolic sizes (fake tensors while tracing) cannot key the memo
        return _layout.__wrapped__(sizes, strides)


def _dense(sizes: tuple[int, ...], strides: tuple[int, ...]) -> bool:
    """``is_contiguous`` in ints: the strides of a C-contiguous tensor, size-1 axes free."""
    if 0 in sizes:
        return True
    expected = 1
    for size, stride in zip(reversed(sizes), reversed(strides)):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True


@functools.lru_cache(maxsize=1024)
def _layout(sizes: tuple[int, ...], strides: tuple[int, ...]) -> _Geometry | None:
    """``_geometry`` of a tensor with these sizes and strides (memoised: host ints only)."""
    n, c = sizes[0], sizes[1]
    s = math.prod(sizes[2:])
    contiguous = _dense(sizes, strides)
    if s == 1 and contiguous:
        # (N, C) and (N, C, 1, ...): channels are the innermost axis, read rows of C.
        return _Geometry(True, n, c, s)
    if contiguous:
        return _Geometry(False, n, c, s)
    last = (0, *range(2, len(sizes)), 1)
    if _dense(tuple(sizes[i] for i in last), tuple(strides[i] for i in last)):
        return _Geometry(True, n, c, s)
    return None


def _to_last(x: torch.Tensor) -> torch.Tensor:
    """(N, C, *) -> (N, *, C) view: channels_last of any rank is contiguous there."""
    return x.permute(0, *range(2, x.dim()), 1)


def _in_layout(t: torch.Tensor, channels_last: bool) -> torch.Tensor:
    """``t`` itself when it lies like the planned geometry, else one copy that does."""
    geo = _geometry(t)
    if geo is not None and (geo.channels_last == channels_last or geo.s == 1):
        return t
    if not channels_last:
        return t.contiguous()
    return _to_last(t).contiguous().permute(0, t.dim() - 1, *range(1, t.dim() - 1))


def _prepare(x: torch.Tensor) -> tuple[torch.Tensor, _Geometry]:
    if x.dtype not in DTYPES:
        raise TypeError(f"unsupported dtype {x.dtype}; expected one of {DTYPES}")
    if x.dim() < 2:
        raise ValueError(f"expected an (N, C, *) input, got shape {tuple(x.shape)}")
    geo = _geometry(x)
    if geo is None:
        x = x.contiguous()
        geo = _geometry(x)
    return x, geo


def _plan_tiles(geo: _Geometry, dtype: torch.dtype, target: Target, reduction: bool,
                tile: Tile | None) -> tuple[Tile, tuple[int, int], tuple[int, ...]]:
    """Tile, grid and the kernels' geometry arguments ``(N, C, S, R, CS, tiles, tiles_s, tpp)``.

    Reductions aim at a few programs per SM (split reduction when C is small), elementwise
    passes at enough programs to cover every SM many times over. Memoised by everything the
    plan depends on (the tile sizes too: tests change them).
    """
    sizes = (_INTERPRET_TILE_ELEMS, _GPU_TILE_ELEMS, _GPU_TILE_ELEMS_FP64)
    return _plan_tiles_memo(geo, dtype, target, reduction, tile, sizes)


@functools.lru_cache(maxsize=1024)
def _plan_tiles_memo(geo: _Geometry, dtype: torch.dtype, target: Target, reduction: bool,
                     tile: Tile | None, _tile_sizes: tuple[int, int, int]
                     ) -> tuple[Tile, tuple[int, int], tuple[int, ...]]:
    tile = tile or _pick_tile(geo, dtype, target.interpret)
    n, c, s = geo.n, geo.c, geo.s
    if geo.channels_last:
        channel_blocks = _cdiv(c, tile.block_b)
        tiles_s = 1
        tiles = _cdiv(n * s, tile.block_a)
    else:
        channel_blocks = c
        tiles_s = _cdiv(s, tile.block_b)
        tiles = _cdiv(n, tile.block_a) * tiles_s
    if target.interpret:
        programs = _INTERPRET_PROGRAMS
    else:
        per_sm = _REDUCE_PROGRAMS_PER_SM if reduction else _ELEMENTWISE_PROGRAMS_PER_SM
        programs = per_sm * target.sm_count
    splits = min(tiles, max(1, programs // channel_blocks))
    tiles_per_prog = max(_cdiv(tiles, splits), _cdiv(tiles, _MAX_SPLITS))
    splits = _cdiv(tiles, tiles_per_prog)
    args = (n, c, s, n * s, c * s, tiles, tiles_s, tiles_per_prog)
    return tile, (channel_blocks, splits), args


def _tile_constexprs(geo: _Geometry, tile: Tile, dtype: torch.dtype) -> dict:
    return {
        "CHANNELS_LAST": geo.channels_last,
        "BLOCK_A": tile.block_a,
        "BLOCK_B": tile.block_b,
        "ACC": _TL_DTYPES[stats_dtype(dtype)],
    }


def _merge_launch(kernel: object, partials: tuple[torch.Tensor, ...],
                  outputs: tuple[torch.Tensor, ...]) -> Launch:
    splits, c = partials[0].shape
    return Launch(kernel, (_cdiv(c, _MERGE_CHANNELS), 1), (*partials, *outputs, c, splits),
                  {"BLOCK_P": _MERGE_ROWS, "BLOCK_C": _MERGE_CHANNELS}, _NUM_WARPS)


# Triton's interpreter swaps the triton.language functions for its own while a kernel runs, so
# two threads (DataParallel replicas) interpreting at once break each other; a GPU needs no lock.
_INTERPRETER_LOCK = threading.Lock()


def _run(launches: list[Launch], device: torch.device) -> None:
    if device.type == "cuda":
        guard = torch.cuda.device(device)
    else:
        guard = _INTERPRETER_LOCK
    with guard:
        for launch in launches:
            launch.kernel[launch.grid](*launch.args, **launch.constexprs,
                                       num_warps=launch.num_warps, enable_fp_fusion=True)


def _kernel_activation(activation: str, slope: float, saved_is_output: bool = False
                       ) -> tuple[str, float]:
    """The kernel specialisation and slope that compute ``activation``."""
    if activation in ("none", "identity"):
        return "leaky_relu", 1.0
    if activation not in KERNEL_ACTIVATIONS:
        raise ValueError(f"unknown activation {activation!r}")
    if saved_is_output and activation == "relu":
        raise ValueError(f"activation {activation!r} cannot be inverted from its output")
    return activation, float(slope)


def _channel_vectors(acc: torch.dtype, *vectors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Per-channel inputs as contiguous vectors of the statistics dtype (no-ops normally, and
    then no ATen call)."""
    return tuple(v if v.dtype == acc and v.is_contiguous() else v.to(acc).contiguous()
                 for v in vectors)


def _empty_dx(saved: torch.Tensor) -> torch.Tensor:
    """dx lies like saved when saved is NCHW or channels_last, else contiguous."""
    if _geometry(saved) is None:
        return torch.empty(saved.shape, dtype=saved.dtype, device=saved.device)
    return torch.empty_like(saved)


# --------------------------------------------------------------------------------------------
# channel_stats: Welford per lane, Chan across lanes and programs
# --------------------------------------------------------------------------------------------


@triton.jit
def _channel_stats_kernel(x_ptr, mean_ptr, m2_ptr, count_ptr, N, C, S, R, CS, tiles, tiles_s,
                          tiles_per_prog, CHANNELS_LAST: tl.constexpr, BLOCK_A: tl.constexpr,
                          BLOCK_B: tl.constexpr, ACC: tl.constexpr):
    """Partial (mean, M2, n) of each channel over this program's tiles -> row pid_1.

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
    row = tl.program_id(1)
    if CHANNELS_LAST:
        mean_c, m2_c, cnt_c = _merge_lanes(mean, m2, cnt, 0)
        c = c0 + tl.arange(0, BLOCK_B)
        tl.store(mean_ptr + row * C + c, mean_c, mask=c < C)
        tl.store(m2_ptr + row * C + c, m2_c, mask=c < C)
        tl.store(count_ptr + row * C + c, cnt_c, mask=c < C)
    else:
        mean_c, m2_c, cnt_c = _merge_lanes(mean, m2, cnt, None)
        tl.store(mean_ptr + row * C + c0, mean_c)
        tl.store(m2_ptr + row * C + c0, m2_c)
        tl.store(count_ptr + row * C + c0, cnt_c)


@triton.jit
def _welford_merge_kernel(pmean_ptr, pm2_ptr, pcount_ptr, mean_ptr, m2_ptr, C, splits,
                          BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr):
    """Merge the [splits, C] partial (mean, M2, n) into (mean, M2) per channel (Chan).

    Infinite partial means: as in the stats kernel, a lane whose merged mean is NaN takes the
    mean of the plain sums ``sum(n_p * mean_p) / n``.
    """
    c = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)[None, :]
    p = tl.arange(0, BLOCK_P)[:, None]
    acc_ty = pmean_ptr.dtype.element_ty
    mean = tl.zeros([BLOCK_P, BLOCK_C], acc_ty)
    m2 = tl.zeros([BLOCK_P, BLOCK_C], acc_ty)
    cnt = tl.zeros([BLOCK_P, BLOCK_C], acc_ty)
    total = tl.zeros([BLOCK_P, BLOCK_C], acc_ty)
    for p0 in range(0, splits, BLOCK_P):
        mask = (p0 + p < splits) & (c < C)
        offs = (p0 + p) * C + c
        part_mean = tl.load(pmean_ptr + offs, mask=mask, other=0.0)
        part_cnt = tl.load(pcount_ptr + offs, mask=mask, other=0.0)
        total += tl.where(part_cnt > 0.0, part_mean * part_cnt, 0.0)
        mean, m2, cnt = _welford_combine(
            mean, m2, cnt, part_mean, tl.load(pm2_ptr + offs, mask=mask, other=0.0), part_cnt,
        )
    mean = tl.where(mean == mean, mean, total / tl.maximum(cnt, 1.0))
    mean_c, m2_c, _ = _merge_lanes(mean, m2, cnt, 0)
    c1 = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    tl.store(mean_ptr + c1, mean_c, mask=c1 < C)
    tl.store(m2_ptr + c1, m2_c, mask=c1 < C)


def _plan_channel_stats(x: torch.Tensor, target: Target, tile: Tile | None = None
                        ) -> tuple[list[Launch], tuple[torch.Tensor, torch.Tensor]]:
    x, geo = _prepare(x)
    acc = stats_dtype(x.dtype)
    tile, grid, geo_args = _plan_tiles(geo, x.dtype, target, True, tile)
    splits = grid[1]
    mean = torch.empty(geo.c, dtype=acc, device=x.device)
    m2 = torch.empty_like(mean)
    if splits == 1:
        partials = (mean, m2, torch.empty_like(mean))
    else:
        partials = tuple(torch.empty((splits, geo.c), dtype=acc, device=x.device)
                         for _ in range(3))
    launches = [Launch(_channel_stats_kernel, grid, (x, *partials, *geo_args),
                       _tile_constexprs(geo, tile, x.dtype), _num_warps(x.dtype))]
    if splits > 1:
        launches.append(_merge_launch(_welford_merge_kernel, partials, (mean, m2)))
    return launches, (mean, m2)


def _channel_stats_impl(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    c = x.shape[1]
    if x.numel() == 0:
        zeros = torch.zeros(c, dtype=stats_dtype(x.dtype), device=x.device)
        return zeros, zeros.clone()
    launches, result = _plan_channel_stats(x, _target(x.device))
    _run(launches, x.device)
    return result


# --------------------------------------------------------------------------------------------
# normalize_act: one read, one write (in place when out is x)
# --------------------------------------------------------------------------------------------


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
                        ) -> tuple[list[Launch], torch.Tensor]:
    """Plan into ``out`` when it lies like (the possibly copied) x, else into a temporary that
    the caller copies to ``out`` (returned as the tensor the kernel writes)."""
    activation, slope = _kernel_activation(activation, slope)
    x, geo = _prepare(x)
    same_layout = out.shape == x.shape and _geometry(out) == geo
    dst = out if same_layout else torch.empty_like(x, dtype=out.dtype)
    params = _channel_vectors(stats_dtype(x.dtype), mean, invstd, weight, bias)
    tile, grid, geo_args = _plan_tiles(geo, x.dtype, target, False, tile)
    constexprs = {"ACTIVATION": activation, **_tile_constexprs(geo, tile, x.dtype)}
    launch = Launch(_normalize_act_kernel, grid, (x, dst, *params, slope, *geo_args),
                    constexprs, _num_warps(x.dtype))
    return [launch], dst


def _normalize_act_impl(x: torch.Tensor, mean: torch.Tensor, invstd: torch.Tensor,
                        weight: torch.Tensor, bias: torch.Tensor, activation: str, slope: float,
                        out: torch.Tensor) -> None:
    if x.numel() == 0:
        _kernel_activation(activation, slope)
        return
    launches, dst = _plan_normalize_act(x, mean, invstd, weight, bias, activation, slope, out,
                                        _target(x.device))
    _run(launches, x.device)
    if dst is not out:
        out.copy_(dst)


# --------------------------------------------------------------------------------------------
# backward_reduce: sum(dz) and sum(dz * xhat), partials then a fixed-order sum
# --------------------------------------------------------------------------------------------


@triton.jit
def _backward_reduce_kernel(saved_ptr, dy_ptr, mean_ptr, invstd_ptr, weight_ptr, bias_ptr,
                            sum_dz_ptr, sum_dz_xhat_ptr, slope: tl.float64, N, C, S, R, CS, tiles,
                            tiles_s, tiles_per_prog, ACTIVATION: tl.constexpr,
                            SAVED_IS_OUTPUT: tl.constexpr, CHANNELS_LAST: tl.constexpr,
                            BLOCK_A: tl.constexpr, BLOCK_B: tl.constexpr, ACC: tl.constexpr):
    """Partial sum(dz) and sum(dz * xhat) per channel over this program's tiles -> row pid_1."""
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
    _store_channel_sum(sum_dz_xhat_ptr, acc_dz_xhat, row, c0, C, CHANNELS_LAST, BLOCK_B)


@triton.jit
def _sum_merge_kernel(pa_ptr, pb_ptr, a_ptr, b_ptr, C, splits, BLOCK_P: tl.constexpr,
                      BLOCK_C: tl.constexpr):
    """a[c] = sum_p pa[p, c] and b[c] = sum_p pb[p, c], always in the same order."""
    c = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)[None, :]
    p = tl.arange(0, BLOCK_P)[:, None]
    acc_ty = pa_ptr.dtype.element_ty
    acc_a = tl.zeros([BLOCK_P, BLOCK_C], acc_ty)
    acc_b = tl.zeros([BLOCK_P, BLOCK_C], acc_ty)
    for p0 in range(0, splits, BLOCK_P):
        mask = (p0 + p < splits) & (c < C)
        offs = (p0 + p) * C + c
        acc_a += tl.load(pa_ptr + offs, mask=mask, other=0.0)
        acc_b += tl.load(pb_ptr + offs, mask=mask, other=0.0)
    c1 = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    tl.store(a_ptr + c1, tl.sum(acc_a, 0), mask=c1 < C)
    tl.store(b_ptr + c1, tl.sum(acc_b, 0), mask=c1 < C)


def _plan_backward_reduce(saved: torch.Tensor, dy: torch.Tensor, mean: torch.Tensor,
                          invstd: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                          activation: str, slope: float, saved_is_output: bool, target: Target,
                          tile: Tile | None = None
                          ) -> tuple[list[Launch], tuple[torch.Tensor, torch.Tensor]]:
    activation, slope = _kernel_activation(activation, slope, saved_is_output)
    saved, geo = _prepare(saved)
    dy = _in_layout(dy, geo.channels_last)
    acc = stats_dtype(saved.dtype)
    params = _channel_vectors(acc, mean, invstd, weight, bias)
    tile, grid, geo_args = _plan_tiles(geo, saved.dtype, target, True, tile)
    splits = grid[1]
    sum_dz = torch.empty(geo.c, dtype=acc, device=saved.device)
    sum_dz_xhat = torch.empty_like(sum_dz)
    if splits == 1:
        partials = (sum_dz, sum_dz_xhat)
    else:
        partials = tuple(torch.empty((splits, geo.c), dtype=acc, device=saved.device)
                         for _ in range(2))
    constexprs = {"ACTIVATION": activation, "SAVED_IS_OUTPUT": bool(saved_is_output),
                  **_tile_constexprs(geo, tile, saved.dtype)}
    launches = [Launch(_backward_reduce_kernel, grid,
                       (saved, dy, *params, *partials, slope, *geo_args), constexprs,
                       _num_warps(saved.dtype))]
    if splits > 1:
        launches.append(_merge_launch(_sum_merge_kernel, partials, (sum_dz, sum_dz_xhat)))
    return launches, (sum_dz, sum_dz_xhat)


def _backward_reduce_impl(saved: torch.Tensor, dy: torch.Tensor, mean: torch.Tensor,
                          invstd: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                          activation: str, slope: float, saved_is_output: bool
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    if saved.numel() == 0:
        _kernel_activation(activation, slope, saved_is_output)
        zeros = torch.zeros(saved.shape[1], dtype=stats_dtype(saved.dtype), device=saved.device)
        return zeros, zeros.clone()
    launches, result = _plan_backward_reduce(saved, dy, mean, invstd, weight, bias, activation,
                                             slope, saved_is_output, _target(saved.device))
    _run(launches, saved.device)
    return result


# --------------------------------------------------------------------------------------------
# backward_dx: one read of saved and dy, one write of dx
# --------------------------------------------------------------------------------------------


@triton.jit
def _backward_dx_kernel(saved_ptr, dy_ptr, dx_ptr, mean_ptr, invstd_ptr, weight_ptr, bias_ptr,
                        coef_dz_ptr, coef_xhat_ptr, coef_const_ptr, slope: tl.float64, N, C, S, R,
                        CS, tiles, tiles_s, tiles_per_prog, ACTIVATION: tl.constexpr,
                        SAVED_IS_OUTPUT: tl.constexpr, CHANNELS_LAST: tl.constexpr,
                        BLOCK_A: tl.constexpr, BLOCK_B: tl.constexpr, ACC: tl.constexpr):
    """dx = (coef_dz * dz + coef_xhat * xhat) + coef_const, written in saved's dtype."""
    c0 = _channel_block(CHANNELS_LAST, BLOCK_B)
    mean, invstd, weight, bias = _load_norm_params(mean_ptr, invstd_ptr, weight_ptr, bias_ptr,
                                                   c0, C, CHANNELS_LAST, BLOCK_B)
    coef_dz = _load_channel(coef_dz_ptr, c0, C, CHANNELS_LAST, BLOCK_B)
    coef_xhat = _load_channel(coef_xhat_ptr, c0, C, CHANNELS_LAST, BLOCK_B)
    coef_const = _load_channel(coef_const_ptr, c0, C, CHANNELS_LAST, BLOCK_B)
    alpha = tl.full([], slope, ACC)
    start, stop = _tile_range(tiles, tiles_per_prog)
    for t in range(start, stop):
        base, local, mask = _tile(t, c0, N, C, S, R, CS, tiles_s, CHANNELS_LAST, BLOCK_A, BLOCK_B)
        xhat, dz = _tile_xhat_dz(saved_ptr, dy_ptr, base + local, mask, mean, invstd, weight,
                                 bias, alpha, ACTIVATION, SAVED_IS_OUTPUT, ACC)
        dx = (dz * coef_dz + xhat * coef_xhat) + coef_const
        tl.store(dx_ptr + base + local, dx.to(dx_ptr.dtype.element_ty), mask=mask)


def _plan_backward_dx(saved: torch.Tensor, dy: torch.Tensor, mean: torch.Tensor,
                      invstd: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                      activation: str, slope: float, saved_is_output: bool,
                      coef_dz: torch.Tensor, coef_xhat: torch.Tensor, coef_const: torch.Tensor,
                      target: Target, tile: Tile | None = None
                      ) -> tuple[list[Launch], torch.Tensor]:
    activation, slope = _kernel_activation(activation, slope, saved_is_output)
    dx = _empty_dx(saved)
    saved, geo = _prepare(saved)
    dy = _in_layout(dy, geo.channels_last)
    params = _channel_vectors(stats_dtype(saved.dtype), mean, invstd, weight, bias, coef_dz,
                              coef_xhat, coef_const)
    tile, grid, geo_args = _plan_tiles(geo, saved.dtype, target, False, tile)
    constexprs = {"ACTIVATION": activation, "SAVED_IS_OUTPUT": bool(saved_is_output),
                  **_tile_constexprs(geo, tile, saved.dtype)}
    launch = Launch(_backward_dx_kernel, grid,
                    (saved, dy, dx, *params, slope, *geo_args), constexprs,
                    _num_warps(saved.dtype))
    return [launch], dx


def _backward_dx_impl(saved: torch.Tensor, dy: torch.Tensor, mean: torch.Tensor,
                      invstd: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                      activation: str, slope: float, saved_is_output: bool,
                      coef_dz: torch.Tensor, coef_xhat: torch.Tensor, coef_const: torch.Tensor
                      ) -> torch.Tensor:
    if saved.numel() == 0:
        _kernel_activation(activation, slope, saved_is_output)
        return _empty_dx(saved)
    launches, dx = _plan_backward_dx(saved, dy, mean, invstd, weight, bias, activation, slope,
                                     saved_is_output, coef_dz, coef_xhat, coef_const,
                                     _target(saved.device))
    _run(launches, saved.device)
    return dx


# --------------------------------------------------------------------------------------------
# Every specialisation the launchers can produce (compiled ahead of time by check.py)
# --------------------------------------------------------------------------------------------


# (shape, memory format) of the planned launches above: a split reduction (C small) and one
# program per channel block (C large); a single odd image; one plane of over 2**31 elements;
# C*S over 2**31; 2-D rows; rows past 2**31 in channels_last.
_SPECIALISATION_SHAPES = (
    ((32, 16, 64, 64), torch.contiguous_format),
    ((4, 4096, 8, 8), torch.contiguous_format),
    ((1, 3, 7, 9), torch.contiguous_format),
    ((1, 2, 46341, 46341), torch.contiguous_format),
    ((4, 65537, 128, 128), torch.contiguous_format),
    ((32, 64, 32, 32), torch.channels_last),
    ((8, 7), torch.contiguous_format),
    ((2**17, 3, 128, 128), torch.channels_last),
)


def launch_specialisations(target: Target) -> Iterator[tuple[str, Launch]]:
    """Every kernel specialisation the launchers can produce for ``target``, as planned launches
    over meta tensors (never run): what ``check.py`` compiles ahead of time.

    Walks the same choices the launchers make: dtypes, both layouts, every tile of
    :func:`tile_choices` whose offsets fit, every activation and saved input/output, the merge
    kernels, and shapes that change how Triton types the integer arguments: sizes of 1
    (constants), odd sizes (no divisibility hint), 2-D inputs, and sizes past 2**31 (int64).
    """
    for dtype in DTYPES:
        acc = stats_dtype(dtype)
        for shape, fmt in _SPECIALISATION_SHAPES:
            x = torch.empty(shape, dtype=dtype, device="meta", memory_format=fmt)
            vec = torch.empty(shape[1], dtype=acc, device="meta")
            geo = _geometry(x)
            layout = "channels_last" if geo.channels_last else "nchw"
            for tile in tile_choices(geo.channels_last, dtype, target.interpret):
                if not _offsets_fit(geo, tile):
                    continue
                where = f"{dtype} {layout} {tuple(shape)} tile={tile.block_a}x{tile.block_b}"
                launches, _ = _plan_channel_stats(x, target, tile)
                for launch in launches:
                    yield where, launch
                for act in KERNEL_ACTIVATIONS:
                    launches, _ = _plan_normalize_act(x, vec, vec, vec, vec, act, 0.01, x,
                                                      target, tile)
                    yield f"{where} {act}", launches[0]
                for saved_is_output, act in BACKWARD_VARIANTS:
                    label = f"{where} {act} saved={'y' if saved_is_output else 'x'}"
                    common = (x, x, vec, vec, vec, vec, act, 0.01, saved_is_output)
                    launches, _ = _plan_backward_reduce(*common, target, tile)
                    for launch in launches:
                        yield label, launch
                    launches, _ = _plan_backward_dx(*common, vec, vec, vec, target, tile)
                    yield label, launches[0]


# --------------------------------------------------------------------------------------------
# torch.library registration: opaque to torch.compile, with fake (meta) implementations.
# --------------------------------------------------------------------------------------------

_channel_stats_op = torch.library.custom_op(
    "encoding_syncbn::channel_stats", mutates_args=())(_channel_stats_impl)

# Mutates ``out`` and returns nothing: torch derives its fake implementation.
_normalize_act_op = torch.library.custom_op(
    "encoding_syncbn::normalize_act_", mutates_args=("out",))(_normalize_act_impl)

_backward_reduce_op = torch.library.custom_op(
    "encoding_syncbn::backward_reduce", mutates_args=())(_backward_reduce_impl)

_backward_dx_op = torch.library.custom_op(
    "encoding_syncbn::backward_dx", mutates_args=())(_backward_dx_impl)


@_channel_stats_op.register_fake
def _(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    acc = stats_dtype(x.dtype)
    return x.new_empty(x.shape[1], dtype=acc), x.new_empty(x.shape[1], dtype=acc)


@_backward_reduce_op.register_fake
def _(saved: torch.Tensor, dy: torch.Tensor, mean: torch.Tensor, invstd: torch.Tensor,
      weight: torch.Tensor, bias: torch.Tensor, activation: str, slope: float,
      saved_is_output: bool) -> tuple[torch.Tensor, torch.Tensor]:
    acc = stats_dtype(saved.dtype)
    return saved.new_empty(saved.shape[1], dtype=acc), saved.new_empty(saved.shape[1], dtype=acc)


@_backward_dx_op.register_fake
def _(saved: torch.Tensor, dy: torch.Tensor, mean: torch.Tensor, invstd: torch.Tensor,
      weight: torch.Tensor, bias: torch.Tensor, activation: str, slope: float,
      saved_is_output: bool, coef_dz: torch.Tensor, coef_xhat: torch.Tensor,
      coef_const: torch.Tensor) -> torch.Tensor:
    return _empty_dx(saved)


# --------------------------------------------------------------------------------------------
# Public functions: torch_ops' signatures
# --------------------------------------------------------------------------------------------


def _through_dispatcher(x: torch.Tensor) -> bool:
    """Whether to call the registered op rather than its implementation directly.

    While compiling (the graph must hold the opaque op), for tensor subclasses (a FakeTensor
    gets the fake implementation) and under a dispatch mode (tracers must see the op). In
    plain eager calls the dispatcher would only add its overhead, some 10-20 us per call
    held under the GIL, which DataParallel's replica threads share.
    """
    return (
        torch.compiler.is_compiling()
        or type(x) is not torch.Tensor
        or _compat.current_dispatch_mode() is not None
    )



def channel_stats(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Per-channel ``(mean, M2, count)``, ``M2 = sum((x - mean)^2)``, by Welford/Chan.

    An empty batch gives zeros (it drops out of any Chan merge).
    """
    if _through_dispatcher(x):
        mean, m2 = torch.ops.encoding_syncbn.channel_stats(x)
    else:
        mean, m2 = _channel_stats_impl(x)
    channels = x.shape[1]
    return mean, m2, (x.numel() // channels if channels else 0)


def normalize_act(x: torch.Tensor, mean: torch.Tensor, invstd: torch.Tensor,
                  weight: torch.Tensor, bias: torch.Tensor, activation: str, slope: float,
                  out: torch.Tensor) -> torch.Tensor:
    """``out = act((x - mean) * (invstd * weight) + bias)``; ``out`` may be ``x`` itself."""
    normalize = (torch.ops.encoding_syncbn.normalize_act_ if _through_dispatcher(x)
                 else _normalize_act_impl)
    normalize(x, mean, invstd, weight, bias, activation, float(slope), out)
    return out


def backward_reduce(saved: torch.Tensor, dy: torch.Tensor, mean: torch.Tensor,
                    invstd: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                    activation: str, slope: float, saved_is_output: bool
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel ``(sum(dz), sum(dz * xhat))`` in the statistics dtype."""
    reduce = (torch.ops.encoding_syncbn.backward_reduce if _through_dispatcher(saved)
              else _backward_reduce_impl)
    sum_dz, sum_dz_xhat = reduce(saved, dy, mean, invstd, weight, bias, activation,
                                 float(slope), bool(saved_is_output))
    return sum_dz, sum_dz_xhat


def backward_dx(saved: torch.Tensor, dy: torch.Tensor, mean: torch.Tensor, invstd: torch.Tensor,
                weight: torch.Tensor, bias: torch.Tensor, activation: str, slope: float,
                saved_is_output: bool, coef_dz: torch.Tensor, coef_xhat: torch.Tensor,
                coef_const: torch.Tensor) -> torch.Tensor:
    """``dx = coef_dz * dz + coef_xhat * xhat + coef_const``, in ``saved``'s dtype."""
    input_grad = (torch.ops.encoding_syncbn.backward_dx if _through_dispatcher(saved)
                  else _backward_dx_impl)
    return input_grad(saved, dy, mean, invstd, weight, bias, activation, float(slope),
                      bool(saved_is_output), coef_dz, coef_xhat, coef_const)
