"""Chan's parallel merge of per-channel ``(mean, M2, count)``, differentiable.

For k groups with counts n_i, means m_i and M2_i = sum_{e in i} (x_e - m_i)^2::

    n    = sum_i n_i
    mean = sum_i n_i m_i / n
    M2   = sum_i [ M2_i + n_i (m_i - mean)^2 ]
    invstd = (M2 / n + eps)^(-1/2)

Weighted by count, so uneven splits give the statistics of the whole batch, and free of the
``E[x^2] - E[x]^2`` cancellation. The gradients, with g_M2 the total gradient reaching M2
(directly and through invstd: d invstd / d M2 = -invstd^3 / (2 n)), are::

    d m_i  = g_mean * n_i / n + 2 n_i (m_i - mean) g_M2
    d M2_i = g_M2

``MergeStats`` keeps its few per-channel tensors as ctx attributes, not through
``save_for_backward``: it runs on the master replica's thread, where saved-tensor hooks (those
of ``torch.utils.checkpoint`` among them) belong to another replica's region, and a recompute
never runs it again.
"""

from __future__ import annotations

import torch


class MergeStats(torch.autograd.Function):
    """``(means[k, C], m2s[k, C], counts[k]) -> (mean[C], M2[C], invstd[C])``."""

    @staticmethod
    def forward(ctx, means: torch.Tensor, m2s: torch.Tensor, counts: torch.Tensor, eps: float):
        counts = counts.to(means.dtype)
        # All counts zero (a rank or replica set with an empty batch): zeros, not 0/0 = NaN,
        # which would poison the cross-process merge it takes part in.
        total = counts.sum().clamp_min(1)
        weights = (counts / total).unsqueeze(1)
        mean = (weights * means).sum(0)
        deviation = means - mean
        m2 = m2s.sum(0) + (counts.unsqueeze(1) * deviation * deviation).sum(0)
        invstd = torch.rsqrt(m2 / total + eps)
        ctx.deviation, ctx.counts, ctx.total, ctx.invstd = deviation, counts, total, invstd
        return mean, m2, invstd

    @staticmethod
    def backward(ctx, grad_mean, grad_m2, grad_invstd):
        counts = ctx.counts.unsqueeze(1)
        grad_m2_total = grad_m2 - grad_invstd * ctx.invstd.pow(3) / (2 * ctx.total)
        grad_means = (counts / ctx.total) * grad_mean + 2 * counts * ctx.deviation * grad_m2_total
        grad_m2s = grad_m2_total.expand_as(ctx.deviation)
        return grad_means, grad_m2s, None, None


def merge_stats(
    means: torch.Tensor, m2s: torch.Tensor, counts: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Merge k groups' statistics; see the module docstring. ``counts`` may hold zeros."""
    return MergeStats.apply(means, m2s, counts, eps)

