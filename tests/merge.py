"""The package's Chan merge (``encoding_syncbn.sync.stats``) as one differentiable function of k
groups' statistics, for the tests of the merge and its gradients on their own (the layer
builds its merges from the same pieces: ``chan_merge``, ``total_grad_m2``, ``counts_of``)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from encoding_syncbn.sync.stats import _Counts, chan_merge, counts_of, total_grad_m2


class MergeStats(torch.autograd.Function):
    """``(mean_1..mean_k, M2_1..M2_k) -> (mean[C], M2[C], invstd[C])``, the counts given.

    The k groups come as separate (C,) inputs, not one stacked tensor: stacking them outside
    would put two more nodes per call into the graph, and their backward on the master's
    critical path. Gradients that never arrive (the merged M2 feeds only the running
    statistics) stay ``None`` instead of being materialised as zeros.
    """

    @staticmethod
    def forward(ctx, counts: _Counts, eps: float, *stats: torch.Tensor):
        groups = len(stats) // 2
        merged = chan_merge(stats[:groups], stats[groups:], counts, eps)
        # A detached alias of the output, as functional.MergeReplicas keeps it.
        ctx.deviation, ctx.counts, ctx.invstd = merged.deviation, counts, merged.invstd.detach()
        ctx.set_materialize_grads(False)
        return merged.mean, merged.m2, merged.invstd

    @staticmethod
    def backward(ctx, grad_mean, grad_m2, grad_invstd):
        counts, groups = ctx.counts, ctx.deviation.shape[0]
        grad_m2_total = total_grad_m2(grad_m2, grad_invstd, ctx.invstd, counts.total)
        grad_means = None if grad_mean is None else counts.shares * grad_mean
        if grad_m2_total is not None:
            through_m2 = ctx.deviation * grad_m2_total
            grad_means = (
                through_m2.mul_(counts.column).mul_(2)
                if grad_means is None
                else torch.addcmul(grad_means, through_m2, counts.column, value=2)
            )
        grad_rows = (None,) * groups if grad_means is None else grad_means.unbind(0)
        # Every M2_i enters the sum alike: each gets the same gradient tensor.
        return None, None, *grad_rows, *((grad_m2_total,) * groups)


def merge_stats(
    means: torch.Tensor | Sequence[torch.Tensor],
    m2s: torch.Tensor | Sequence[torch.Tensor],
    counts: torch.Tensor | Sequence[int],
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Merge k groups' statistics; see the module docstring.

    ``means``, ``m2s``: k (C,) tensors each, or (k, C) tensors. ``counts``: a ``(k,)``
    tensor, or the counts as host ints (no device copy after the first time the same counts
    are seen). They may hold zeros.
    """
    if len(means) == 0:
        raise ValueError("expected the statistics of at least one group, got none")
    if len(means) != len(m2s) or len(means) != len(counts):
        raise ValueError(
            f"expected as many means, M2s and counts, got {len(means)}, {len(m2s)} and "
            f"{len(counts)}"
        )
    if isinstance(means, torch.Tensor):
        means, m2s = means.unbind(0), m2s.unbind(0)
    merge_counts = counts_of(counts, means[0].device, means[0].dtype)
    return MergeStats.apply(merge_counts, eps, *means, *m2s)
