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
def _sum_partials(part_ptr, plane, c, C, BLOCK_P: tl.constexpr):
    """Per channel of ``c`` (a [CB] block): the sums of planes 0 and 1 of the [2, splits, C]
    partials, BLOCK_P rows a step, always in the same order. Read past the L1 cache (``.cg``):
    the rows were written by other programs."""
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
