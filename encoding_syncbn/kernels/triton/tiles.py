"""Device functions shared by the kernels: where a tile lies, which channels a program owns,
per-channel loads and stores."""

import triton
import triton.language as tl

from .activations import _xhat_dz


@triton.jit
def _tile(t, c0, N, C, S, R, CS, tiles_s, CHANNELS_LAST: tl.constexpr, BLOCK_A: tl.constexpr,
          BLOCK_B: tl.constexpr):
    """``(base, local, mask)`` of tile ``t`` of the channel block starting at ``c0``
    (:func:`_tile_at` of its coordinates)."""
    tn, ts = _tile_coordinates(t, tiles_s, CHANNELS_LAST)
    return _tile_at(tn, ts, c0, N, C, S, R, CS, CHANNELS_LAST, BLOCK_A, BLOCK_B)


@triton.jit
def _tile_coordinates(t, tiles_s, CHANNELS_LAST: tl.constexpr):
    """``(tn, ts)``: tile ``t``'s row of images and run of positions (NCHW); channels_last:
    ``(t, 0)``, its block of rows."""
    if CHANNELS_LAST:
        tn, ts = t, 0
    else:
        tn = t // tiles_s
        ts = t - tn * tiles_s
    return tn, ts


@triton.jit
def _next_tile(tn, ts, tiles_s, CHANNELS_LAST: tl.constexpr):
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
def _tile_at(tn, ts, c0, N, C, S, R, CS, CHANNELS_LAST: tl.constexpr, BLOCK_A: tl.constexpr,
             BLOCK_B: tl.constexpr):
    """``(base, local, mask)`` of the tile at ``(tn, ts)`` (:func:`_tile_coordinates`) of the
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
        n0 = tl.cast(tn, tl.int64) * BLOCK_A
        # One plane may pass 2**31 elements: the position offset is int64 too.
        s0 = tl.cast(ts, tl.int64) * BLOCK_B
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
def _store_channel(ptr, v, c0, C, CHANNELS_LAST: tl.constexpr, BLOCK_B: tl.constexpr):
    """Store a per-channel vector shaped as ``_load_channel`` gives it."""
    if CHANNELS_LAST:
        c = c0 + tl.arange(0, BLOCK_B)[None, :]
        tl.store(ptr + c, v, mask=c < C)
    else:
        tl.store(ptr + c0, v)


@triton.jit
def _block_channels(c0, CHANNELS_LAST: tl.constexpr, BLOCK_B: tl.constexpr):
    """This program's channels as a vector: [BLOCK_B] in channels_last, [1] in NCHW (those past
    C are the caller's to mask)."""
    if CHANNELS_LAST:
        c = c0 + tl.arange(0, BLOCK_B)
    else:
        c = c0 + tl.arange(0, 1)
    return c


@triton.jit
def _channel_sums(acc, CHANNELS_LAST: tl.constexpr):
    """Per channel of the program, the sum of a tile of lane accumulators: a vector shaped as
    ``_block_channels``."""
    if CHANNELS_LAST:
        total = tl.sum(acc, 0)
    else:
        total = tl.zeros([1], acc.dtype) + tl.sum(acc)
    return total


@triton.jit
def _channel_vector(v, CHANNELS_LAST: tl.constexpr):
    """A per-channel value as ``_load_channel`` shapes it ([1, BLOCK_B] or a scalar), as a
    vector shaped as ``_block_channels``."""
    if CHANNELS_LAST:
        vector = tl.sum(v, 0)  # over its one row
    else:
        vector = tl.zeros([1], v.dtype) + v
    return vector


@triton.jit
def _tile_range(tiles, tiles_per_prog):
    """This program's contiguous range of tiles in its channel block."""
    start = tl.program_id(1) * tiles_per_prog
    return start, tl.minimum(start + tiles_per_prog, tiles)


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
