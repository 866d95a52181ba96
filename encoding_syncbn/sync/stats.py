"""Chan's parallel merge of per-channel ``(mean, M2, count)``, differentiable.

For k groups with counts n_i, means m_i and M2_i = sum_{e in i} (x_e - m_i)^2::

    n    = sum_i n_i
    mean = sum_i (n_i / n) m_i
    M2   = sum_i [ M2_i + n_i (m_i - mean)^2 ]
    invstd = (M2 / n + eps)^(-1/2)

Weighted by count, so uneven splits give the statistics of the whole batch, and free of the
``E[x^2] - E[x]^2`` cancellation. The gradients, with g_M2 the total gradient reaching M2
(directly and through invstd: d invstd / d M2 = -invstd^3 / (2 n)), are::

    d m_i  = g_mean * n_i / n + 2 n_i (m_i - mean) g_M2
    d M2_i = g_M2

The layer's merges (``functional``, ``exchange``, ``distributed``) are built from these pieces.

Given each group's mean error e_i (the exact mean less m_i: float64 means, whose rounding
shifts every normalised value), the merged mean's is ``E = sum_i (n_i / n) (m_i - mean + e_i)``
and the deviations in M2 are the exact means', ``m_i - mean + e_i - E``: a group's rounded
mean would otherwise cost M2 ``2 n_i (m_i - mean) e_i``, about its relative error over the
group's sqrt(n_i) standard deviations.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from ..kernels import torch_ops
from ..tensor_cache import tensor_cache


class _Counts(NamedTuple):
    """The counts as the merge uses them: ``(k, 1)`` columns of the n_i and of the n_i / n,
    and n on the host (a 0-dim tensor in a traced merge: ``counts_of_column``)."""

    column: torch.Tensor
    shares: torch.Tensor
    total: float | torch.Tensor


def _counts_from_tensor(counts: torch.Tensor, dtype: torch.dtype, total: float | None = None
                        ) -> _Counts:
    """``total``: the counts' sum where the caller has it on the host (else read back)."""
    column = counts.to(dtype).unsqueeze(1)
    if total is None:
        total = float(counts.sum())
    # All counts zero (a rank or replica set with an empty batch): zeros, not 0/0 = NaN,
    # which would poison the cross-process merge it takes part in.
    return _Counts(column, column / max(total, 1.0), total)


@tensor_cache(maxsize=64)
def _counts_from_ints(counts: tuple[int, ...], device: torch.device, dtype: torch.dtype
                      ) -> _Counts:
    """Cached: the replicas' counts repeat from step to step, and building the tensors from
    host numbers costs a host-to-device copy, which waits for the device's queue."""
    return _counts_from_tensor(torch.tensor(counts, dtype=torch.float64, device=device), dtype,
                               float(sum(counts)))


@tensor_cache(maxsize=64)
def _constant(value: float, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """``value`` as a 0-dim tensor, built once (shared: read only). The merge passes its
    constants as tensors (or ``alpha=``/``value=``): ATen first copies a Python number operand
    into a tensor, which costs more than the arithmetic on these (C,) vectors."""
    return torch.tensor(value, dtype=dtype, device=device)


class Merged(NamedTuple):
    """The merge's results, each group's ``m_i - mean`` (``(k, C)``) for its backward (the
    exact means', ``m_i - mean + e_i - E``, where the groups brought their errors), and the
    merged mean's error (None: the groups brought none)."""

    mean: torch.Tensor
    m2: torch.Tensor
    invstd: torch.Tensor
    deviation: torch.Tensor
    error: torch.Tensor | None = None


def chan_merge(means: Sequence[torch.Tensor], m2s: Sequence[torch.Tensor], counts: _Counts,
               eps: float, errors: Sequence[torch.Tensor] | None = None) -> Merged:
    """The formulas of the module docstring, on k (C,) means and M2s (no autograd);
    ``errors``: the means' errors e_i, where known."""
    means, m2s = torch.stack(tuple(means)), torch.stack(tuple(m2s))
    mean = (means * counts.shares).sum(0)
    deviation = means - mean
    error = None
    if errors is None:
        exact_deviation = deviation
    else:
        exact_deviation = deviation + torch.stack(tuple(errors))
        error = (exact_deviation * counts.shares).sum(0)
        exact_deviation = exact_deviation - error
    m2 = torch.addcmul(m2s, exact_deviation * counts.column, exact_deviation).sum(0)
    if isinstance(counts.total, torch.Tensor):  # traced: n stays on the device
        invstd = (m2 / counts.total.clamp_min(1.0) + eps).rsqrt()
    elif m2.dtype == torch.float64:
        invstd = torch_ops.float64_invstd(m2, max(counts.total, 1.0), eps)
    else:
        invstd = torch.add(
            _constant(eps, m2.device, m2.dtype), m2, alpha=1 / max(counts.total, 1.0)
        ).rsqrt_()
    return Merged(mean, m2, invstd, exact_deviation, None if error is None else error.detach())


def rounded_error(merged_mean: torch.Tensor, error: torch.Tensor | None, mean: torch.Tensor
                  ) -> torch.Tensor | None:
    """The error of ``mean``, ``merged_mean`` rounded to a narrower dtype (float32
    statistics, merged in float64), in ``mean``'s dtype: that rounding plus the merged
    mean's own ``error`` (None where the groups brought none)."""
    if error is None:
        return None
    if mean.dtype == merged_mean.dtype:
        return error
    return (merged_mean - mean.to(merged_mean.dtype)).add_(error).to(mean.dtype)


def total_grad_m2(grad_m2: torch.Tensor | None, grad_invstd: torch.Tensor | None,
                  invstd: torch.Tensor, total: float) -> torch.Tensor | None:
    """g_M2: the gradient reaching M2 directly and through invstd (None if neither does)."""
    if grad_invstd is None:
        return grad_m2
    # d invstd / d M2 = -invstd^3 / (2 n)
    direct = _constant(0.0, invstd.device, invstd.dtype) if grad_m2 is None else grad_m2
    return torch.addcmul(direct, grad_invstd, invstd * invstd * invstd,
                         value=-0.5 / max(total, 1.0))


def counts_of(counts: torch.Tensor | Sequence[int], device: torch.device, dtype: torch.dtype
              ) -> _Counts:
    """The counts as the merge uses them, from a ``(k,)`` tensor or host ints."""
    if isinstance(counts, torch.Tensor):
        return _counts_from_tensor(counts, dtype)
    return _counts_from_ints(tuple(counts), device, dtype)


def counts_of_column(column: torch.Tensor) -> _Counts:
    """The counts as the merge uses them from a ``(k, 1)`` column, their total kept on the
    device: a merge traced into a compiled graph reads nothing back to the host."""
    total = column.sum()
    return _Counts(column, column / total.clamp_min(1.0), total)
