"""Split reductions: a channel block's programs each write a partial result, and the last of
them to finish merges the partials, in the same launch.

Each program stores its row of the ``[planes, splits, C]`` partial buffer, then increments its
channel block's counter (acquire-release, after a barrier: every thread's stores come before
it). The program that finds ``splits - 1`` there is the last: the acquire makes every other
program's row visible to it; it merges the rows in index order (the same bits whatever order
the programs finished in) and sets the counter back to 0 for the next launch. The counters
live in one int32 buffer per device and stream (:func:`split_counters`), zeroed once; launches
on one stream run one after another, so they never share a counter at the same time.
"""

from __future__ import annotations

import threading

import torch
import triton
import triton.language as tl

from ... import _compat


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


@triton.jit
def _last_to_finish(counter_ptr, block):
    """Whether this program is the last of its channel block's programs (grid axis 1) to
    finish; call it after storing the program's partial row. The barrier orders every
    thread's stores before the one thread's atomic, whose release publishes them and whose
    acquire (in the last program) makes the other programs' rows visible."""
    tl.debug_barrier()
    arrived = tl.atomic_add(counter_ptr + block, 1, sem="acq_rel", scope="gpu")
    return arrived == tl.num_programs(1) - 1


@triton.jit
def _rearm(counter_ptr, block):
    """Set a counter back to 0 for the next launch (which starts after this one ends)."""
    tl.store(counter_ptr + block, 0)


@triton.jit
def _merge_partials(part_ptr, plane, c, C, BLOCK_P: tl.constexpr):
    """(mean, M2) of the channels ``c`` (a [CB] block) from the [3, splits, C] partial
    (mean, M2, n) rows (planes ``plane`` elements apart), BLOCK_P rows a step, in index order.

    Infinite partial means: a lane whose merged mean is NaN takes the mean of the plain sums
    ``sum(n_p * mean_p) / n`` (as the statistics kernel's own lanes do).
    Read past the L1 cache (``.cg``): the rows were written by other programs.
    """
    splits = tl.num_programs(1)
    c2 = c[None, :]
    p = tl.arange(0, BLOCK_P)[:, None]
    acc_ty = part_ptr.dtype.element_ty
    mean = tl.zeros([BLOCK_P, c.shape[0]], acc_ty)
    m2 = tl.zeros([BLOCK_P, c.shape[0]], acc_ty)
    cnt = tl.zeros([BLOCK_P, c.shape[0]], acc_ty)
    total = tl.zeros([BLOCK_P, c.shape[0]], acc_ty)
    for p0 in range(0, splits, BLOCK_P):
        mask = (p0 + p < splits) & (c2 < C)
        offs = (p0 + p) * C + c2
        part_mean = tl.load(part_ptr + offs, mask=mask, other=0.0, cache_modifier=".cg")
        part_m2 = tl.load(part_ptr + plane + offs, mask=mask, other=0.0, cache_modifier=".cg")
        part_cnt = tl.load(part_ptr + 2 * plane + offs, mask=mask, other=0.0,
                           cache_modifier=".cg")
        total += tl.where(part_cnt > 0.0, part_mean * part_cnt, 0.0)
        mean, m2, cnt = _welford_combine(mean, m2, cnt, part_mean, part_m2, part_cnt)
    mean = tl.where(mean == mean, mean, total / tl.maximum(cnt, 1.0))
    mean_c, m2_c, _ = _merge_lanes(mean, m2, cnt, 0)
    return mean_c, m2_c


@triton.jit
def _sum_partials(part_ptr, plane, c, C, BLOCK_P: tl.constexpr):
    """Per channel of ``c`` (a [CB] block): the sums of planes 0 and 1 of the [2, splits, C]
    partials, BLOCK_P rows a step, always in the same order (read as ``_merge_partials``)."""
    splits = tl.num_programs(1)
    c2 = c[None, :]
    p = tl.arange(0, BLOCK_P)[:, None]
    acc_ty = part_ptr.dtype.element_ty
    acc_a = tl.zeros([BLOCK_P, c.shape[0]], acc_ty)
    acc_b = tl.zeros([BLOCK_P, c.shape[0]], acc_ty)
    for p0 in range(0, splits, BLOCK_P):
        mask = (p0 + p < splits) & (c2 < C)
        offs = (p0 + p) * C + c2
        acc_a += tl.load(part_ptr + offs, mask=mask, other=0.0, cache_modifier=".cg")
        acc_b += tl.load(part_ptr + plane + offs, mask=mask, other=0.0, cache_modifier=".cg")
    return tl.sum(acc_a, 0), tl.sum(acc_b, 0)


# --------------------------------------------------------------------------------------------
# The counters (host side)
# --------------------------------------------------------------------------------------------

# Counters per buffer at least: one per channel block of any launch planned so far fits.
_MIN_COUNTERS = 4096

_counters: dict[tuple[torch.device, int], torch.Tensor] = {}
# Buffers outgrown: kept, for a captured CUDA graph may still address them.
_outgrown: list[torch.Tensor] = []
_lock = threading.Lock()


def split_counters(device: torch.device, count: int) -> torch.Tensor:
    """At least ``count`` zeroed int32 counters for launches on ``device``'s current stream,
    reused from launch to launch (each launch leaves them at 0)."""
    stream = _compat.current_stream_handle(device.index) if device.type == "cuda" else 0
    buffer = _counters.get((device, stream))
    if buffer is None or buffer.numel() < count:
        with _lock:
            buffer = _counters.get((device, stream))
            if buffer is None or buffer.numel() < count:
                if buffer is not None:
                    _outgrown.append(buffer)
                buffer = torch.zeros(max(count, _MIN_COUNTERS), dtype=torch.int32,
                                     device=device)
                _counters[(device, stream)] = buffer
    return buffer


def reset_counters() -> None:
    """Zero every counter buffer: after a launch that did not finish (an interpreted kernel
    that raised), a counter may hold the arrivals of programs whose block never merged."""
    with _lock:
        for buffer in _counters.values():
            buffer.zero_()
