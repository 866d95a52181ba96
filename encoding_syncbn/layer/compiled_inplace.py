"""An in-place layer under ``torch.compile`` on the CPU: its formula in ATen ops, keeping for
backward only its output (and the input of a static number of channels), so that a compiled
in-place net keeps the memory an eager one saves.

Compiled, the layer cannot overwrite its input (AOTAutograd mis-routes the gradient of a
Function that marks a graph input dirty), but overwriting is not where the memory goes: the
output is kept anyway (the next convolution saves it), and what ``nn.BatchNorm2d`` keeps on
top is its input. ``RebuiltNormAct`` keeps the output only and rebuilds ``xhat`` from it in
backward through the activation's inverse, as the eager in-place Functions do.

The channels whose gamma is too small to divide by (``inplace_policy.small_gamma_mask``,
against beta and the spread the running variance gives xhat) need their input: their number
depends on the parameters' and the running variance's values, and a compiled graph has static
shapes and must not read values on the host. So the host learns it outside the compiled
region: a hook on the layer's weight (or its bias, where only that trains), run by autograd
once its gradient is accumulated (after the compiled backward), counts them on the CPU
parameters and running variance with the margins ``inplace_policy.gamma_limit`` gives an
answer one step old, and stores the count, rounded up to a power of two, on the layer
(``KEEP_ASIDE``). Dynamo reads it while tracing and guards on it: a larger count recompiles
the model (at most log2(C) + 1 times a layer; the count never shrinks). Inside the graph the
kept channels are chosen from the current parameters and the spread of the statistics the call
normalises with (``torch.topk`` of the small-gamma flags, the parameters' own first: every
flagged channel while at most that many are; a count on a running variance that lags the
batch's may leave a near-constant channel rebuilt, as an eager synchronised call does), so a
count one optimiser step old covers the current gammas unless one shrank more than
``inplace_policy.MARGIN`` times since, as an eager layer's answer on a GPU (or was set outside
training): that step's gradients are then inexact for it, which the hook, reading the
parameters the step ran with, says in a warning. Until the first count (a layer's first
compiled calls, after ``load_state_dict`` or a move, or with frozen parameters) the layer runs
out of place, as ``nn.BatchNorm2d`` compiled: exact, without the saving.

Only on the CPU. The hook reads CPU parameters where they lie: it creates no device tensor
and runs no device work, so that nothing of the count can land in a backward that a CUDA
graph tree (``mode="reduce-overhead"``) records, nor in its memory pool, as a count taken
from a GPU's parameters would. A layer whose parameters are elsewhere carries no hook, and
compiled there it runs out of place (``keep_aside``).
"""

from __future__ import annotations

import warnings
import weakref

import torch

from .. import activations
from ..kernels import Spread
from . import compiled_mean, inplace_policy
from .inplace_policy import gamma_limit, running_spread, small_gamma_mask

#: Whether a compiled in-place call keeps only its output (False: it runs out of place, as
#: before a count; ``benchmarks/bench_compile.py`` compares both).
KEEP_ONLY_OUTPUT = True

#: The layer attribute holding the count of channels to keep aside (None: not counted yet).
#: Dynamo guards on its value.
KEEP_ASIDE = "_compiled_keep_aside"

# The layer's attributes this module keeps besides ``KEEP_ASIDE``: what the last compiled
# call kept aside (a one-element list, set at each compiled call: None where no compiled call
# asked for a count, so that the hook of a layer only run eagerly counts nothing; else
# ``(kept,)``: the number of channels whose input it kept, None where it ran out of place or a
# backward has checked it since), and the hook's handle.
_LAST_CALL = "_compiled_keep_aside_last_call"
_HANDLE = "_compiled_keep_aside_hook"
TRANSIENT = (KEEP_ASIDE, _LAST_CALL, _HANDLE)


def watch(layer: torch.nn.Module) -> None:
    """Forget the layer's counts and, in place on the CPU, count again after each backward
    that accumulates its weight's gradient (or its bias's, where the weight does not train);
    called where the layer gets its parameters, their device or its ``inplace``
    (construction, unpickling, assignment, ``to()``)."""
    old = layer.__dict__.get(_HANDLE)
    if old is not None:
        old.remove()
    forget(layer)
    layer.__dict__.setdefault(_LAST_CALL, [None])
    trained = [layer._parameters.get(name) for name in ("weight", "bias")]
    trained = [param for param in trained
               if param is not None and param.requires_grad and param.device.type == "cpu"]
    handle = None
    if layer.__dict__.get("inplace") and trained:
        ref = weakref.ref(layer)
        handle = trained[0].register_post_accumulate_grad_hook(lambda _: _count(ref))
    layer.__dict__[_HANDLE] = handle


def forget(layer: torch.nn.Module) -> None:
    """The layer's parameters changed outside training (``load_state_dict``): no count until
    the next backward."""
    layer.__dict__[KEEP_ASIDE] = None


def _count(ref: weakref.ref) -> None:
    """After a backward: count the channels to keep aside from the current parameters, read on
    the CPU where they lie. Nothing
    where the layer was not compiled, where its weight is computed (a hook or
    parametrization) or not on the CPU, or where this hook is itself being traced (compiled
    autograd)."""
    layer = ref()
    last = None if layer is None else layer.__dict__[_LAST_CALL][0]
    if last is None or torch.compiler.is_compiling():
        return
    weight, bias = layer.weight, layer.bias
    if type(weight) is not torch.nn.Parameter or weight.device.type != "cpu":
        return
    (kept,) = last
    spread = running_spread(layer._running_of(layer.running_var))
    count = _small_gammas(weight, bias, gamma_limit(with_margin=True), spread)
    if kept is not None:
        # At most ``kept`` small within the margin: none below the limit beyond them.
        if count > kept:
            _warn_if_outgrown(layer, _small_gammas(weight, bias, gamma_limit(), spread), kept)
        # Checked once: a backward of eager calls after it (no compiled call since) is exact.
        layer.__dict__[_LAST_CALL][0] = (None,)
    _store(layer, count)


def _small_gammas(weight: torch.Tensor, bias: torch.Tensor | None, limit: float,
                  spread: Spread | None) -> int:
    """How many channels of these CPU parameters are too small to rebuild at ``limit`` (given
    xhat's ``spread``); read through numpy, not torch: no host read dispatched (see
    ``ChannelsAside._read``)."""
    with torch.no_grad():
        return int(small_gamma_mask(weight, bias, limit, spread).numpy().sum())


def _warn_if_outgrown(layer: torch.nn.Module, small: int, kept: int) -> None:
    """The backward just run rebuilt the input of more channels than its output can give
    (``small`` gammas, where the call kept the input of ``kept`` channels): say so, as its
    gradients are inexact there (NaN at a zero gamma). ``small`` is counted on the
    parameters of the call, the optimiser not having stepped yet, and the running variance
    the call left."""
    if small > kept:
        warnings.warn(
            f"{layer._label()}: under torch.compile, {small} channels have a gamma too small to "
            f"rebuild their input from the output, where the layer counted {kept} before this "
            f"step (a gamma fell more than {inplace_policy.MARGIN:g}-fold against beta, or a "
            "channel's running variance toward eps, within one step, or was set outside "
            "training): this step's gradients are inexact for them. The layer counts them now "
            "and keeps them aside from the next step on; set inplace=False where gamma "
            "collapses that fast.", RuntimeWarning, stacklevel=2)


def _store(layer: torch.nn.Module, count: int) -> None:
    """Round the count up to a power of two (0 stays 0, at most C) and keep the larger of it
    and the last one, so that the model recompiles a few times at most."""
    rounded = min(layer.num_features, 1 << (count - 1).bit_length()) if count else 0
    known = layer.__dict__.get(KEEP_ASIDE)
    layer.__dict__[KEEP_ASIDE] = rounded if known is None else max(rounded, known)


def keep_aside(layer: torch.nn.Module, x: torch.Tensor, count: int | None) -> int | None:
    """While compiling: how many channels the call keeps the input of (None: the call runs
    out of place); ``count``: the values a channel a training call's statistics cover."""
    if not (KEEP_ONLY_OUTPUT and layer.inplace and torch.compiler.is_compiling()
            and x.device.type == "cpu"):
        return None
    kept = getattr(layer, KEEP_ASIDE, None)
    # Keeping every channel's input costs what running out of place costs, and more time.
    # Eagerly a call over fewer than MIN_OWN_PRECISION_COUNT values computes in float64
    # (``functional.computes_in``); traced, in the input's own precision, where a rebuilt
    # input leaves the bound no share: out of place, as nn.BatchNorm computes it.
    if kept is not None and (
            kept >= layer.num_features
            or not inplace_policy.stays_in_place(layer.activation, x.dtype)
            or (count is not None and (
                not inplace_policy.rebuilds_from_count(count, x.dtype)
                or (x.dtype != torch.float64
                    and count < inplace_policy.MIN_OWN_PRECISION_COUNT)))):
        kept = None
    layer.__dict__[_LAST_CALL][0] = (kept,)
    return kept


def norm_act(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, mean: torch.Tensor,
             invstd: torch.Tensor, offset: torch.Tensor | None, batch: bool, kept: int,
             activation: str, slope: float, spread: Spread | None) -> torch.Tensor:
    """``act((x - mean) * invstd * weight + bias)``, keeping for backward the output and the
    input of ``kept`` channels: those whose gamma the output cannot be inverted through,
    first (``inplace_policy.small_gamma_mask``, against xhat's ``spread`` in the statistics
    the call normalises with).
    ``batch``: ``(mean, invstd)`` are x's own statistics (their gradient is part of x's),
    ``offset`` their mean's error in units of xhat (``compiled_mean.BatchStats``; None: not
    taken); else constants (the running statistics). The statistics come detached."""
    index = None
    if kept:
        w, b = weight.detach(), bias.detach()
        # The parameters' own small gammas first (a zero gamma rebuilds NaN), then those the
        # spread adds: the count, taken on the running variance, may lag this batch's spread.
        priority = (small_gamma_mask(w, b, gamma_limit()).to(torch.int32)
                    + small_gamma_mask(w, b, gamma_limit(), spread).to(torch.int32))
        index = torch.topk(priority, kept, sorted=False).indices
    return RebuiltNormAct.apply(x, weight, bias, mean, invstd, offset, index, batch, activation,
                                slope)


def _channel_view(v: torch.Tensor, dims: int) -> torch.Tensor:
    return v.view(1, -1, *([1] * (dims - 2)))


class RebuiltNormAct(torch.autograd.Function):
    """``(x, w, b) -> y = act((x - mean) * invstd * w + b)``, keeping y (and the input of the
    channels ``index``) for backward, where ``z = act^-1(y)`` and ``xhat = (z - b) / w``;
    the other channels' ``xhat`` comes from their input. ``offset``: the mean's error in
    units of xhat (``compiled_mean.BatchStats``; None: none), taken out of z through the bias,
    and out of the kept channels' xhat. Traced by Dynamo into the compiled graph (forward
    and backward in ATen ops, for Inductor to fuse).

    Inductor computes per-channel arithmetic inside the element loops that read it (a
    quotient or a root then costs a division an element), unless the value is a graph output
    or a reduction's. So the element loops here take products and sums only: backward reads
    ``invstd`` itself (saved, it is a forward output, computed once), ``1 / w`` applies to
    the sums, ``xhat * w * invstd`` is ``(z - b) * invstd``, and ``/ n`` is ``* (1 / n)``."""

    @staticmethod
    def forward(ctx, x, weight, bias, mean, invstd, offset, index, batch: bool,
                activation: str, slope: float):
        v = lambda t: _channel_view(t, x.dim())  # noqa: E731
        scale = invstd * weight
        shifted = bias if offset is None else compiled_mean.shifted_bias(weight, bias, offset)
        z = (x.to(mean.dtype) - v(mean)) * v(scale) + v(shifted)
        y = activations.ACTIVATIONS[activation].forward(z, slope).to(x.dtype)
        kept_input = None if index is None else x.index_select(1, index)
        ctx.save_for_backward(y, weight, bias, mean, invstd, scale, offset, index, kept_input)
        ctx.batch, ctx.activation, ctx.slope = batch, activation, slope
        return y

    @staticmethod
    def backward(ctx, dy):
        y, weight, bias, mean, invstd, scale, offset, index, kept_input = ctx.saved_tensors
        acc, dims = mean.dtype, y.dim()
        v = lambda t: _channel_view(t, dims)  # noqa: E731
        reduced = [0, *range(2, dims)]
        per_value = 1.0 / (y.numel() // y.shape[1])
        definition = activations.ACTIVATIONS[ctx.activation]
        dy_acc = dy.to(acc)
        z, dz = torch.empty_like(dy_acc), torch.empty_like(dy_acc)
        definition.inverse(y.to(acc), dy_acc, ctx.slope, z, dz, None)
        centred = z - v(bias)  # xhat * w
        sum_dz = dz.sum(reduced)
        sum_dz_xhat = (dz * centred).sum(reduced) * weight.reciprocal()
        kept_dx = None
        if index is not None:  # the channels kept aside, from their input
            kept_xhat = (kept_input.to(acc) - v(mean[index])) * v(invstd[index])
            if offset is not None:
                kept_xhat = kept_xhat - v(offset[index])
            kept_dz = dy_acc.index_select(1, index)
            if definition.derivative is not None:
                kept_z = kept_xhat * v(weight[index]) + v(bias[index])
                kept_dz = definition.derivative(kept_dz, kept_z, ctx.slope,
                                                torch.empty_like(kept_z))
            kept_sum_dz = kept_dz.sum(reduced)
            kept_sum_dz_xhat = (kept_dz * kept_xhat).sum(reduced)
            kept_dx = kept_dz
            if ctx.batch:
                kept_dx = (kept_dz - v(kept_sum_dz * per_value)
                           - kept_xhat * v(kept_sum_dz_xhat * per_value))
            # The sums as returned (graph outputs): what dx reads below.
            sum_dz = sum_dz.index_copy(0, index, kept_sum_dz)
            sum_dz_xhat = sum_dz_xhat.index_copy(0, index, kept_sum_dz_xhat)
        if ctx.batch:
            dx = ((dz - v(sum_dz * per_value)) * v(scale)
                  - centred * v(sum_dz_xhat * per_value * invstd))
        else:
            dx = dz * v(scale)
        if kept_dx is not None:
            dx = dx.index_copy(1, index, kept_dx * v(scale[index]))
        return (dx.to(dy.dtype), sum_dz_xhat.to(weight.dtype), sum_dz.to(bias.dtype),
                None, None, None, None, None, None, None)
