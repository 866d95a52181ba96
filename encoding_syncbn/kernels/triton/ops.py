"""The ops as the layer calls them: launch, torch.library registration, public functions
(``torch_ops``' signatures)."""

from __future__ import annotations

import contextlib
import threading

import torch

from ... import _compat
from .. import torch_ops
from ..backend import (
    NO_CHECK,
    NO_RUNNING,
    BatchSums,
    DxCoefs,
    GammaCheck,
    NormParams,
    RunningStats,
    channel_vector,
    reduce_then_dx,
)
from ..torch_ops import stats_dtype
from .backward_dx import _plan_backward_dx, _plan_batch_backward
from .backward_reduce import _plan_backward_reduce
from .channel_stats import _plan_batch_stats, _plan_channel_stats
from .normalize_act import _plan_normalize_act, _plan_normalize_running
from .partials import reset_counters
from .plan import INTERPRET as INTERPRET
from .plan import Launch, _empty_dx, _geometry, _target

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
            for launch in launches:
                launch.kernel[launch.grid](*launch.args, **launch.constexprs,
                                           num_warps=launch.num_warps, enable_fp_fusion=True)
        except BaseException:
            if device.type != "cuda":  # interpreted: a kernel may have stopped half-way
                reset_counters()
            raise


def _zero_vectors(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Two per-channel vectors of zeros in the statistics dtype: the sums of an empty ``x``
    (its statistics drop out of any Chan merge with them)."""
    zeros = torch.zeros(x.shape[1], dtype=stats_dtype(x.dtype), device=x.device)
    return zeros, zeros.clone()  # outputs of a registered op may not share memory


def _channel_stats_impl(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    device = x.device
    planned = _plan_channel_stats(x, _target(device))
    if planned is None:  # empty: no launch
        return _zero_vectors(x)
    launches, result = planned
    _run(launches, device)
    return result


def _batch_stats_impl(x: torch.Tensor, eps: float, running_mean: torch.Tensor | None,
                      running_var: torch.Tensor | None, batches: torch.Tensor | None,
                      momentum: float | None, weight: torch.Tensor | None,
                      bias: torch.Tensor | None, gamma_limit: float
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    buffers = running_mean, running_var
    strided = running_mean is not None and not (running_mean.is_contiguous()
                                                and running_var.is_contiguous())
    if strided:  # the kernel writes contiguous vectors: strided buffers updated through copies
        running_mean, running_var = running_mean.contiguous(), running_var.contiguous()
    device = x.device
    planned = _plan_batch_stats(x, eps, running_mean, running_var, batches, momentum, weight,
                                bias, gamma_limit, _target(device))
    if planned is None:  # empty: no launch, the reference's answer (per-channel vectors only)
        mean, invstd, small = torch_ops.batch_stats(x, eps, *buffers, batches, momentum, weight,
                                                    bias, gamma_limit)
        return mean, invstd, (small.to(torch.uint8) if small is not None
                              else mean.new_empty(0, dtype=torch.uint8))
    launches, result = planned
    _run(launches, device)
    if strided:
        buffers[0].copy_(running_mean)
        buffers[1].copy_(running_var)
    return result


def _normalize_act_impl(x: torch.Tensor, mean: torch.Tensor, invstd: torch.Tensor,
                        weight: torch.Tensor, bias: torch.Tensor, activation: str, slope: float,
                        out: torch.Tensor) -> None:
    device = x.device
    planned = _plan_normalize_act(x, mean, invstd, weight, bias, activation, slope, out,
                                  _target(device))
    if planned is None:  # empty: no launch
        return
    launches, dst = planned
    _run(launches, device)
    if dst is not out:
        out.copy_(dst)


def _normalize_running_impl(x: torch.Tensor, running_mean: torch.Tensor,
                            running_var: torch.Tensor, eps: float, weight: torch.Tensor,
                            bias: torch.Tensor, activation: str, slope: float,
                            out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    device = x.device
    planned = _plan_normalize_running(x, running_mean.contiguous(), running_var.contiguous(),
                                      eps, weight, bias, activation, slope, out, _target(device))
    if planned is None:  # empty: no launch, the reference's answer (per-channel vectors only)
        return torch_ops.normalize_running(x, running_mean, running_var, eps, weight, bias,
                                           activation, slope, out)
    launches, dst, stats = planned
    _run(launches, device)
    if dst is not out:
        out.copy_(dst)
    return stats


def _backward_reduce_impl(saved: torch.Tensor, dy: torch.Tensor, mean: torch.Tensor,
                          invstd: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                          activation: str, slope: float, saved_is_output: bool
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    device = saved.device
    planned = _plan_backward_reduce(saved, dy, mean, invstd, weight, bias, activation, slope,
                                    saved_is_output, _target(device))
    if planned is None:  # empty: no launch
        return _zero_vectors(saved)
    launches, result = planned
    _run(launches, device)
    return result


def _backward_dx_impl(saved: torch.Tensor, dy: torch.Tensor, mean: torch.Tensor,
                      invstd: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                      activation: str, slope: float, saved_is_output: bool,
                      coef_dz: torch.Tensor, coef_xhat: torch.Tensor, coef_const: torch.Tensor,
                      sums_count: int) -> torch.Tensor:
    """``sums_count`` > 0: ``coef_xhat``, ``coef_const`` are a batch's sums (``BatchSums``)."""
    device = saved.device
    planned = _plan_backward_dx(saved, dy, mean, invstd, weight, bias, activation, slope,
                                saved_is_output, coef_dz, coef_xhat, coef_const, sums_count,
                                _target(device))
    if planned is None:  # empty: no launch
        return _empty_dx(saved, _geometry(saved) is not None)
    launches, dx = planned
    _run(launches, device)
    return dx


def _batch_backward_direct(saved: torch.Tensor, dy: torch.Tensor, params: NormParams,
                           saved_is_output: bool, count: int
                           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``batch_backward`` in two launches planned by one lookup (eager calls only: the
    dispatcher sees it as its two registered ops, see ``TritonBackend.batch_backward``)."""
    mean, invstd, weight, bias, activation, slope = params
    device = saved.device
    planned = _plan_batch_backward(saved, dy, mean, invstd, weight, bias, activation, slope,
                                   saved_is_output, count, _target(device))
    if planned is None:  # empty: no launch
        return _empty_dx(saved, _geometry(saved) is not None), *_zero_vectors(saved)
    launches, result = planned
    _run(launches, device)
    return result


# --------------------------------------------------------------------------------------------
# torch.library registration: opaque to torch.compile, with fake (meta) implementations.
# --------------------------------------------------------------------------------------------

_channel_stats_op = torch.library.custom_op(
    "encoding_syncbn::channel_stats", mutates_args=())(_channel_stats_impl)

_batch_stats_op = torch.library.custom_op(
    "encoding_syncbn::batch_stats", mutates_args=("running_mean", "running_var", "batches"),
)(_batch_stats_impl)

# Mutates ``out`` and returns nothing: torch derives its fake implementation.
_normalize_act_op = torch.library.custom_op(
    "encoding_syncbn::normalize_act_", mutates_args=("out",))(_normalize_act_impl)

_normalize_running_op = torch.library.custom_op(
    "encoding_syncbn::normalize_running_", mutates_args=("out",))(_normalize_running_impl)

_backward_reduce_op = torch.library.custom_op(
    "encoding_syncbn::backward_reduce", mutates_args=())(_backward_reduce_impl)

_backward_dx_op = torch.library.custom_op(
    "encoding_syncbn::backward_dx", mutates_args=())(_backward_dx_impl)


@_channel_stats_op.register_fake
def _(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    acc = stats_dtype(x.dtype)
    return x.new_empty(x.shape[1], dtype=acc), x.new_empty(x.shape[1], dtype=acc)


@_batch_stats_op.register_fake
def _(x: torch.Tensor, eps: float, running_mean: torch.Tensor | None,
      running_var: torch.Tensor | None, batches: torch.Tensor | None, momentum: float | None,
      weight: torch.Tensor | None, bias: torch.Tensor | None, gamma_limit: float
      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    acc, c = stats_dtype(x.dtype), x.shape[1]
    flags = c if weight is not None else 0
    return (x.new_empty(c, dtype=acc), x.new_empty(c, dtype=acc),
            x.new_empty(flags, dtype=torch.uint8))


@_normalize_running_op.register_fake
def _(x: torch.Tensor, running_mean: torch.Tensor, running_var: torch.Tensor, eps: float,
      weight: torch.Tensor, bias: torch.Tensor, activation: str, slope: float,
      out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    acc = stats_dtype(x.dtype)
    return x.new_empty(x.shape[1], dtype=acc), x.new_empty(x.shape[1], dtype=acc)


@_backward_reduce_op.register_fake
def _(saved: torch.Tensor, dy: torch.Tensor, mean: torch.Tensor, invstd: torch.Tensor,
      weight: torch.Tensor, bias: torch.Tensor, activation: str, slope: float,
      saved_is_output: bool) -> tuple[torch.Tensor, torch.Tensor]:
    acc = stats_dtype(saved.dtype)
    return saved.new_empty(saved.shape[1], dtype=acc), saved.new_empty(saved.shape[1], dtype=acc)


@_backward_dx_op.register_fake
def _(saved: torch.Tensor, dy: torch.Tensor, mean: torch.Tensor, invstd: torch.Tensor,
      weight: torch.Tensor, bias: torch.Tensor, activation: str, slope: float,
      saved_is_output: bool, coef_dz: torch.Tensor, coef_xhat: torch.Tensor,
      coef_const: torch.Tensor, sums_count: int) -> torch.Tensor:
    return _empty_dx(saved, _geometry(saved) is not None)


# --------------------------------------------------------------------------------------------
# The backend, and the public functions of torch_ops' signatures
# --------------------------------------------------------------------------------------------


class TritonBackend:
    """The Triton kernels as a :class:`~encoding_syncbn.kernels.backend.Backend`: through the
    registered ops (``backend_for``) or straight to their implementations."""

    def __init__(self, through_dispatcher: bool) -> None:
        self.name = "triton"
        self._through_dispatcher = through_dispatcher
        ops = torch.ops.encoding_syncbn
        self._stats = ops.channel_stats if through_dispatcher else _channel_stats_impl
        self._batch_stats = ops.batch_stats if through_dispatcher else _batch_stats_impl
        self._normalize = ops.normalize_act_ if through_dispatcher else _normalize_act_impl
        self._running = (ops.normalize_running_ if through_dispatcher
                         else _normalize_running_impl)
        self._reduce = ops.backward_reduce if through_dispatcher else _backward_reduce_impl
        self._dx = ops.backward_dx if through_dispatcher else _backward_dx_impl

    def __repr__(self) -> str:
        return "<backend 'triton'>"

    def channel_stats(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Per-channel ``(mean, M2, count)``, ``M2 = sum((x - mean)^2)``, by Welford/Chan.

        An empty batch gives zeros (it drops out of any Chan merge).
        """
        mean, m2 = self._stats(x)
        channels = x.shape[1]
        return mean, m2, (x.numel() // channels if channels else 0)

    def batch_stats(self, x: torch.Tensor, eps: float, running: RunningStats | None,
                    check: GammaCheck | None
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """``(mean, invstd)`` of the batch, the running statistics folded in, and the
        small-gamma flags (uint8) where ``check`` asks: one launch. The kernels record no
        autograd history; the registered op is called without grad (it has no autograd
        formula)."""
        flat = (x, float(eps), *(running or NO_RUNNING), *(check or NO_CHECK))
        if self._through_dispatcher:
            with torch.no_grad():
                mean, invstd, small = self._batch_stats(*flat)
        else:
            mean, invstd, small = self._batch_stats(*flat)
        return mean, invstd, (small if check is not None else None)

    def normalize_act(self, x: torch.Tensor, params: NormParams,
                      out: torch.Tensor) -> torch.Tensor:
        """``out = act((x - mean) * (invstd * weight) + bias)``; ``out`` may be ``x`` itself."""
        mean, invstd, weight, bias, activation, slope = params
        self._normalize(x, mean, invstd, weight, bias, activation, float(slope), out)
        return out

    def normalize_running(self, x: torch.Tensor, running_mean: torch.Tensor,
                          running_var: torch.Tensor, eps: float, weight: torch.Tensor,
                          bias: torch.Tensor, activation: str, slope: float,
                          out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``normalize_act`` from the running statistics in one launch: ``invstd`` derived per
        channel in the kernel, which also writes the ``(mean, invstd)`` it used."""
        return self._running(x, running_mean, running_var, float(eps), weight, bias, activation,
                             float(slope), out)

    def backward_reduce(self, saved: torch.Tensor, dy: torch.Tensor, params: NormParams,
                        saved_is_output: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-channel ``(sum(dz), sum(dz * xhat))`` in the statistics dtype."""
        mean, invstd, weight, bias, activation, slope = params
        sum_dz, sum_dz_xhat = self._reduce(saved, dy, mean, invstd, weight, bias, activation,
                                           float(slope), bool(saved_is_output))
        return sum_dz, sum_dz_xhat

    def backward_dx(self, saved: torch.Tensor, dy: torch.Tensor, params: NormParams,
                    saved_is_output: bool, coefs: DxCoefs | BatchSums) -> torch.Tensor:
        """``dx = coef_dz * dz + coef_xhat * xhat + coef_const``, in ``saved``'s dtype; from
        ``BatchSums`` the kernel derives the coefficients itself."""
        mean, invstd, weight, bias, activation, slope = params
        if isinstance(coefs, BatchSums):
            flat = (weight, coefs.sum_dz_xhat, coefs.sum_dz, int(coefs.count))
        else:
            flat = (*coefs, 0)
        return self._dx(saved, dy, mean, invstd, weight, bias, activation, float(slope),
                        bool(saved_is_output), *flat)

    def batch_backward(self, saved: torch.Tensor, dy: torch.Tensor, params: NormParams,
                       saved_is_output: bool, count: int
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``backward_reduce``, then ``backward_dx`` from its ``BatchSums``: ``(dx, sum_dz,
        sum_dz_xhat)``. Eagerly one call planned by one lookup; through the dispatcher the two
        registered ops (tracers see the same ops as for separate calls)."""
        if self._through_dispatcher:
            return reduce_then_dx(self, saved, dy, params, saved_is_output, count)
        return _batch_backward_direct(saved, dy, params, bool(saved_is_output), int(count))


DIRECT = TritonBackend(through_dispatcher=False)
DISPATCHED = TritonBackend(through_dispatcher=True)


def backend_for(x: torch.Tensor) -> TritonBackend:
    """:data:`DISPATCHED` where the registered ops must be seen, else :data:`DIRECT`.

    Seen while compiling (the graph must hold the opaque op), for tensor subclasses (a
    FakeTensor gets the fake implementation; so does a meta tensor) and under a dispatch mode
    (tracers must see the op). In plain eager calls the dispatcher would only add its overhead,
    some 10-20 us per call held under the GIL, which DataParallel's replica threads share.
    """
    if (torch.compiler.is_compiling() or type(x) is not torch.Tensor or x.is_meta
            or _compat.current_dispatch_mode() is not None):
        return DISPATCHED
    return DIRECT


# The flat functions of ``torch_ops``' signatures (the tests compare them one to one), which
# take per-channel vectors of any dtype and strides, as ``torch_ops``' do.


def _vectors(x: torch.Tensor, *vectors: torch.Tensor) -> list[torch.Tensor]:
    acc = stats_dtype(x.dtype)
    return [channel_vector(v, acc) for v in vectors]


def channel_stats(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    return backend_for(x).channel_stats(x)


def batch_stats(x: torch.Tensor, eps: float, running_mean: torch.Tensor | None,
                running_var: torch.Tensor | None, batches: torch.Tensor | None,
                momentum: float | None, weight: torch.Tensor | None, bias: torch.Tensor | None,
                gamma_limit: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    check = (GammaCheck(*_vectors(x, weight, bias), gamma_limit) if weight is not None
             else None)
    return backend_for(x).batch_stats(
        x, eps, RunningStats(running_mean, running_var, batches, momentum)
        if running_mean is not None else None, check)


def normalize_act(x: torch.Tensor, mean: torch.Tensor, invstd: torch.Tensor,
                  weight: torch.Tensor, bias: torch.Tensor, activation: str, slope: float,
                  out: torch.Tensor) -> torch.Tensor:
    return backend_for(x).normalize_act(
        x, NormParams(*_vectors(x, mean, invstd, weight, bias), activation, slope), out)


def normalize_running(x: torch.Tensor, running_mean: torch.Tensor, running_var: torch.Tensor,
                      eps: float, weight: torch.Tensor, bias: torch.Tensor, activation: str,
                      slope: float, out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return backend_for(x).normalize_running(x, running_mean, running_var, eps,
                                            *_vectors(x, weight, bias), activation, slope, out)


def backward_reduce(saved: torch.Tensor, dy: torch.Tensor, mean: torch.Tensor,
                    invstd: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                    activation: str, slope: float, saved_is_output: bool
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    return backend_for(saved).backward_reduce(
        saved, dy, NormParams(*_vectors(saved, mean, invstd, weight, bias), activation, slope),
        saved_is_output)


def backward_dx(saved: torch.Tensor, dy: torch.Tensor, mean: torch.Tensor, invstd: torch.Tensor,
                weight: torch.Tensor, bias: torch.Tensor, activation: str, slope: float,
                saved_is_output: bool, coef_dz: torch.Tensor, coef_xhat: torch.Tensor,
                coef_const: torch.Tensor) -> torch.Tensor:
    return backend_for(saved).backward_dx(
        saved, dy, NormParams(*_vectors(saved, mean, invstd, weight, bias), activation, slope),
        saved_is_output, DxCoefs(*_vectors(saved, coef_dz, coef_xhat, coef_const)))
