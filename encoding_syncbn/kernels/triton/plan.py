"""Launch planning shared by the ops: dtypes, tile sizes, geometry, memoised tiles and grids.

Host code only (plain ints, memoised by shape, strides, dtype and target); see the package
docstring for the geometry the kernels address.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import torch
import triton.language as tl

from ... import compat
from ...activations import ACTIVATIONS
from ..torch_ops import INPUT_DTYPES, stats_dtype
from .partials import partial_planes

#: Whether kernels run in Triton's CPU interpreter (fixed when ``triton.jit`` wrapped them).
INTERPRET: bool = compat.triton_interpreting()

#: Input dtypes the kernels are built for: the layer's.
DTYPES = INPUT_DTYPES

#: The ``ACTIVATION`` ids the kernels are specialised on (``Activation.kernel``; "none" and
#: "identity" share leaky_relu's), in the table's order.
KERNEL_ACTIVATIONS = tuple(dict.fromkeys(a.kernel for a in ACTIVATIONS.values()))
#: (saved_is_output, activation) pairs the backward kernels are built for: from the output
#: only for the ids of invertible activations.
BACKWARD_VARIANTS = tuple((False, a) for a in KERNEL_ACTIVATIONS) + tuple(
    (True, a) for a in dict.fromkeys(a.kernel for a in ACTIVATIONS.values() if a.inverse)
)

TL_DTYPES = {torch.float32: tl.float32, torch.float64: tl.float64}

# Elements per tile, 8 (fp64: 1) per thread. fp64's divisions, exp and log are register-hungry
# subroutines: with more than one element a thread, fp64 specialisations of the backward
# reduction and the statistics spill; with one, none does. (fp64 on a GPU is for checking, not
# speed.) The interpreter pays per program and per operation,
# not per element, so it gets bigger tiles (and fewer programs, below).
_GPU_TILE_ELEMS = 2048
_GPU_TILE_ELEMS_FP64 = 128
_INTERPRET_TILE_ELEMS = 8192
# Warps a program: 8 over an NCHW tile (long rows of one channel); 4 over a channels_last one
# (rows of 16 or 64 channels, each row a few loads a thread: 8 warps leave each thread too
# little to keep in flight, benchmarks/plan_sweep.py); 4 in float64 (twice the registers).
_NUM_WARPS = 8
_NUM_WARPS_CHANNELS_LAST = 4
_NUM_WARPS_FP64 = 4


def _num_warps(dtype: torch.dtype, *, channels_last: bool) -> int:
    if dtype == torch.float64:
        return _NUM_WARPS_FP64
    return _NUM_WARPS_CHANNELS_LAST if channels_last else _NUM_WARPS


# Tile widths. NCHW: rows of 64 positions, each row an image (many images) or a channel of one
# image (few images: the 1-8 a GPU gets in segmentation), or one long run of a single image.
# channels_last: rows of 16 channels (C <= 16) or 64.
_NCHW_WIDTH = 64
_CHANNELS_LAST_WIDTHS = (16, 64)
# Programs per launch to aim for, per SM on a GPU / in total in the interpreter.
_REDUCE_PROGRAMS_PER_SM = 4
_ELEMENTWISE_PROGRAMS_PER_SM = 16
_INTERPRET_PROGRAMS = 16
# CUDA limits grid axis 1 to 65535; splits beyond that take more tiles each instead.
_MAX_SPLITS = 65535
_INT32_MAX = 2**31 - 1
# Merging a split reduction's partials: [rows, channels of the block] a step, rows up to
# this many, and the lanes a tile has over ``_MERGE_STEP_SHARE``: half, as the partials are
# float64 (``partials``), so that a step's two planes take no more registers than the loop's
# lane accumulators (each step's rows are summed at once).
_MAX_MERGE_ROWS = 256
_MERGE_STEP_SHARE = 2
# Whether a block split more ways than a merge step takes is merged in two levels
# (``partials.merge_split``'s ``GROUPS``; float32 and half inputs: float64's statistics merge
# in one): its last program then waits on 1 + groups / BLOCK_P steps in a row, not splits /
# BLOCK_P (4, not 33, at 523 splits), each a round trip through L2: the channels-last
# reductions' time follows those steps (benchmarks/RESULTS.md). plan_sweep.py's "merge in one
# level" times it against one level.
_MERGE_IN_GROUPS = True
# Tiles a step of the statistics' loop loads before it sums any (``LOADS``), for half inputs:
# a lane's loads in flight at once. A half tile is 4 KB a program, 16 KB an SM at the
# programs planned, too little to keep HBM busy; with three, 48 KB. At the shapes that fill a
# GPU the registers still hold the programs planned; where they hold fewer (int64 offsets past
# 2^31 elements), those still keep more in flight than one tile a step did. Four would leave
# a stack frame in some sm_90 specialisations (``tools/check_kernels.py``). float32's tile is
# twice the bytes and its 8-warp programs would hold one SM program fewer: one; float64's (a
# lane's one value) one. The tiles are summed in order: the statistics do not depend on it.
_STATS_LOADS = 3

class Tile(NamedTuple):
    """Tile shape: [block_a images, channels or rows, block_b positions or channels]
    (``tiles.py``); ``channel_rows``: NCHW, the rows are channels of one image."""

    block_a: int
    block_b: int
    channel_rows: bool = False


class Target(NamedTuple):
    """What block sizes and grids are planned for."""

    interpret: bool
    sm_count: int


# What every launch compiles with: fused multiply-adds, and an explicit register ceiling, the
# hardware's 255: without one, ptxas may choose a register target of its own below what a
# kernel needs and spill (``tools/check_kernels.py`` compiles with these options too).
COMPILE_OPTIONS = {"enable_fp_fusion": True, "maxnreg": 255}


# An SM of sm_80 and sm_90: 65,536 registers, allocated to a warp in units of 256 (8 a
# thread), and at most 64 warps resident (the few KB of shared memory a kernel here takes
# never limit it).
_SM_REGISTERS = 65536
_REGISTER_UNIT = 256
_SM_WARPS = 64


def programs_per_sm(registers: int, num_warps: int) -> int:
    """Programs of ``num_warps`` warps, ``registers`` a thread, that one SM holds at once
    (``tools/check_kernels.py`` reports it per specialisation; reductions are planned at
    ``_REDUCE_PROGRAMS_PER_SM``)."""
    per_warp = -(-registers * 32 // _REGISTER_UNIT) * _REGISTER_UNIT
    return min(_SM_REGISTERS // (per_warp * num_warps), _SM_WARPS // num_warps)


class Launch(NamedTuple):
    """One kernel launch, fully planned (``check.py`` compiles these ahead of time).

    ``token``: the memoised plan the launch was made from, where its planner vouches that the
    token and the kernel fix everything Triton specialises the launch on but its tensors'
    dtypes and addresses: the constexprs, the warps, which arguments are tensors and every
    other argument's type (each integer's value). ``launch.py`` then keys the launch's
    compiled kernel by the token (one lookup); None: by every argument. ``fixed``: the
    positions of the tensor arguments the key need not read: the planner's own allocations
    of this call, in the dtypes its plan gives them, each a fresh block (which every
    allocator aligns past 16 bytes), and the repeats of an argument the key reads.
    ``follows``: the launch comes right after another launch of its op, whose key its own
    then takes in (``launch.launch_all``): ``fixed`` may also name that launch's keyed
    tensors (a second pass over the same tensors reads none of them again)."""

    kernel: object
    grid: tuple[int, int]
    args: tuple
    constexprs: dict
    num_warps: int
    token: object = None
    fixed: tuple[int, ...] = ()
    follows: bool = False


class _Geometry(NamedTuple):
    channels_last: bool
    n: int
    c: int
    s: int


def _cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` in plain ints (``triton.cdiv`` is a jitted function: slow to call)."""
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
    rows = elems // _NCHW_WIDTH
    return Tile(rows, _NCHW_WIDTH), Tile(1, elems), Tile(rows, _NCHW_WIDTH, True)


def _offsets_fit(geo: _Geometry, tile: Tile) -> bool:
    """Whether every element a tile reads lies within int32 of the tile's start: ``nth_tile``
    keeps the in-tile offsets (rows times the row stride: C, C*S or S) in 32 bits."""
    if geo.channels_last:
        row_stride, rows = geo.c, geo.n * geo.s
    elif tile.channel_rows:
        row_stride, rows = geo.s, geo.c
    else:
        row_stride, rows = geo.c * geo.s, geo.n
    return (min(tile.block_a, rows) - 1) * row_stride + tile.block_b - 1 <= _INT32_MAX


def _pick_tile(geo: _Geometry, dtype: torch.dtype, interpret: bool) -> Tile:
    """The tile with the least padding: the fewest elements its tiles cover in all; ties go to
    the wider tile (longer contiguous runs, fewer channel blocks), then to rows of images.
    Only tiles whose offsets fit in int32: NCHW's one-row tile always does."""

    def cost(t: Tile) -> tuple[int, int, bool]:
        if geo.channels_last:
            sizes = ((geo.n * geo.s, t.block_a), (geo.c, t.block_b))
        elif t.channel_rows:
            sizes = ((geo.n, 1), (geo.c, t.block_a), (geo.s, t.block_b))
        else:
            sizes = ((geo.n, t.block_a), (geo.c, 1), (geo.s, t.block_b))
        return math.prod(_cdiv(size, block) * block for size, block in sizes), -t.block_b, \
            t.channel_rows

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


@functools.lru_cache(maxsize=64)
def launch_target(device: torch.device) -> Target:
    """What launches on ``device`` are planned for (memoised: every op asks on every call)."""
    if INTERPRET or device.type != "cuda":
        return Target(INTERPRET, 0)
    return Target(False, _sm_count(device.index if device.index is not None else 0))


def geometry_of(x: torch.Tensor) -> _Geometry | None:
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
    """``geometry_of`` of a tensor with these sizes and strides (memoised: host ints only)."""
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


def in_layout(t: torch.Tensor, strides: tuple[int, ...], channels_last: bool) -> torch.Tensor:
    """``t`` itself when it lies like the planned geometry (``strides``: those of the tensor of
    t's shape the plan launches on, NCHW or ``channels_last`` dense), else one copy that does."""
    if t.stride() == strides:  # the usual case, without a geometry lookup
        return t
    geo = geometry_of(t)
    if geo is not None and (geo.channels_last == channels_last or geo.s == 1):
        return t
    if not channels_last:
        return t.contiguous()
    return _to_last(t).contiguous().permute(0, t.dim() - 1, *range(1, t.dim() - 1))


def _program_channels(geo: _Geometry, tile: Tile) -> int:
    """Channels a program owns (``tiles.channel_block``): BLOCK_B in channels_last, BLOCK_A
    with rows of channels, else one."""
    if geo.channels_last:
        return tile.block_b
    return tile.block_a if tile.channel_rows else 1


def _plan_tiles(geo: _Geometry, dtype: torch.dtype, target: Target, reduction: bool,
                tile: Tile | None) -> tuple[Tile, tuple[int, int], tuple[int, ...]]:
    """Tile, grid and the kernels' geometry arguments ``(N, C, S, R, CS, tiles, tiles_s, tpp)``.

    Reductions aim at a few programs per SM (split reduction when C is small), elementwise
    passes at enough programs to cover every SM many times over.
    """
    tile = tile or _pick_tile(geo, dtype, target.interpret)
    n, c, s = geo.n, geo.c, geo.s
    channel_blocks = _cdiv(c, _program_channels(geo, tile))
    if geo.channels_last:
        tiles_s = 1
        tiles = _cdiv(n * s, tile.block_a)
    elif tile.channel_rows:
        tiles_s = _cdiv(s, tile.block_b)
        tiles = n * tiles_s
    else:
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


# The widest vector load or store a thread issues: 16 bytes.
_VECTOR_BYTES = 16


def row_align(geo: _Geometry, dtype: torch.dtype) -> int:
    """``ALIGN``: the largest power of two, up to a 16-byte vector of ``dtype``, that divides
    the length of a tensor row (S positions in NCHW, C channels in channels_last). Triton only
    tells its kernels that a size is a multiple of 16; a 14x14 map (196 positions) is a
    multiple of 4, so float32 rows of it start on 16 bytes and load as vectors once the
    kernel knows (``tiles.aligned_rows``)."""
    length = geo.c if geo.channels_last else geo.s
    return min(length & -length, _VECTOR_BYTES // dtype.itemsize)


def _tile_constexprs(geo: _Geometry, tile: Tile, dtype: torch.dtype) -> dict:
    return {
        "CHANNELS_LAST": geo.channels_last,
        "CHANNEL_ROWS": tile.channel_rows,
        "BLOCK_A": tile.block_a,
        "BLOCK_B": tile.block_b,
        "ALIGN": row_align(geo, dtype),
        "ACC": TL_DTYPES[stats_dtype(dtype)],
    }


def _split_constexprs(geo: _Geometry, tile: Tile, splits: int, acc: torch.dtype) -> dict:
    """A reduction's: whether its channel blocks are split over programs (``SPLIT``: the last
    to finish merges the partials, ``partials``), the partial rows merged a step, and whether
    in two levels (``GROUPS``)."""
    rows = min(_MAX_MERGE_ROWS, max(1, tile.block_a * tile.block_b
                                    // (_MERGE_STEP_SHARE * _program_channels(geo, tile))))
    return {"SPLIT": splits > 1, "BLOCK_P": rows,
            "GROUPS": _MERGE_IN_GROUPS and splits > rows and acc != torch.float64}


class OpPlan(NamedTuple):
    """Everything about one op's main launch but its tensors (memoised by :func:`plan_op`)."""

    copy: bool  # the input is neither NCHW nor channels_last dense: launch on a contiguous copy
    geo: _Geometry
    acc: torch.dtype  # the statistics dtype
    grid: tuple[int, int]
    # A split reduction's partial sums: their elements in the stream's float64 buffer
    # (``partials.split_buffers``); 0: not a split reduction.
    part: int
    # The counters a reduction's launch uses in the stream's buffer: one a channel, the
    # cumulative average's, and a merge in groups' (``partials.group_counters``).
    counters: int
    args: tuple[int, ...]  # the kernels' geometry arguments, as _plan_tiles
    constexprs: dict
    num_warps: int
    activation_param: float  # the kernel's (1.0 for the identity, which runs as leaky_relu)
    token: object  # this plan's own (``Launch.token``), hashed by identity


def plan_op(x: torch.Tensor, target: Target, *, reduction: bool, tile: Tile | None = None,
            activation: str | None = None, activation_param: float = 0.0,
            saved_is_output: bool | None = None) -> OpPlan | None:
    """The launch plan of an op on ``x``: input checks, geometry, tile, grid, constexprs; None
    for an empty ``x`` (nothing to launch: the callers need not ask ``numel()`` first).

    One dictionary lookup per call once an input geometry was seen: memoised by sizes, strides,
    dtype, target and the op's choices. ``activation`` None plans the statistics (no
    activation constexpr), ``saved_is_output`` None a forward.
    """
    # Positional: keywords would cost the memo's lookup a dictionary of them at every call.
    return plan_op_memo(x.shape, x.stride(), x.dtype, target, reduction, tile, activation,
                        activation_param, saved_is_output)


def check_dtype(dtype: torch.dtype) -> None:
    """A dtype the kernels are built for, or a TypeError."""
    if dtype not in DTYPES:
        raise TypeError(f"unsupported dtype {dtype}; expected one of {DTYPES}")


#: The planners' memo of host ints, by sizes, strides, dtype, target and the op's choices: the
#: planning constants of this module are fixed for a process, so an answer holds for its life
#: (a test or a sweep that changes a constant clears the memos with ``cache_clear``). The
#: planners run on real tensors' sizes only: traced calls (fake tensors, symbolic sizes) take
#: the registered ops' fake implementations.
plan_memo = functools.lru_cache(maxsize=1024)


@plan_memo
def plan_op_memo(sizes: tuple[int, ...], strides: tuple[int, ...], dtype: torch.dtype,
                 target: Target, reduction: bool, tile: Tile | None, activation: str | None,
                 activation_param: float, saved_is_output: bool | None) -> OpPlan | None:
    check_dtype(dtype)  # an error is not memoised: asked again at every such call
    if len(sizes) < 2:
        raise ValueError(f"expected an (N, C, *) input, got shape {sizes}")
    constexprs = {}
    if activation is not None:
        activation, activation_param = _kernel_activation(
            activation, activation_param, saved_is_output=bool(saved_is_output))
        constexprs["ACTIVATION"] = activation
        if saved_is_output is not None:
            constexprs["SAVED_IS_OUTPUT"] = bool(saved_is_output)
    if 0 in sizes:  # empty (the choices checked all the same): nothing to launch
        return None
    layout = _layout.__wrapped__  # this memo covers it: no second cache of the same answer
    geo = layout(sizes, strides)
    copy = geo is None
    if copy:
        geo = layout(sizes, _contiguous_strides(sizes))
    tile, grid, args = _plan_tiles(geo, dtype, target, reduction, tile)
    constexprs.update(_tile_constexprs(geo, tile, dtype))
    acc, part, counters = stats_dtype(dtype), 0, geo.c + 1
    if reduction:
        constexprs.update(_split_constexprs(geo, tile, grid[1], acc))
        if activation is None:  # the statistics
            constexprs["LOADS"] = _STATS_LOADS if dtype.itemsize == 2 else 1
        rows = grid[1]
        if constexprs["GROUPS"]:
            groups = _cdiv(grid[1], constexprs["BLOCK_P"])
            rows += groups
            counters += grid[0] * groups
        if grid[1] > 1:
            part = partial_planes(acc) * rows * geo.c
    return OpPlan(copy, geo, acc, grid, part, counters, args, constexprs,
                  _num_warps(dtype, channels_last=geo.channels_last), float(activation_param),
                  object())


def _contiguous_strides(sizes: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(sizes):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def prepared_input(x: torch.Tensor, plan: OpPlan) -> torch.Tensor:
    """``x`` as the plan launches on it (a contiguous copy where ``plan.copy``)."""
    return x.contiguous() if plan.copy else x


def _kernel_activation(activation: str, activation_param: float, *,
                       saved_is_output: bool = False) -> tuple[str, float]:
    """The kernel specialisation and parameter that compute ``activation``."""
    definition = ACTIVATIONS.get(activation)
    if definition is None:
        raise ValueError(f"unknown activation {activation!r}")
    if saved_is_output and definition.inverse is None:
        raise ValueError(f"activation {activation!r} cannot be inverted from its output")
    if definition.kernel_param is not None:
        activation_param = definition.kernel_param
    return definition.kernel, float(activation_param)


def empty_dx(saved: torch.Tensor, dense: bool) -> torch.Tensor:
    """dx lies like saved when saved is ``dense`` (NCHW or channels_last), else contiguous."""
    if not dense:
        return torch.empty(saved.shape, dtype=saved.dtype, device=saved.device)
    return torch.empty_like(saved)
