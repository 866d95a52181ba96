"""Split reductions: a channel block's programs each write a partial result, and the last of
them to finish merges the partials, in the same launch.

Each program stores its row of the ``[planes, splits, C]`` float64 partial buffer, then
increments its channel block's counter (acquire-release, after a barrier: every thread's stores
come before it). The program that finds ``splits - 1`` there is
the last: the acquire makes every other program's row visible to it; it merges the rows in
index order (the same bits whatever order the programs finished in) and sets the counter back
to 0 for the next launch (or, in two levels, the last of each group of rows merges the
group's, and the last group the groups': :func:`merge_split`). The counters live in one int32
buffer per device and stream (:func:`split_counters`), zeroed once; launches on one stream run
one after another, so they never share a counter at the same time, nor a partials' buffer
(:func:`split_buffers`).
"""

from __future__ import annotations

import threading
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ... import compat
from . import double_double as dd


@triton.jit
def merge_split(sum_a, sum_b, part_ptr, block_counter_ptr, counter_ptr, c, C,
                SPLIT: tl.constexpr, BLOCK_P: tl.constexpr, GROUPS: tl.constexpr):
    """``(sum_a, sum_b, finishing)``: a channel block's two per-channel sums over all of its
    programs (grid axis 1), in the program that is ``finishing`` (without ``SPLIT``, every
    program has the whole sums). ``block_counter_ptr``: a counter of the channel block's own,
    at its block index (statistics) or its first channel (backward reduction: its c0 is live
    across the loop anyway, and the block index kept live there too spills; the statistics
    kernels the other way round); ``counter_ptr``: the counters' buffer (``GROUPS``' counters
    lie in it, :func:`group_counters`).

    The protocol is the module's, on rows pid_1 of the [2, rows, C] float64 buffer ``part``;
    a merging program adds rows up BLOCK_P at a time, reading past the L1 cache (``.cg``:
    other programs wrote them). One level: the block's last program merges its ``splits``
    rows, a step after another. ``GROUPS``: in two levels, for a block split more ways than
    a step merges: the programs of each group of BLOCK_P consecutive rows count on a counter
    of the group's, the group's last adds its rows up in one step into row ``splits + group``
    and counts on the block's counter, and the block's last group adds up the ``groups`` rows
    of the groups: ``1 + groups / BLOCK_P`` steps one after another instead of ``splits /
    BLOCK_P``, each latency-bound (its loads wait on the partials' writers, through L2).
    """
    if SPLIT:
        splits = tl.num_programs(1)
        pid = tl.program_id(1)
        rows = splits
        if GROUPS:
            groups = tl.cdiv(splits, BLOCK_P)
            rows = splits + groups
        plane = rows * C
        _store_row(part_ptr + pid * C + c, plane, sum_a, sum_b, c < C)
        tl.debug_barrier()
        if GROUPS:
            group = pid // BLOCK_P
            first = group * BLOCK_P
            group_ptr = group_counters(counter_ptr, C, BLOCK_P) + group
            members = tl.minimum(splits - first, BLOCK_P)
            arrived = tl.atomic_add(group_ptr, 1, sem="acq_rel", scope="gpu")
            finishing = arrived == members - 1
            if finishing:
                sum_a, sum_b = _sum_rows(part_ptr, plane, first, members, c, C, BLOCK_P)
                tl.store(group_ptr, 0)
                _store_row(part_ptr + (splits + group) * C + c, plane, sum_a, sum_b, c < C)
                tl.debug_barrier()
                arrived = tl.atomic_add(block_counter_ptr, 1, sem="acq_rel", scope="gpu")
                finishing = arrived == groups - 1
                if finishing:
                    sum_a, sum_b = _sum_rows(part_ptr, plane, splits, groups, c, C, BLOCK_P)
                    tl.store(block_counter_ptr, 0)
        else:
            arrived = tl.atomic_add(block_counter_ptr, 1, sem="acq_rel", scope="gpu")
            finishing = arrived == splits - 1
            if finishing:
                sum_a, sum_b = _sum_rows(part_ptr, plane, 0, splits, c, C, BLOCK_P)
                tl.store(block_counter_ptr, 0)
    else:
        finishing = True
    return sum_a, sum_b, finishing


@triton.jit
def group_counters(counter_ptr, C, BLOCK_P: tl.constexpr):
    """This channel block's group counters (:func:`merge_split`'s ``GROUPS``): after the
    channels' counters and the cumulative average's (``counter_ptr + C``), a row of ``groups``
    counters a channel block, by its index."""
    groups = tl.cdiv(tl.num_programs(1), BLOCK_P)
    return counter_ptr + C + 1 + tl.program_id(0) * groups


@triton.jit
def _store_row(row_ptr, plane, sum_a, sum_b, mask):
    """``sum_a`` at ``row_ptr``, ``sum_b`` a plane further."""
    tl.store(row_ptr, sum_a, mask=mask)
    tl.store(row_ptr + plane, sum_b, mask=mask)


@triton.jit
def _sum_rows(part_ptr, plane, first, count, c, C, BLOCK_P: tl.constexpr):
    """Rows ``first`` to ``first + count`` of both planes of ``part``, summed per channel in
    index order (the same bits whatever order their writers finished in), BLOCK_P a step."""
    c2 = c[None, :]
    p = tl.arange(0, BLOCK_P)[:, None]
    sum_a = tl.zeros([c.shape[0]], tl.float64)
    sum_b = tl.zeros([c.shape[0]], tl.float64)
    for p0 in range(0, count, BLOCK_P):
        mask = (p0 + p < count) & (c2 < C)
        offs = (first + p0 + p) * C + c2
        sum_a += tl.sum(tl.load(part_ptr + offs, mask=mask, other=0.0, cache_modifier=".cg"), 0)
        sum_b += tl.sum(tl.load(part_ptr + plane + offs, mask=mask, other=0.0,
                                cache_modifier=".cg"), 0)
    return sum_a, sum_b


@triton.jit
def merge_split_double(sum_a, sum_a_lo, sum_b, sum_b_lo, part_ptr, block_counter_ptr, c, C,
                       SPLIT: tl.constexpr, BLOCK_P: tl.constexpr):
    """:func:`merge_split` of two double-double sums (float64's statistics): four planes,
    the high and low parts of each, added in double-double."""
    if SPLIT:
        splits = tl.num_programs(1)
        plane = splits * C
        row_ptr = part_ptr + tl.program_id(1) * C + c
        _store_row(row_ptr, plane, sum_a, sum_a_lo, c < C)
        _store_row(row_ptr + 2 * plane, plane, sum_b, sum_b_lo, c < C)
        tl.debug_barrier()
        arrived = tl.atomic_add(block_counter_ptr, 1, sem="acq_rel", scope="gpu")
        finishing = arrived == splits - 1
        if finishing:
            c2 = c[None, :]
            p = tl.arange(0, BLOCK_P)[:, None]
            acc_a = tl.zeros([BLOCK_P, c.shape[0]], sum_a.dtype)
            acc_a_lo = tl.zeros([BLOCK_P, c.shape[0]], sum_a.dtype)
            acc_b = tl.zeros([BLOCK_P, c.shape[0]], sum_b.dtype)
            acc_b_lo = tl.zeros([BLOCK_P, c.shape[0]], sum_b.dtype)
            for p0 in range(0, splits, BLOCK_P):
                mask = (p0 + p < splits) & (c2 < C)
                offs = (p0 + p) * C + c2
                acc_a, acc_a_lo = dd.add(
                    acc_a, acc_a_lo,
                    tl.load(part_ptr + offs, mask=mask, other=0.0, cache_modifier=".cg"),
                    tl.load(part_ptr + plane + offs, mask=mask, other=0.0, cache_modifier=".cg"))
                acc_b, acc_b_lo = dd.add(
                    acc_b, acc_b_lo,
                    tl.load(part_ptr + 2 * plane + offs, mask=mask, other=0.0,
                            cache_modifier=".cg"),
                    tl.load(part_ptr + 3 * plane + offs, mask=mask, other=0.0,
                            cache_modifier=".cg"))
            sum_a, sum_a_lo = dd.sum_along(acc_a, acc_a_lo, 0)
            sum_b, sum_b_lo = dd.sum_along(acc_b, acc_b_lo, 0)
            tl.store(block_counter_ptr, 0)
    else:
        finishing = True
    return sum_a, sum_a_lo, sum_b, sum_b_lo, finishing


def partial_planes(acc: torch.dtype) -> int:
    """Planes of the statistics' partial buffer: a sum and a sum of squares, each with its
    low part in float64 (:func:`merge_split_double`)."""
    return 4 if acc == torch.float64 else 2


# --------------------------------------------------------------------------------------------
# The counters and the partials' buffers (host side)
# --------------------------------------------------------------------------------------------

# Counters per buffer at least: a layer of up to this many channels needs no larger one.
_MIN_COUNTERS = 4096


class _Buffers(NamedTuple):
    """A stream's buffers, each with its size (no call into torch to ask it): the counters,
    and the partials' buffer (None until a split reduction asks for one)."""

    counters: torch.Tensor
    counters_size: int
    partials: torch.Tensor | None
    partials_size: int


# Per device and stream, its buffers: found by one lookup at every launch. Launches on one
# stream run one after another, and a launch reads no partial row another wrote: the rows
# are scratch of one launch.
_buffers: dict[tuple[torch.device, int], _Buffers] = {}
# Buffers outgrown: kept, for a captured CUDA graph may still address them.
_outgrown: list[torch.Tensor] = []
_lock = threading.Lock()


def split_counters(device: torch.device, count: int) -> torch.Tensor:
    """At least ``count`` zeroed int32 counters for launches on ``device``'s current stream,
    reused from launch to launch (each launch leaves them at 0)."""
    return split_buffers(device, count, 0)[0]


def split_buffers(device: torch.device, count: int, partials: int
                  ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``split_counters(device, count)`` and, for a split reduction, a float64 buffer of at
    least ``partials`` elements for its partial rows (None where ``partials`` is 0): both
    reused from launch to launch on ``device``'s current stream, found by one lookup of the
    stream. float64 whatever the reduction's dtype: programs' partial sums are merged in
    float64 and rounded once."""
    # A GPU's tensors alone carry a device index (``device.type`` builds a string).
    index = device.index
    key = (device, 0 if index is None else compat.current_stream_handle(index))
    found = _buffers.get(key)
    if found is None or found[1] < count or found[3] < partials:
        found = _grown(key, count, partials)
    return found[0], found[2] if partials else None


def _grown(key: tuple[torch.device, int], count: int, partials: int) -> _Buffers:
    """``_buffers[key]``, each of its buffers replaced by a larger one where it is smaller
    than asked (the counters zeroed)."""
    device = key[0]
    with _lock:
        found = _buffers.get(key)
        counters, counters_size, rows, rows_size = found or (None, 0, None, 0)
        if counters_size < count:
            if counters is not None:
                _outgrown.append(counters)
            counters_size = max(count, _MIN_COUNTERS)
            counters = torch.zeros(counters_size, dtype=torch.int32, device=device)
        if rows_size < partials:
            if rows is not None:
                _outgrown.append(rows)
            rows_size = max(partials, _MIN_COUNTERS)
            rows = torch.empty(rows_size, dtype=torch.float64, device=device)
        found = _buffers[key] = _Buffers(counters, counters_size, rows, rows_size)
    return found


def reset_counters() -> None:
    """Zero every counter buffer: after a launch that did not finish (an interpreted kernel
    that raised), a counter may hold the arrivals of programs whose block never merged."""
    with _lock:
        for buffers in _buffers.values():
            buffers.counters.zero_()
