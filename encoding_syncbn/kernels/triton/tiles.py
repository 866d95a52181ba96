"""Device functions shared by the kernels: where a tile lies, which channels a program owns,
per-channel loads and stores.

A tile is [BLOCK_A, BLOCK_B] elements, laid over the tensor one of three ways (constexprs
``CHANNELS_LAST`` and ``CHANNEL_ROWS``):

- NCHW, rows of images: rows are BLOCK_A images, columns a run of BLOCK_B positions, all of
  the program's one channel (large maps, or many images);
- NCHW, ``CHANNEL_ROWS``: rows are the program's BLOCK_A channels, columns a run of BLOCK_B
  positions, all of one image (small maps, few images: 2 images of a 7x7 map would fill 2 of
  32 rows of images, but every row of channels);
- channels_last: rows are BLOCK_A positions (over all images), columns the program's BLOCK_B
  channels.

Per-channel values are shaped to broadcast over a tile: a scalar (one channel), [BLOCK_A, 1]
(channel rows) or [1, BLOCK_B] (channels_last).
"""

import triton
import triton.language as tl

from . import double_double as dd
from .activations import xhat_dz


@triton.jit
def aligned_rows(C, S, CS, CHANNELS_LAST: tl.constexpr, ALIGN: tl.constexpr):
    """``(C, S, CS)``, the row length (S and CS = C * S in NCHW, C in channels_last) written
    as a multiple of ``ALIGN`` (``plan.row_align``), which the compiler reads: every row then
    starts ALIGN-aligned and every mask changes ALIGN elements at a time, so tiles load and
    store as vectors. The value is the same when ALIGN divides it, as the planner found; a
    wrong ALIGN would change it, and the interpreted tests with it."""
    if ALIGN > 1:
        if CHANNELS_LAST:
            C = C // ALIGN * ALIGN
        else:
            S = S // ALIGN * ALIGN
            CS = CS // ALIGN * ALIGN
    return C, S, CS


@triton.jit
def nth_tile(t, c0, N, C, S, R, CS, tiles_s, CHANNELS_LAST: tl.constexpr,
             CHANNEL_ROWS: tl.constexpr, BLOCK_A: tl.constexpr, BLOCK_B: tl.constexpr):
    """``(base, local, mask)`` of tile ``t`` of the channel block starting at ``c0``
    (:func:`tile_at` of its coordinates)."""
    tn, ts = tile_coordinates(t, tiles_s, CHANNELS_LAST)
    return tile_at(tn, ts, c0, N, C, S, R, CS, CHANNELS_LAST, CHANNEL_ROWS, BLOCK_A, BLOCK_B)


@triton.jit
def tile_coordinates(t, tiles_s, CHANNELS_LAST: tl.constexpr):
    """``(tn, ts)``: tile ``t``'s row of images (or image, ``CHANNEL_ROWS``) and run of
    positions (NCHW); channels_last: ``(t, 0)``, its block of rows."""
    if CHANNELS_LAST:
        tn, ts = t, 0
    else:
        tn = t // tiles_s
        ts = t - tn * tiles_s
    return tn, ts


@triton.jit
def next_tile(tn, ts, tiles_s, CHANNELS_LAST: tl.constexpr):
    """The coordinates of the tile after ``(tn, ts)``, without a division."""
    if CHANNELS_LAST:
        tn += 1
    else:
        ts += 1
        wrap = ts == tiles_s
        tn = tl.where(wrap, tn + 1, tn)
        ts = tl.where(wrap, 0, ts)
    return tn, ts


@triton.jit
def tile_at(tn, ts, c0, N, C, S, R, CS, CHANNELS_LAST: tl.constexpr,
            CHANNEL_ROWS: tl.constexpr, BLOCK_A: tl.constexpr, BLOCK_B: tl.constexpr):
    """``(base, local, mask)`` of the tile at ``(tn, ts)`` (:func:`tile_coordinates`) of the
    channel block starting at ``c0``.

    ``base`` is a scalar int64 element offset, ``local`` the int32 offsets inside the tile:
    per-element address arithmetic stays 32-bit while tensors may exceed 2**31 elements
    (``_pick_tile`` only picks tiles whose offsets fit).
    """
    a = tl.arange(0, BLOCK_A)[:, None]
    b = tl.arange(0, BLOCK_B)[None, :]
    if CHANNELS_LAST:
        r0 = tl.cast(tn, tl.int64) * BLOCK_A
        base = r0 * C + c0
        local = a * C + b
        mask = (a < R - r0) & (b < C - c0)
    else:
        # One plane may pass 2**31 elements: the position offset is int64 too.
        s0 = tl.cast(ts, tl.int64) * BLOCK_B
        if CHANNEL_ROWS:  # rows: channels c0... of image tn
            n0 = tl.cast(tn, tl.int64)
            local = a * S + b
            rows_left = C - c0
        else:  # rows: images n0... of channel c0
            n0 = tl.cast(tn, tl.int64) * BLOCK_A
            local = a * CS + b
            rows_left = N - n0
        base = n0 * CS + tl.cast(c0, tl.int64) * S + s0
        mask = (a < rows_left) & (b < S - s0)
    return base, local, mask


@triton.jit
def channel_block(CHANNELS_LAST: tl.constexpr, CHANNEL_ROWS: tl.constexpr,
                  BLOCK_A: tl.constexpr, BLOCK_B: tl.constexpr):
    """First channel of this program: it owns BLOCK_B channels (channels_last), BLOCK_A
    (``CHANNEL_ROWS``) or one."""
    if CHANNELS_LAST:
        c0 = tl.program_id(0) * BLOCK_B
    elif CHANNEL_ROWS:
        c0 = tl.program_id(0) * BLOCK_A
    else:
        c0 = tl.program_id(0)
    return c0


@triton.jit
def load_channel(ptr, c0, C, CHANNELS_LAST: tl.constexpr, CHANNEL_ROWS: tl.constexpr,
                 BLOCK_A: tl.constexpr, BLOCK_B: tl.constexpr):
    """A per-channel vector, shaped to broadcast over a tile: [1, BLOCK_B], [BLOCK_A, 1] or a
    scalar (channels past C load 1)."""
    if CHANNELS_LAST:
        c = c0 + tl.arange(0, BLOCK_B)[None, :]
        v = tl.load(ptr + c, mask=c < C, other=1.0)
    elif CHANNEL_ROWS:
        c = c0 + tl.arange(0, BLOCK_A)[:, None]
        v = tl.load(ptr + c, mask=c < C, other=1.0)
    else:
        v = tl.load(ptr + c0)
    return v


@triton.jit
def store_channel(ptr, v, c0, C, CHANNELS_LAST: tl.constexpr, CHANNEL_ROWS: tl.constexpr,
                  BLOCK_A: tl.constexpr, BLOCK_B: tl.constexpr):
    """Store a per-channel vector shaped as ``load_channel`` gives it."""
    if CHANNELS_LAST:
        c = c0 + tl.arange(0, BLOCK_B)[None, :]
        tl.store(ptr + c, v, mask=c < C)
    elif CHANNEL_ROWS:
        c = c0 + tl.arange(0, BLOCK_A)[:, None]
        tl.store(ptr + c, v, mask=c < C)
    else:
        tl.store(ptr + c0, v)


@triton.jit
def block_channels(c0, CHANNELS_LAST: tl.constexpr, CHANNEL_ROWS: tl.constexpr,
                   BLOCK_A: tl.constexpr, BLOCK_B: tl.constexpr):
    """This program's channels as a vector: [BLOCK_B] in channels_last, [BLOCK_A] with
    ``CHANNEL_ROWS``, else [1] (those past C are the caller's to mask)."""
    if CHANNELS_LAST:
        c = c0 + tl.arange(0, BLOCK_B)
    elif CHANNEL_ROWS:
        c = c0 + tl.arange(0, BLOCK_A)
    else:
        c = c0 + tl.arange(0, 1)
    return c


@triton.jit
def channel_sums(acc, CHANNELS_LAST: tl.constexpr, CHANNEL_ROWS: tl.constexpr):
    """Per channel of the program, the sum of a tile of lane accumulators: a vector shaped as
    ``block_channels``."""
    if CHANNELS_LAST:
        total = tl.sum(acc, 0)
    elif CHANNEL_ROWS:
        total = tl.sum(acc, 1)
    else:
        total = tl.zeros([1], acc.dtype) + tl.sum(acc)
    return total


@triton.jit
def channel_sums_double(hi, lo, CHANNELS_LAST: tl.constexpr, CHANNEL_ROWS: tl.constexpr):
    """:func:`channel_sums` of double-double lane accumulators ``(hi, lo)``, added in
    double-double."""
    if CHANNELS_LAST:
        total, total_lo = dd.sum_along(hi, lo, 0)
    elif CHANNEL_ROWS:
        total, total_lo = dd.sum_along(hi, lo, 1)
    else:  # rows, then the column of row sums
        total, total_lo = dd.sum_along(hi, lo, 1)
        total, total_lo = dd.sum_along(total[:, None], total_lo[:, None], 0)
    return total, total_lo


@triton.jit
def as_block_vector(v, CHANNELS_LAST: tl.constexpr, CHANNEL_ROWS: tl.constexpr):
    """A per-channel value as ``load_channel`` shapes it, as a vector shaped as
    ``block_channels``."""
    if CHANNELS_LAST:
        vector = tl.sum(v, 0)  # over its one row
    elif CHANNEL_ROWS:
        vector = tl.sum(v, 1)  # over its one column
    else:
        vector = tl.zeros([1], v.dtype) + v
    return vector


@triton.jit
def tile_range(tiles, tiles_per_prog):
    """This program's contiguous range of tiles in its channel block."""
    start = tl.program_id(1) * tiles_per_prog
    return start, tl.minimum(start + tiles_per_prog, tiles)


@triton.jit
def load_norm_params(mean_ptr, invstd_ptr, weight_ptr, bias_ptr, c0, C,
                     CHANNELS_LAST: tl.constexpr, CHANNEL_ROWS: tl.constexpr,
                     BLOCK_A: tl.constexpr, BLOCK_B: tl.constexpr):
    """``(mean, invstd, weight, bias)`` of this program's channels, as ``load_channel``."""
    return (load_channel(mean_ptr, c0, C, CHANNELS_LAST, CHANNEL_ROWS, BLOCK_A, BLOCK_B),
            load_channel(invstd_ptr, c0, C, CHANNELS_LAST, CHANNEL_ROWS, BLOCK_A, BLOCK_B),
            load_channel(weight_ptr, c0, C, CHANNELS_LAST, CHANNEL_ROWS, BLOCK_A, BLOCK_B),
            load_channel(bias_ptr, c0, C, CHANNELS_LAST, CHANNEL_ROWS, BLOCK_A, BLOCK_B))


@triton.jit
def tile_xhat_dz(saved_ptr, dy_ptr, offsets, mask, mean, invstd, weight, bias, param,
                 ACTIVATION: tl.constexpr, SAVED_IS_OUTPUT: tl.constexpr, ACC: tl.constexpr):
    """``(xhat, dz)`` of one tile: saved and dy read once, widened to ``ACC``."""
    s = tl.load(saved_ptr + offsets, mask=mask, other=0.0).to(ACC)
    dy = tl.load(dy_ptr + offsets, mask=mask, other=0.0).to(ACC)
    return xhat_dz(s, dy, mean, invstd, weight, bias, param, ACTIVATION, SAVED_IS_OUTPUT)
