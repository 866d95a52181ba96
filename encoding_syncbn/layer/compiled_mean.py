"""A compiled float64 call's mean with its rounding taken out, inside the graph.

Eagerly, a float64 call measures its mean's error and normalises with it taken out
(``functional._mean_offset``): the error is the same in every element of a channel, so the
backward's sums carry it unaveraged, hundreds of ulps of xhat where |mean| is a thousand
standard deviations. Compiled, the layer's formula (``modules.SyncBatchNorm._formula``) does
the same in ATen ops, with no host read and no value-dependent Python: ``batch_stats`` takes
the error beside M2, in the pass over ``x - mean`` that M2 needs; the forward normalises with
the bias shifted by it, and the backward corrects its per-channel sums (``InputNormAct``; in
place, ``compiled_inplace.RebuiltNormAct``): no element pass of its own. Merged across
processes (``distributed.merge_traced``), each rank brings its mean's error to the gather
(``rank_stats``) and the formula shifts the bias by the merged mean's (``shifted_bias``).

float32 compiled calls in one process keep their rounded mean: its error is at most half an
ulp of the mean, a few ulps of xhat within ``functional.FAR_MEAN`` standard deviations of 0,
and the correction would cost the compiled net a read of x at every call, where the eager
layer pays it only far from 0 (a host read a graph cannot make). Merged across processes the
mean is rounded to float32 from the merged float64 one, apart from nn.BatchNorm2d's, and its
rounding is known per channel: the formula takes it out with the error, at no read of x.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .. import activations
from ..kernels import torch_ops


class BatchStats(NamedTuple):
    """A float64 batch's statistics as the compiled formula takes them (detached)."""

    mean: torch.Tensor
    m2: torch.Tensor
    invstd: torch.Tensor
    # What ``(x - mean) * invstd`` exceeds the exact xhat by: the mean's error
    # (``torch_ops.residual_mean``) times invstd.
    offset: torch.Tensor


def batch_stats(x: torch.Tensor, eps: float) -> BatchStats:
    """x's float64 statistics in ATen ops: the mean, then one pass over ``x - mean`` for the
    mean's error and M2 (two reductions Inductor takes in one loop), invstd rounded once
    (``torch_ops.float64_invstd``).

    Why not ``var_mean``: its one-pass update loses the variance's low bits to the mean's
    size (about |mean| / std ulps of invstd, as many in every element's gradient)."""
    with torch.no_grad():
        dims = [0, *range(2, x.dim())]
        count = x.numel() // x.shape[1]
        # ``* (1 / n)``, not ``/ n``: Inductor computes per-channel values inside the element
        # loops that read them (``compiled_inplace.RebuiltNormAct``).
        per_value = 1.0 / max(count, 1)
        wide = x.to(torch.float64)
        mean = wide.sum(dims) * per_value
        centred = wide - _channel_view(mean, x.dim())
        error, m2 = centred.sum(dims) * per_value, centred.square().sum(dims)
        invstd = torch_ops.float64_invstd(m2, count, eps)
        return BatchStats(mean, m2, invstd, error * invstd)


def rank_stats(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(mean, M2, error)`` of x in float64 for a merge across processes traced into the
    graph (``distributed.merge_traced``): mean and M2 differentiable, the mean's error
    (``batch_stats``) detached.

    M2 sums the squares of ``(x - mean) - error``, the exact deviations, so that its gradient
    ``2 (x - mean - error)`` carries no rounded mean: ``2 error`` in every element of a
    channel would reach every element's input gradient alike, through g_M2."""
    dims = [0, *range(2, x.dim())]
    per_value = 1.0 / max(x.numel() // x.shape[1], 1)
    wide = x.to(torch.float64)
    mean = wide.sum(dims) * per_value
    with torch.no_grad():
        error = (wide - _channel_view(mean, x.dim())).sum(dims) * per_value
    # Detached: d M2 / d mean is -2 sum(x - exact mean), 0.
    centred = (wide - _channel_view(mean.detach(), x.dim())) - _channel_view(error, x.dim())
    return mean, centred.square().sum(dims), error


def shifted_bias(weight: torch.Tensor, bias: torch.Tensor, offset: torch.Tensor
                 ) -> torch.Tensor:
    """``bias - weight * offset``: the bias that makes ``(x - mean) * invstd * weight + bias``
    the exact pre-activation (``functional._shifted_bias``)."""
    return bias - weight * offset


def _channel_view(v: torch.Tensor, dims: int) -> torch.Tensor:
    return v.view(1, -1, *([1] * (dims - 2)))


class InputNormAct(torch.autograd.Function):
    """``(x, w, b) -> y = act((x - mean) * invstd * w + b - w * offset)`` with x's own batch
    statistics ``(mean, invstd)`` (detached; their gradient is part of x's) and ``offset``
    (``BatchStats.offset``), keeping x for backward, as ``nn.BatchNorm2d`` does. Traced by
    Dynamo into the compiled graph (forward and backward in ATen ops, for Inductor to fuse).

    Backward takes ``xhat + offset = (x - mean) * invstd`` from x and corrects the sums over
    it, ``sum(dz * xhat) = sum(dz * (xhat + offset)) - offset * sum(dz)``, and the
    coefficient of xhat in dx likewise: two passes over x and dy, as ``nn.BatchNorm2d``'s."""

    @staticmethod
    def forward(ctx, x, weight, bias, mean, invstd, offset, activation: str, slope: float):
        v = lambda t: _channel_view(t, x.dim())  # noqa: E731
        shifted = shifted_bias(weight, bias, offset)
        z = (x.to(mean.dtype) - v(mean)) * v(invstd * weight) + v(shifted)
        y = activations.ACTIVATIONS[activation].forward(z, slope).to(x.dtype)
        ctx.save_for_backward(x, weight, shifted, mean, invstd, offset)
        ctx.activation, ctx.slope = activation, slope
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, shifted, mean, invstd, offset = ctx.saved_tensors
        acc, dims = mean.dtype, x.dim()
        v = lambda t: _channel_view(t, dims)  # noqa: E731
        reduced = [0, *range(2, dims)]
        per_value = 1.0 / (x.numel() // x.shape[1])
        xhat = (x.to(acc) - v(mean)) * v(invstd)  # the exact xhat + offset
        dz = dy.to(acc)
        derivative = activations.ACTIVATIONS[ctx.activation].derivative
        if derivative is not None:
            z = xhat * v(weight) + v(shifted)
            dz = derivative(dz, z, ctx.slope, torch.empty_like(z))
        sum_dz = dz.sum(reduced)
        sum_dz_xhat = (dz * xhat).sum(reduced) - offset * sum_dz
        scale = weight * invstd
        coef_xhat = sum_dz_xhat * per_value * scale
        dx = ((dz - v(sum_dz * per_value)) * v(scale) - xhat * v(coef_xhat)
              + v(coef_xhat * offset))
        return (dx.to(dy.dtype), sum_dz_xhat.to(weight.dtype), sum_dz.to(weight.dtype),
                None, None, None, None, None)
