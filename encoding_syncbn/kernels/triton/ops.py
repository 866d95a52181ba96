"""The Triton ops: their launch, the eager backend (:data:`EAGER`), and the same ops registered
with torch.library for the tracers (:data:`TRACED`)."""

from __future__ import annotations

import contextlib
import threading
from typing import NamedTuple

import torch

from ... import compat
from .. import torch_ops
from ..backend import BatchSums, DxCoefs, GammaCheck, NormParams, RunningParams, RunningStats
from ..custom_ops import Op, OpsBackend, channel_vectors, implementations, register
from ..torch_ops import stats_dtype
from . import launch
from .backward_dx import (
    batch_backward_args,
    batch_backward_launches,
    batch_backward_plans,
    plan_backward_dx,
)
from .backward_reduce import plan_backward_reduce
from .channel_stats import (
    batch_stats_args,
    batch_stats_launch,
    batch_stats_plan,
    plan_channel_stats,
)
from .launch import (
    Prepared,
    launch_all,
    launch_direct,
    launch_prepared,
    prepare,
    prepared_memo,
)
from .normalize_act import (
    normalize_act_args,
    normalize_act_launch,
    normalize_act_plan,
    plan_normalize_running,
)
from .partials import reset_counters, split_buffers
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


# Each hot op's prepared launches (``launch.Prepared``), by its key.
_BATCH_STATS = prepared_memo()
_NORMALIZE_ACT = prepared_memo()
_BATCH_BACKWARD = prepared_memo()


def _batch_stats(x: torch.Tensor, eps: float, running: RunningStats | None,
                 check: GammaCheck | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    mean, invstd, small = _eager_batch_stats(x, eps, running, check)
    return mean, invstd, small if small is not None else mean.new_empty(0, dtype=torch.uint8)


def _eager_batch_stats(x: torch.Tensor, eps: float, running: RunningStats | None,
                       check: GammaCheck | None, prepared: Prepared | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``Backend.batch_stats``: the small-gamma flags None without ``check``; ``prepared``:
    the launches of the call's key where the caller knows them (``TrainingStep``), else
    looked up."""
    device = x.device
    if running is None:
        running_mean = running_var = batches = momentum = None
        strided = False
    else:
        running_mean, running_var, batches, momentum = running
        strided = not (running_mean.is_contiguous() and running_var.is_contiguous())
        if strided:  # the kernel writes contiguous vectors: strided buffers updated by copies
            running_mean, running_var = running_mean.contiguous(), running_var.contiguous()
    if check is None:
        weight = bias = None
        gamma_limit = 0.0
    else:
        weight, bias, gamma_limit = check
    key = None
    if prepared is None:
        key = batch_stats_key(x, eps, running, check)
        prepared = _BATCH_STATS.get(key)
    plan = prepared.plan if prepared is not None else batch_stats_plan(
        x, eps, running_mean, batches, momentum, weight, gamma_limit, launch_target(device))
    if plan is None:  # empty: no launch, the reference's answer (per-channel vectors only)
        mean, invstd, small = torch_ops.batch_stats(x, eps, running, check)
        return mean, invstd, (small.to(torch.uint8) if small is not None else None)
    if plan.copy:
        x = x.contiguous()
    args, result = batch_stats_args(plan, x, running_mean, running_var, batches, weight, bias)
    if prepared is None or not launch_prepared(prepared, device, args):
        launches = [batch_stats_launch(plan, args)]
        _run(launches, device)
        if prepared is None:  # (looked up, by ``key``)
            prepare(_BATCH_STATS, key, plan, launches, device.index)
    if strided:
        running.mean.copy_(running_mean)
        running.var.copy_(running_var)
    return result if check is not None else (*result[:2], None)


def batch_stats_key(x: torch.Tensor, eps: float, running: RunningStats | None,
                    check: GammaCheck | None) -> tuple:
    """What fixes ``batch_stats``' plan and launches on ``x``: its key in the op's memo."""
    running_key = None if running is None else (
        running.mean.dtype, running.var.dtype,
        None if running.batches is None else running.batches.dtype, running.momentum)
    check_key = None if check is None else (check.weight.dtype, check.bias.dtype, check.limit)
    return (x.shape, x.stride(), x.dtype, x.device, eps, running_key, check_key)


def _normalize_act(x: torch.Tensor, params: NormParams, out: torch.Tensor) -> None:
    _eager_normalize_act(x, params, out)


def _eager_normalize_act(x: torch.Tensor, params: NormParams, out: torch.Tensor,
                         prepared: Prepared | None = None) -> torch.Tensor:
    """``Backend.normalize_act``: ``out``, written; ``prepared`` as ``_eager_batch_stats``'."""
    device = x.device
    key = None
    if prepared is None:
        key = normalize_act_key(x, params, out)
        prepared = _NORMALIZE_ACT.get(key)
    plan = prepared.plan if prepared is not None else normalize_act_plan(
        x, params, launch_target(device))
    if plan is None:  # empty: no launch
        return out
    args = normalize_act_args(plan, x, params, out)
    if prepared is None or not launch_prepared(prepared, device, args):
        launches = [normalize_act_launch(plan, args)]
        _run(launches, device)
        if prepared is None:  # (looked up, by ``key``)
            prepare(_NORMALIZE_ACT, key, plan, launches, device.index)
    dst = args[1]
    if dst is not out:
        out.copy_(dst)
    return out


def normalize_act_key(x: torch.Tensor, params: NormParams, out: torch.Tensor) -> tuple:
    """What fixes ``normalize_act``'s plan and launch: its key in the op's memo."""
    mean, invstd, weight, bias, activation, activation_param = params
    return (x.shape, x.stride(), x.dtype, x.device, activation, activation_param, mean.dtype,
            invstd.dtype, weight.dtype, bias.dtype,
            None if out is x else (out.shape, out.stride(), out.dtype))


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
                    saved_is_output: bool, count: int, overwrite_saved: bool = False,
                    prepared: Prepared | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``backward_reduce``, then ``backward_dx`` from its ``BatchSums``: ``(dx, sum_dz,
    sum_dz_xhat)``, in two launches planned by one lookup. ``overwrite_saved`` changes
    nothing (the backend does not ``scratches_saved``): the kernels rebuild the input in
    registers, with no full-size scratch to spare. ``prepared`` as ``_eager_batch_stats``'."""
    device = saved.device
    key = None
    if prepared is None:
        key = batch_backward_key(saved, dy, params, saved_is_output)
        prepared = _BATCH_BACKWARD.get(key)
    plans = prepared.plan if prepared is not None else batch_backward_plans(
        saved, params, saved_is_output, launch_target(device))
    if plans is None:  # empty: no launch
        return _empty_dx(saved), *_zero_vectors(saved)
    reduce_args, dx_args, result = batch_backward_args(plans, saved, dy, params, int(count))
    if prepared is None or not launch_prepared(prepared, device, reduce_args, dx_args):
        launches = batch_backward_launches(plans, reduce_args, dx_args)
        _run(launches, device)
        if prepared is None:  # (looked up, by ``key``)
            prepare(_BATCH_BACKWARD, key, plans, launches, device.index)
    return result


def batch_backward_key(saved: torch.Tensor, dy: torch.Tensor, params: NormParams,
                       saved_is_output: bool) -> tuple:
    """What fixes ``batch_backward``'s plans and launches: its key in the op's memo."""
    mean, invstd, weight, bias, activation, activation_param = params
    return (saved.shape, saved.stride(), saved.dtype, saved.device, activation,
            activation_param, saved_is_output, dy.dtype, mean.dtype, invstd.dtype,
            weight.dtype, bias.dtype)


def _batch_stats_fake(x: torch.Tensor, eps: float, running: RunningStats | None,
                      check: GammaCheck | None
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    mean, invstd = channel_vectors(x)
    return mean, invstd, x.new_empty(x.shape[1] if check is not None else 0, dtype=torch.uint8)


class _EagerOps(OpsBackend):
    """The eager route, whose training-step ops are the functions above themselves, in
    ``Backend``'s shapes: no frame of ``OpsBackend``'s between a layer and their launches (the
    table keeps the shapes of custom ops, for the registered ops)."""

    batch_stats = staticmethod(_eager_batch_stats)
    normalize_act = staticmethod(_eager_normalize_act)
    batch_backward = staticmethod(_batch_backward)


class _Known(NamedTuple):
    """An op's launches kept by a ``TrainingStep``: the part of their key a call of the
    step's layer key may change (``variant``), the ``Prepared`` launches found under the whole
    key (None: none there), and ``launch.generation`` when they were found."""

    variant: tuple
    prepared: Prepared | None
    generation: int


_UNKNOWN = _Known((), None, -1)


class TrainingStep:
    """The eager ops for the training calls of one layer key (``layer.call_memo``), each op
    with the launches of its last call kept.

    Each op of :data:`EAGER` builds its key from every argument that fixes its launches and
    looks them up (``launch.Prepared``), on every call: a key of shapes, strides, dtypes, a
    device and options, hashed. The calls of one layer key share its larger part: x's shape,
    dtype and device, the layer's options (eps, momentum, activation), the per-channel
    vectors in x's statistics dtype (weight and bias as the layer hands them, the statistics
    as ``batch_stats`` gives them). What they may still change is each op's ``variant``: the
    strides, whether it runs in place, the running statistics' dtypes and whether they and
    the small-gamma check are there. A call whose variant is the op's last one hands the op
    the launches kept; any other looks them up, and they are kept with its variant. Launches
    are kept no longer than the compiled kernels they call (``launch.generation``).

    Where the usual call of an op has launches kept (a dense input, in place, contiguous
    running statistics, dy laid out as the saved tensor), the step builds their arguments and
    launches them itself: the op's own steps, as its argument builders (``batch_stats_args``,
    ``normalize_act_args``, ``batch_backward_args``) and the op take them, in one Python frame
    where those take five to ten (each a microsecond of a layer call's host time); the test
    of the step holds each to its builder. Any other call goes through the op. The other ops
    are :data:`EAGER`'s.

    The step hands its launches each tensor's address, asked once however many arguments
    take it (``launch.launch_direct``: Triton's launch would ask each argument's and query
    the driver where it points), and so vouches for each: on 16 bytes where the key does
    not fix it (checked here), and on x's device and the per-channel vectors' extent. For
    those it relies on its callers, the layer's autograd Functions: the layer checks each of
    its parameters and running statistics against x at every call (device and shape,
    ``SyncBatchNorm._check_state``), autograd checks the device of the gradient it hands
    backward, and the statistics are this step's own outputs. Where an address is off 16
    bytes, or the direct launch is not taken (a launch hook, another current device), the
    step hands the call to the op, which builds its own arguments and launches through
    Triton's public path (the outputs the step allocated go unused).

    The small-gamma flags of the step's statistics launches lie in one buffer of its own,
    which each launch writes whole: they are scratch of the call, which the layer reads at
    once on the CPU and on a GPU copies to the host in stream order behind the launch
    (``ChannelsAside``), before the next call's launch writes them again. (A next call on
    another stream may write some while the copy reads them: that answer then holds the
    newer flags of some channels, each flag a whole byte of one call's check.) What a buffer
    per call would cost is an allocation and its free at every call."""

    __slots__ = ("name", "scratches_saved", "channel_stats", "normalize_running",
                 "backward_reduce", "backward_dx", "_stats", "_normalize", "_backward",
                 "_flags")

    def __init__(self) -> None:
        for name in ("name", "scratches_saved", "channel_stats", "normalize_running",
                     "backward_reduce", "backward_dx"):
            setattr(self, name, getattr(EAGER, name))
        self._stats = self._normalize = self._backward = _UNKNOWN
        # The small-gamma flags' buffer, written whole by each call (see the docstring).
        self._flags: torch.Tensor | None = None

    def batch_stats(self, x: torch.Tensor, eps: float, running: RunningStats | None,
                    check: GammaCheck | None
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        variant = (x.stride(), eps, check is None, running is None or (
            running.mean.dtype, running.var.dtype,
            running.batches is None or running.batches.dtype, running.momentum))
        known = self._stats
        if known.variant != variant or known.generation != launch.generation:
            result = _eager_batch_stats(x, eps, running, check)
            self._stats = _Known(variant, _BATCH_STATS.get(
                batch_stats_key(x, eps, running, check)), launch.generation)
            return result
        prepared = known.prepared
        if running is None:
            running_mean = running_var = batches = None
        else:
            running_mean, running_var, batches, _ = running
        if (prepared is None or prepared.plan.copy or running is not None
                and not (running_mean.is_contiguous() and running_var.is_contiguous())):
            return _eager_batch_stats(x, eps, running, check, prepared)
        plan = prepared.plan
        mean = x.new_empty(plan.channels, dtype=plan.acc)
        invstd = torch.empty_like(mean)
        device = x.device
        counters, part = split_buffers(device, plan.counters, plan.part)
        # An absent tensor is passed as ``mean``, which its constexpr keeps unread.
        if not plan.running:
            running_mean = running_var = mean
        if not plan.counter:
            batches = mean
        if plan.check:
            weight, bias, small = check.weight, check.bias, self._flags
            if small is None:  # (the layer key fixes x's device and channels)
                small = self._flags = mean.new_empty(plan.flags, dtype=torch.uint8)
            at_small = small.data_ptr()
        else:  # no flags: the builder's empty tensor, whose address is 0 (unread)
            weight = bias = mean
            small, at_small = None, 0
        at_x, at_mean = x.data_ptr(), mean.data_ptr()
        at_running_mean, at_running_var = running_mean.data_ptr(), running_var.data_ptr()
        at_batches, at_weight, at_bias = batches.data_ptr(), weight.data_ptr(), bias.data_ptr()
        count, eps, keep, momentum, var_alpha, limit = plan.scalars
        if ((at_x | at_running_mean | at_running_var | at_batches | at_weight | at_bias) & 15
                or not launch_direct(prepared, device, (
                    at_x, at_mean if part is None else part.data_ptr(), counters.data_ptr(),
                    at_mean, invstd.data_ptr(), count, eps, at_running_mean, at_running_var,
                    at_batches, keep, momentum, var_alpha, at_weight, at_bias,
                    at_small, limit, *plan.args))):
            return _eager_batch_stats(x, eps, running, check, prepared)
        return mean, invstd, small

    def normalize_act(self, x: torch.Tensor, params: NormParams, out: torch.Tensor
                      ) -> torch.Tensor:
        variant = (x.stride(), params.activation, params.activation_param,
                   out is x or (out.stride(), out.dtype))
        known = self._normalize
        if known.variant != variant or known.generation != launch.generation:
            result = _eager_normalize_act(x, params, out)
            self._normalize = _Known(variant, _NORMALIZE_ACT.get(
                normalize_act_key(x, params, out)), launch.generation)
            return result
        prepared = known.prepared
        if prepared is None or out is not x or prepared.plan.copy:
            return _eager_normalize_act(x, params, out, prepared)
        plan = prepared.plan
        mean, invstd, weight, bias = params[:4]
        at_x, at_mean, at_invstd = x.data_ptr(), mean.data_ptr(), invstd.data_ptr()
        at_weight, at_bias = weight.data_ptr(), bias.data_ptr()
        device = x.device
        if ((at_x | at_mean | at_invstd | at_weight | at_bias) & 15
                or not launch_direct(prepared, device, (
                    at_x, at_x, at_mean, at_invstd, at_weight, at_bias, plan.activation_param,
                    *plan.args))):
            return _eager_normalize_act(x, params, out, prepared)
        return out

    def batch_backward(self, saved: torch.Tensor, dy: torch.Tensor, params: NormParams,
                       saved_is_output: bool, count: int, overwrite_saved: bool = False
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        strides = saved.stride()
        variant = (strides, dy.dtype, params.activation, params.activation_param,
                   saved_is_output)
        known = self._backward
        if known.variant != variant or known.generation != launch.generation:
            result = _batch_backward(saved, dy, params, saved_is_output, count, overwrite_saved)
            self._backward = _Known(variant, _BATCH_BACKWARD.get(
                batch_backward_key(saved, dy, params, saved_is_output)), launch.generation)
            return result
        prepared = known.prepared
        if prepared is None or prepared.plan.reduce.copy or dy.stride() != strides:
            return _batch_backward(saved, dy, params, saved_is_output, count, overwrite_saved,
                                   prepared)
        plans = prepared.plan
        reduce, dx_plan = plans.reduce, plans.dx
        dx = torch.empty_like(saved)  # (``empty_dx`` of a dense tensor)
        channels = reduce.geo.c
        sum_dz = saved.new_empty(channels, dtype=reduce.acc)
        sum_dz_xhat = torch.empty_like(sum_dz)
        device = saved.device
        counters, part = split_buffers(device, reduce.counters, reduce.part)
        mean, invstd, weight, bias = params[:4]
        at_saved, at_dy, at_mean, at_invstd = (saved.data_ptr(), dy.data_ptr(), mean.data_ptr(),
                                               invstd.data_ptr())
        at_weight, at_bias = weight.data_ptr(), bias.data_ptr()
        at_sum_dz, at_sum_dz_xhat = sum_dz.data_ptr(), sum_dz_xhat.data_ptr()
        if ((at_saved | at_dy | at_mean | at_invstd | at_weight | at_bias) & 15
                or not launch_direct(
                    prepared, device,
                    (at_saved, at_dy, at_mean, at_invstd, at_weight, at_bias, at_sum_dz,
                     at_sum_dz_xhat, at_sum_dz if part is None else part.data_ptr(),
                     counters.data_ptr(), reduce.activation_param, *reduce.args),
                    (at_saved, at_dy, dx.data_ptr(), at_mean, at_invstd, at_weight, at_bias,
                     at_weight, at_sum_dz_xhat, at_sum_dz, -1.0 / int(count),
                     dx_plan.activation_param, *dx_plan.args))):
            return _batch_backward(saved, dy, params, saved_is_output, count, overwrite_saved,
                                   prepared)
        return dx, sum_dz, sum_dz_xhat


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
EAGER = _EagerOps("triton", implementations(OPS), batch_backward=_batch_backward,
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
