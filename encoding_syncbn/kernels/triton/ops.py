"""The Triton ops: their launch, the eager backend (:data:`EAGER`), and the same ops registered
with torch.library for the tracers (:data:`TRACED`)."""

from __future__ import annotations

import contextlib
import threading

import torch

from ... import compat
from .. import torch_ops
from ..backend import BatchSums, DxCoefs, GammaCheck, NormParams, RunningParams, RunningStats
from ..custom_ops import Op, OpsBackend, channel_vectors, implementations, register
from ..torch_ops import stats_dtype
from .backward_dx import plan_backward_dx, plan_batch_backward
from .backward_reduce import plan_backward_reduce
from .channel_stats import plan_batch_stats, plan_channel_stats
from .launch import launch_all
from .normalize_act import plan_normalize_act, plan_normalize_running
from .partials import reset_counters
from .plan import INTERPRET as INTERPRET
from .plan import Launch, empty_dx, geometry_of, launch_target

# Triton's interpreter swaps the triton.language functions for its own while a kernel runs, so
# two threads (DataParallel replicas) interpreting at once break each other; a GPU needs no lock.
_INTERPRETER_LOCK = threading.Lock()


def _run(launches: list[Launch], device: torch.device) -> None:
    """Launch on ``device``: Triton launches on the current device, so switch to it where it
    is not current already (DataParallel's replica threads have switched: no guard is built
    per op for them)."""
    if device.type != "cuda":
        guard = _INTERPRETER_LOCK
    elif device.index == torch.cuda.current_device():
        guard = contextlib.nullcontext()
    else:
        guard = torch.cuda.device(device)
    with guard:
        try:
            launch_all(launches, device.index)
        except BaseException:
            if device.type != "cuda":  # interpreted: a kernel may have stopped half-way
                reset_counters()
            raise


def _empty_dx(saved: torch.Tensor, *_) -> torch.Tensor:
    """The dx of an empty ``saved``, and ``backward_dx``'s fake: where the kernels write it."""
    return empty_dx(saved, geometry_of(saved) is not None)


def _zero_vectors(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Two per-channel vectors of zeros in the statistics dtype: the sums of an empty ``x``
    (its statistics drop out of any Chan merge with them)."""
    zeros = torch.zeros(x.shape[1], dtype=stats_dtype(x.dtype), device=x.device)
    return zeros, zeros.clone()  # outputs of a registered op may not share memory


# The ops in the shapes of custom ops (``custom_ops.Op``): called directly eagerly, registered
# for the tracers.


def _channel_stats(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    device = x.device
    planned = plan_channel_stats(x, launch_target(device))
    if planned is None:  # empty: no launch
        return _zero_vectors(x)
    launches, result = planned
    _run(launches, device)
    return result


def _batch_stats(x: torch.Tensor, eps: float, running: RunningStats | None,
                 check: GammaCheck | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    running_mean, running_var, batches, momentum = running or (None, None, None, None)
    weight, bias, gamma_limit = check or (None, None, 0.0)
    strided = running_mean is not None and not (running_mean.is_contiguous()
                                                and running_var.is_contiguous())
    if strided:  # the kernel writes contiguous vectors: strided buffers updated through copies
        running_mean, running_var = running_mean.contiguous(), running_var.contiguous()
    device = x.device
    planned = plan_batch_stats(x, eps, running_mean, running_var, batches, momentum, weight,
                               bias, gamma_limit, launch_target(device))
    if planned is None:  # empty: no launch, the reference's answer (per-channel vectors only)
        mean, invstd, small = torch_ops.batch_stats(x, eps, running, check)
        return mean, invstd, (small.to(torch.uint8) if small is not None
                              else mean.new_empty(0, dtype=torch.uint8))
    launches, result = planned
    _run(launches, device)
    if strided:
        running.mean.copy_(running_mean)
        running.var.copy_(running_var)
    return result


def _normalize_act(x: torch.Tensor, params: NormParams, out: torch.Tensor) -> None:
    device = x.device
    planned = plan_normalize_act(x, params, out, launch_target(device))
    if planned is None:  # empty: no launch
        return
    launches, dst = planned
    _run(launches, device)
    if dst is not out:
        out.copy_(dst)


def _normalize_running(x: torch.Tensor, running: RunningParams,
                       out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    device = x.device
    planned = plan_normalize_running(x, running, out, launch_target(device))
    if planned is None:  # empty: no launch, the reference's answer (per-channel vectors only)
        return torch_ops.normalize_running(x, running, out)
    launches, dst, stats = planned
    _run(launches, device)
    if dst is not out:
        out.copy_(dst)
    return stats


def _backward_reduce(saved: torch.Tensor, dy: torch.Tensor, params: NormParams,
                     saved_is_output: bool) -> tuple[torch.Tensor, torch.Tensor]:
    device = saved.device
    planned = plan_backward_reduce(saved, dy, *params, saved_is_output, launch_target(device))
    if planned is None:  # empty: no launch
        return _zero_vectors(saved)
    launches, result = planned
    _run(launches, device)
    return result


def _backward_dx(saved: torch.Tensor, dy: torch.Tensor, params: NormParams,
                 saved_is_output: bool, coefs: DxCoefs | BatchSums) -> torch.Tensor:
    device = saved.device
    planned = plan_backward_dx(saved, dy, params, saved_is_output, coefs, launch_target(device))
    if planned is None:  # empty: no launch
        return _empty_dx(saved)
    launches, dx = planned
    _run(launches, device)
    return dx


def _batch_backward(saved: torch.Tensor, dy: torch.Tensor, params: NormParams,
                    saved_is_output: bool, count: int, overwrite_saved: bool = False
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``backward_reduce``, then ``backward_dx`` from its ``BatchSums``: ``(dx, sum_dz,
    sum_dz_xhat)``, in two launches planned by one lookup. ``overwrite_saved`` changes
    nothing (the backend does not ``scratches_saved``): the kernels rebuild the input in
    registers, with no full-size scratch to spare."""
    device = saved.device
    planned = plan_batch_backward(saved, dy, params, bool(saved_is_output), int(count),
                                  launch_target(device))
    if planned is None:  # empty: no launch
        return _empty_dx(saved), *_zero_vectors(saved)
    launches, result = planned
    _run(launches, device)
    return result


def _batch_stats_fake(x: torch.Tensor, eps: float, running: RunningStats | None,
                      check: GammaCheck | None
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    mean, invstd = channel_vectors(x)
    return mean, invstd, x.new_empty(x.shape[1] if check is not None else 0, dtype=torch.uint8)


OPS = {
    "channel_stats": Op(_channel_stats, channel_vectors),
    "batch_stats": Op(_batch_stats, _batch_stats_fake,
                      mutates_args=("running_mean", "running_var", "running_batches")),
    "normalize_act": Op(_normalize_act, mutates_args=("out",)),
    "normalize_running": Op(_normalize_running, channel_vectors, mutates_args=("out",)),
    "backward_reduce": Op(_backward_reduce, channel_vectors),
    "backward_dx": Op(_backward_dx, _empty_dx),
}

#: The Triton kernels launched from the calling thread: the eager route of every op.
#:
#: Per channel, ``channel_stats`` gives ``(mean, M2, count)`` from sums of deviations from a
#: shift taken from the data (zeros for an empty batch: it drops out of any Chan merge);
#: ``batch_stats`` the batch's ``(mean, invstd)``, the running statistics folded in and the
#: small-gamma flags (uint8) where asked, in one launch; ``normalize_running`` derives
#: ``invstd`` in its launch, which also writes the ``(mean, invstd)`` it used;
#: ``backward_dx`` from ``BatchSums`` derives the coefficients in the kernel. The kernels
#: record no autograd history: no grad mode to switch.
EAGER = OpsBackend("triton", implementations(OPS), batch_backward=_batch_backward,
                   records_history=False)
#: The registered ops: what tracers see (see :func:`backend_for`).
TRACED = OpsBackend("triton", register(OPS))


def backend_for(x: torch.Tensor) -> OpsBackend:
    """:data:`TRACED` where the registered ops must be seen, else :data:`EAGER`.

    Seen while compiling (the graph must hold the opaque op), for tensor subclasses (a
    FakeTensor gets the fake implementation; so does a meta tensor) and under a dispatch mode
    (tracers must see the op). In plain eager calls the dispatcher would only add its overhead,
    held under the GIL, which DataParallel's replica threads share.
    """
    if (torch.compiler.is_compiling() or type(x) is not torch.Tensor or x.is_meta
            or compat.dispatch_modes()):
        return TRACED
    return EAGER
