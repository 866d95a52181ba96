"""The cross-process step of the merge, over ``torch.distributed``.

After the master replica of each process has merged its replicas' statistics, it gathers one
``(mean, M2, count)`` per rank of the process group, and the master merges those again with
Chan's formula (``stats.merge_stats``). Gathering is an autograd Function whose backward
all-reduces the gradients of the gathered statistics and keeps its own rank's row: one
collective forward, one backward, per layer call. A rank with an empty batch takes part with
count 0 and gets zero gradients.

(The design sketch puts this beside the thread protocol in ``sync.py``; it lives here so that
``sync.py`` stays free of torch.)
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def is_active(process_group: Any = None) -> bool:
    """True when this process must synchronise over ``process_group`` (None: WORLD).

    That is when ``torch.distributed`` is initialised, this rank belongs to the group and the
    group has more than one rank. ``dist.new_group`` hands ranks outside the group
    ``GroupMember.NON_GROUP_MEMBER``: such a rank must not call the group's collectives, so
    for it the layer is a plain per-process BatchNorm.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return False
    if process_group is not None and process_group == dist.GroupMember.NON_GROUP_MEMBER:
        return False
    return dist.get_world_size(process_group) > 1


class _GatherStats(torch.autograd.Function):
    """``(mean[C], M2[C], count) -> (means[W, C], m2s[W, C], counts[W])`` over the group.

    ``counts`` stay float64 (exact up to 2^53), the statistics come back in ``mean``'s dtype.
    Rows are in group-rank order; backward keeps the row of this rank *in the group*.
    """

    @staticmethod
    def forward(ctx, mean: torch.Tensor, m2: torch.Tensor, count: int, process_group: Any):
        channels = mean.numel()
        # float64 packing keeps counts exact far beyond float32's 2^24.
        packed = torch.cat(
            [mean.double(), m2.double(), mean.new_tensor([count], dtype=torch.float64)]
        )
        world = dist.get_world_size(process_group)
        rows = [torch.empty_like(packed) for _ in range(world)]
        dist.all_gather(rows, packed, group=process_group)
        gathered = torch.stack(rows)
        ctx.process_group, ctx.dtype = process_group, mean.dtype
        ctx.rank = dist.get_rank(process_group)
        counts = gathered[:, -1].clone()
        ctx.mark_non_differentiable(counts)
        return (
            gathered[:, :channels].to(mean.dtype),
            gathered[:, channels:-1].to(mean.dtype),
            counts,
        )

    @staticmethod
    def backward(ctx, grad_means: torch.Tensor, grad_m2s: torch.Tensor, _grad_counts):
        packed = torch.cat([grad_means, grad_m2s], dim=1).contiguous()
        dist.all_reduce(packed, group=ctx.process_group)
        own = packed[ctx.rank]
        channels = grad_means.shape[1]
        return own[:channels], own[channels:], None, None


def gather_stats(
    mean: torch.Tensor, m2: torch.Tensor, count: int, process_group: Any = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every rank's ``(mean, M2, count)``, rows in rank order, differentiable."""
    return _GatherStats.apply(mean, m2, count, process_group)
