"""A backend's ops called with flat arguments, as the kernel tests spell them (the ops take
the bundles of ``kernels.backend``)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from encoding_syncbn.kernels import (
    TORCH,
    Backend,
    DxCoefs,
    GammaCheck,
    NormParams,
    RunningParams,
    RunningStats,
    channel_vector,
)
from encoding_syncbn.kernels.torch_ops import stats_dtype


class FlatOps:
    """The ops of ``backend_of(x)`` for an input ``x``; with ``as_vectors``, per-channel
    vectors of any dtype and strides are first made what backends take
    (``channel_vector``), else passed as they come."""

    def __init__(self, backend_of: Callable[[torch.Tensor], Backend], as_vectors: bool) -> None:
        self._backend_of = backend_of
        self._as_vectors = as_vectors

    def _vectors(self, x: torch.Tensor, *vectors: torch.Tensor) -> list[torch.Tensor]:
        if not self._as_vectors:
            return list(vectors)
        return [channel_vector(v, stats_dtype(x.dtype)) for v in vectors]

    def _params(self, x, mean, invstd, weight, bias, activation, slope) -> NormParams:
        return NormParams(*self._vectors(x, mean, invstd, weight, bias), activation, slope)

    def channel_stats(self, x):
        return self._backend_of(x).channel_stats(x)

    def batch_stats(self, x, eps, running_mean, running_var, batches, momentum, weight, bias,
                    gamma_limit):
        check = (GammaCheck(*self._vectors(x, weight, bias), gamma_limit)
                 if weight is not None else None)
        running = (RunningStats(running_mean, running_var, batches, momentum)
                   if running_mean is not None else None)
        return self._backend_of(x).batch_stats(x, eps, running, check)

    def normalize_act(self, x, mean, invstd, weight, bias, activation, slope, out):
        return self._backend_of(x).normalize_act(
            x, self._params(x, mean, invstd, weight, bias, activation, slope), out)

    def normalize_running(self, x, running_mean, running_var, eps, weight, bias, activation,
                          slope, out):
        return self._backend_of(x).normalize_running(
            x, RunningParams(running_mean, running_var, eps, *self._vectors(x, weight, bias),
                             activation, slope), out)

    def backward_reduce(self, saved, dy, mean, invstd, weight, bias, activation, slope,
                        saved_is_output):
        return self._backend_of(saved).backward_reduce(
            saved, dy, self._params(saved, mean, invstd, weight, bias, activation, slope),
            saved_is_output)

    def backward_dx(self, saved, dy, mean, invstd, weight, bias, activation, slope,
                    saved_is_output, coef_dz, coef_xhat, coef_const):
        return self._backend_of(saved).backward_dx(
            saved, dy, self._params(saved, mean, invstd, weight, bias, activation, slope),
            saved_is_output, DxCoefs(*self._vectors(saved, coef_dz, coef_xhat, coef_const)))


#: The reference (``torch_ops``), the vectors as they come.
REFERENCE = FlatOps(lambda x: TORCH, as_vectors=False)


def triton_ops() -> FlatOps:
    """The Triton backend's ops, as the layer would choose between its eager route and its
    registered ops for ``x``."""
    from encoding_syncbn.kernels.triton import ops
    return FlatOps(ops.backend_for, as_vectors=True)
