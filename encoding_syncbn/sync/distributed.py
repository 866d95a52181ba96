"""The cross-process step of the merge, over ``torch.distributed``.

After the master replica of each process has merged its replicas' statistics, it gathers one
``(mean, M2, count)`` per rank of the process group and merges those again with Chan's
formula. Gathering and merging are one autograd Function, whose backward all-reduces the 2C
gradients of the merged statistics and applies its own rank's Jacobian: one collective
forward (W rows of 3C+2: the means' errors and a flag too), one backward (2C values,
whatever the world size), per layer call.
A rank with an empty batch takes part with count 0 and gets zero gradients. A float64 call
over fewer than ``MIN_FLOAT64_REBUILT_COUNT`` values a channel in the whole group gathers every
rank's inputs and output gradients in backward instead, for its input gradient in
double-double (``layer.whole_batch``), where every rank's call does (their inputs' dtypes may
differ: each rank's row says whether it can).

(It lives apart from the thread protocol in ``group.py`` so that ``group.py`` stays free of
torch.)
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from . import stats

# Whether this torch was built with torch.distributed (fixed for the process; ``is_active``
# is asked in every training call).
_AVAILABLE: bool = dist.is_available()


def is_active(process_group: Any = None) -> bool:
    """True when this process must synchronise over ``process_group`` (None: WORLD).

    That is when ``torch.distributed`` is initialised, this rank belongs to the group and the
    group has more than one rank. ``dist.new_group`` hands ranks outside the group
    ``GroupMember.NON_GROUP_MEMBER``: such a rank must not call the group's collectives, so
    for it the layer is a plain per-process BatchNorm.
    """
    if not (_AVAILABLE and dist.is_initialized()):
        return False
    if process_group is not None and process_group == dist.GroupMember.NON_GROUP_MEMBER:
        return False
    return dist.get_world_size(process_group) > 1


class _MergeAcrossProcesses(torch.autograd.Function):
    """``(mean[C], M2[C], count) -> (mean[C], M2[C], invstd[C], counts[W], error[C])`` of the
    whole group.

    Forward: one all_gather of every rank's ``(mean, M2, count)`` (float64: counts exact up to
    2^53), then Chan's merge (``stats.chan_merge``) in float64, the same on every rank. The
    ranks gather each one's mean's error too (``error``: the exact mean less ``mean``; zeros
    where not known) and merge them with the means: a rank's rounded mean shifts every
    normalised value of the group (``layer.functional._mean_offset``), and the M2 terms of
    float32 means rounded apart cost M2 their rounding over the deviations. ``error`` is the
    merged mean's, rounded to the statistics' dtype included (not differentiable). Backward: every
    rank computed the same function of the same gathered rows, so the gradient of the total
    loss with respect to the merged statistics is the sum over ranks of each rank's: one
    all_reduce of 2C values ``(g_mean, g_M2)`` (g_M2 folds in invstd's gradient, a function of
    the merged M2 alone), then this rank's own row of the merge's Jacobian, locally::

        d mean_r = g_mean * n_r / n + 2 n_r (mean_r - mean) g_M2,   d M2_r = g_M2

    A rank whose outputs get no gradient still takes part in the all_reduce, with zeros.
    ``counts`` (float64 on the host, group-rank order) is not differentiable. ``batch``: this
    process's replicas (``layer.whole_batch.WholeBatch``; None: a call whose input gradients
    never come from every rank's inputs, see ``_gathered_whole_batch``).
    """

    @staticmethod
    def forward(ctx, mean: torch.Tensor, m2: torch.Tensor, count: int, eps: float,
                process_group: Any, batch: Any, error: torch.Tensor | None):
        channels, wide = mean.numel(), torch.float64
        packed = torch.cat([mean.to(wide), m2.to(wide),
                            torch.zeros_like(mean, dtype=wide) if error is None else error.to(wide),
                            mean.new_tensor([count, batch is not None], dtype=wide)])
        world = dist.get_world_size(process_group)
        rows = [torch.empty_like(packed) for _ in range(world)]
        dist.all_gather(rows, packed, group=process_group)
        gathered = torch.stack(rows)
        # The one device-to-host copy: the global count is a host number (running variance's
        # unbiased factor, the merge's 1 / n); the flags, whether every rank's backward can
        # join the whole batch's (a rank's batch is None where its input is not float64).
        counts, flags = gathered[:, -2:].cpu().unbind(1)
        host_counts = [int(c) for c in counts.tolist()]
        rank = dist.get_rank(process_group)
        merged = stats.chan_merge(
            gathered[:, :channels].unbind(0), gathered[:, channels:2 * channels].unbind(0),
            stats.counts_of(host_counts, mean.device, wide), eps,
            gathered[:, 2 * channels:-2].unbind(0),
        )
        if not bool(flags.all()):
            batch = None
        dtype = mean.dtype
        merged_mean, invstd = merged.mean.to(dtype), merged.invstd.to(dtype)
        error = stats.rounded_error(merged.mean, merged.error, merged_mean)
        total = float(sum(host_counts))
        ctx.process_group, ctx.total, ctx.count = process_group, total, host_counts[rank]
        ctx.counts, ctx.rank, ctx.batch = host_counts, rank, batch
        # Detached: see functional.MergeReplicas.
        ctx.deviation, ctx.invstd = merged.deviation[rank], invstd.detach()
        ctx.mark_non_differentiable(counts, error)
        ctx.set_materialize_grads(False)
        return merged_mean, merged.m2.to(dtype), invstd, counts, error

    @staticmethod
    def backward(ctx, grad_mean, grad_m2, grad_invstd, _grad_counts, _grad_error):
        if torch.is_grad_enabled():
            # all_reduce is invisible to autograd: a graph built here would be silently wrong.
            raise RuntimeError(
                "SyncBatchNorm: double backward (create_graph=True) is not supported across "
                "processes; for the layers a gradient penalty differentiates twice, use "
                "sync=False or a process_group of this rank alone"
            )
        zeros = torch.zeros_like(ctx.invstd)
        if (ctx.batch is not None and ctx.batch.wanted(int(ctx.total))
                and _gathered_whole_batch(ctx)):
            # Every replica's input gradient is taken: the merges' backward reads no
            # gradient of the statistics.
            return zeros, zeros, None, None, None, None, None
        grad_m2 = stats.total_grad_m2(grad_m2, grad_invstd, ctx.invstd, ctx.total)
        # In float64 in every rank: a rank of few values computes its statistics in float64
        # where the others' are float32 (``functional.computes_in`` judges each process's
        # count), and the collective needs one layout.
        packed = torch.cat([zeros if grad_mean is None else grad_mean,
                            zeros if grad_m2 is None else grad_m2]).to(torch.float64)
        dist.all_reduce(packed, group=ctx.process_group)
        grad_mean, grad_m2 = packed.chunk(2)
        share = ctx.count / max(ctx.total, 1.0)
        grad_own_mean = torch.addcmul(grad_mean * share, ctx.deviation, grad_m2,
                                      value=2.0 * ctx.count)
        dtype = ctx.invstd.dtype
        return grad_own_mean.to(dtype), grad_m2.to(dtype), None, None, None, None, None


def _gathered_whole_batch(ctx) -> bool:
    """Gather every rank's inputs and output gradients and let ``ctx.batch`` take this
    process's input gradients from them (``layer.whole_batch``); False, in every rank, where
    some rank's replicas did not leave them (then the merges' own backward runs).

    One all_gather of float64 rows ``(has them, x, dy)``, x and dy padded to the largest
    rank's values a channel (below ``MIN_FLOAT64_REBUILT_COUNT`` the whole group's are fewer
    than that many a channel), and one host read of the flags.
    """
    rows = ctx.batch.rows()
    channels, widest = ctx.invstd.numel(), max(ctx.counts)
    packed = torch.zeros(1 + 2 * channels * widest, dtype=torch.float64,
                         device=ctx.invstd.device)
    if rows is not None:
        packed[0] = 1.0
        blocks = packed[1:].view(2, channels, widest)
        for block, part in zip(blocks, rows):
            block[:, :part.shape[1]].copy_(part)
    gathered = [torch.empty_like(packed) for _ in ctx.counts]
    dist.all_gather(gathered, packed, group=ctx.process_group)
    if not bool(torch.stack([row[0] for row in gathered]).all()):
        return False
    x_rows, dy_rows = torch.cat(
        [row[1:].view(2, channels, widest)[:, :, :count]
         for row, count in zip(gathered, ctx.counts)], 2)
    ctx.batch.take(x_rows, dy_rows, sum(ctx.counts[:ctx.rank]))
    return True


def merge_across_processes(
    mean: torch.Tensor, m2: torch.Tensor, count: int, eps: float, process_group: Any = None,
    batch: Any = None, error: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, torch.Tensor | None]:
    """The whole group's ``(mean, M2, invstd, count, error)`` from this rank's, differentiable
    but for ``error`` (the mean's: the exact mean less it; ``_MergeAcrossProcesses``).
    ``batch``: this process's replicas' ``layer.whole_batch.WholeBatch``, where their input
    gradients may come from every rank's inputs at once (None: never)."""
    mean, m2, invstd, counts, error = _MergeAcrossProcesses.apply(
        mean, m2, count, eps, process_group, batch, error)
    return mean, m2, invstd, int(counts.sum()), error


def merge_traced(mean: torch.Tensor, m2: torch.Tensor, count: int, eps: float,
                 process_group: Any = None, error: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                            torch.Tensor]:
    """``merge_across_processes`` as a compiled graph traces it: the group's ``(mean, M2,
    invstd, count, error)`` in float64, the count a 0-dim tensor (no host read), ``error``
    the merged mean's (detached; ``error`` in: this rank's mean's, None: zeros). One
    all_gather of functional collectives (float64 rows of ``(mean, M2, error, count, 0)``, as
    ``_MergeAcrossProcesses`` gathers: no whole-batch backward), differentiable: autograd's
    backward of the gather is one reduce_scatter of the rows' gradients, and of the merge,
    Chan's Jacobian (``stats.chan_merge`` in differentiable ops, its deviations the exact
    means')."""
    from torch.distributed import _functional_collectives as functional

    channels, wide = mean.numel(), torch.float64
    known = torch.zeros_like(mean, dtype=wide) if error is None else error.detach().to(wide)
    packed = torch.cat([mean.to(wide), m2.to(wide), known,
                        mean.new_full((1,), count, dtype=wide), mean.new_zeros(1, dtype=wide)])
    group = dist.group.WORLD if process_group is None else process_group
    rows = functional.all_gather_tensor_autograd(packed, gather_dim=0, group=group)
    rows = rows.view(dist.get_world_size(group), -1)
    counts = stats.counts_of_column(rows[:, -2:-1])
    merged = stats.chan_merge(rows[:, :channels].unbind(0),
                              rows[:, channels:2 * channels].unbind(0), counts, eps,
                              rows[:, 2 * channels:-2].detach().unbind(0))
    return merged.mean, merged.m2, merged.invstd, counts.total, merged.error
