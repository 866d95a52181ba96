"""An in-place layer under ``torch.compile``: its formula in ATen ops, keeping for backward only
its output (and the input of a static number of channels), so that a compiled in-place net
keeps the memory an eager one saves.

Compiled, the layer cannot overwrite its input (AOTAutograd mis-routes the gradient of a
Function that marks a graph input dirty), but overwriting is not where the memory goes: the
output is kept anyway (the next convolution saves it), and what ``nn.BatchNorm2d`` keeps on
top is its input. ``RebuiltNormAct`` keeps the output only and rebuilds ``xhat`` from it in
backward through the activation's inverse, as the eager in-place Functions do.

The channels whose gamma is too small to divide by (``channels_aside``) need their input:
their number depends on the parameters' values, and a compiled graph has static shapes and
must not read values on the host. So the host learns it outside the compiled region: a hook
on the layer's weight (or its bias, where only that trains), run by autograd once its
gradient is accumulated (after the compiled backward), counts them with ``channels_aside``'s
margins and stores the count, rounded up to a power of two, on the layer (``KEEP_ASIDE``).
Dynamo reads it while tracing and guards on it: a larger count recompiles the model (at most
log2(C) + 1 times a layer; the count never shrinks). Inside the graph the kept channels are
chosen from the current parameters (``torch.topk`` of the small-gamma flags: every flagged
channel while at most that many are), so a count one optimiser step old (on a GPU, where it
reaches the host without waiting, two) covers the current gammas unless one shrank more than
``channels_aside.MARGIN`` times since, as an eager layer's answer on a GPU. Until the first
count (a layer's first compiled calls, after ``load_state_dict``, or with frozen parameters)
the layer runs out of place, as ``nn.BatchNorm2d`` compiled: exact, without the saving.
"""

from __future__ import annotations

import weakref

import torch

from .. import activations
from ..kernels import torch_ops
from ..sync.streams import stream_event
from . import inplace_policy
from .channels_aside import gamma_limit, small_gamma_mask

#: Whether a compiled in-place call keeps only its output (False: it runs out of place, as
#: before a count; ``benchmarks/bench_compile.py`` compares both).
KEEP_ONLY_OUTPUT = True

#: The layer attribute holding the counts of channels to keep aside, for float32/float64 and
#: for float16/bfloat16 outputs, (None: not counted yet). Dynamo guards on its value.
KEEP_ASIDE = "_compiled_keep_aside"

# The layer's attributes this module keeps besides ``KEEP_ASIDE``: whether a compiled call
# asked for the count (a one-element list, set at each compiled call: the hook of a layer
# only run eagerly counts nothing), the hook's handle, and a count on its way from a GPU.
_WANTED = "_compiled_keep_aside_wanted"
_HANDLE = "_compiled_keep_aside_hook"
_PENDING = "_compiled_keep_aside_pending"
TRANSIENT = (KEEP_ASIDE, _WANTED, _HANDLE, _PENDING)


def watch(layer: torch.nn.Module) -> None:
    """Forget the layer's counts and count again after each backward that accumulates its
    weight's gradient (or its bias's, where the weight does not train); called where the
    layer gets its parameters or its ``inplace`` (construction, unpickling, assignment)."""
    handle = layer.__dict__.get(_HANDLE)
    if handle is not None:
        handle.remove()
    forget(layer)
    layer.__dict__.setdefault(_WANTED, [False])
    trained = [layer._parameters.get(name) for name in ("weight", "bias")]
    trained = [param for param in trained if param is not None and param.requires_grad]
    if layer.__dict__.get("inplace") and trained:
        ref = weakref.ref(layer)
        handle = trained[0].register_post_accumulate_grad_hook(lambda _: _count(ref))
    layer.__dict__[_HANDLE] = handle


def forget(layer: torch.nn.Module) -> None:
    """The layer's parameters changed outside training (``load_state_dict``): no count until
    the next backward."""
    layer.__dict__[KEEP_ASIDE] = None
    layer.__dict__[_PENDING] = None


def _count(ref: weakref.ref) -> None:
    """After a backward: count the channels to keep aside from the current parameters. On a
    GPU the count travels to the host without waiting; a later call reads it once there."""
    layer = ref()
    if layer is None or not layer.__dict__[_WANTED][0]:
        return
    weight, bias = layer.weight, layer.bias
    if type(weight) is not torch.nn.Parameter or weight.is_meta:
        return  # a weight computed by a hook or parametrization: never counted, out of place
    with torch.no_grad():
        counts = torch.stack([
            small_gamma_mask(weight, bias, gamma_limit(dtype, with_margin=True)).sum()
            for dtype in (torch.float32, torch.float16)])
    pending = layer.__dict__.get(_PENDING)
    if pending is not None and (pending[1] is None or pending[1].query()):
        _store(layer, pending[0])
        pending = None
    if counts.is_cpu:
        _store(layer, counts)
    elif pending is None:
        host = torch.empty(counts.shape, dtype=counts.dtype, pin_memory=counts.is_cuda)
        host.copy_(counts, non_blocking=True)
        layer.__dict__[_PENDING] = (host, stream_event(counts))


def _store(layer: torch.nn.Module, counts: torch.Tensor) -> None:
    """Round each count up to a power of two (0 stays 0, at most C) and keep the larger of it
    and the last one, so that the model recompiles a few times at most."""
    channels = layer.num_features
    rounded = tuple(min(channels, 1 << (int(n) - 1).bit_length()) if n else 0
                    for n in counts.tolist())
    known = layer.__dict__.get(KEEP_ASIDE)
    if known is not None:
        rounded = tuple(max(a, b) for a, b in zip(rounded, known))
    layer.__dict__[KEEP_ASIDE] = rounded


def keep_aside(layer: torch.nn.Module, x: torch.Tensor, count: int | None) -> int | None:
    """While compiling: how many channels the call keeps the input of (None: the call runs
    out of place); ``count``: the values a channel a training call's statistics cover."""
    if not (KEEP_ONLY_OUTPUT and layer.inplace and torch.compiler.is_compiling()):
        return None
    layer.__dict__[_WANTED][0] = True
    known = getattr(layer, KEEP_ASIDE, None)
    if known is None:
        return None
    config = layer._config
    if not inplace_policy.stays_in_place(config.activation, x.dtype) or (
            count is not None and not inplace_policy.rebuilds_from_count(count, x.dtype)):
        return None
    kept = known[x.dtype in torch_ops.HALF_DTYPES]
    # Keeping every channel's input costs what running out of place costs, and more time.
    return kept if kept < layer.num_features else None


def norm_act(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, mean: torch.Tensor,
             var: torch.Tensor, eps: float, batch: bool, kept: int, activation: str,
             slope: float) -> torch.Tensor:
    """``act((x - mean) / sqrt(var + eps) * weight + bias)``, keeping for backward the output
    and the input of ``kept`` channels: those whose gamma the output cannot be inverted
    through, first (``channels_aside.small_gamma_mask`` at the limit of x's dtype).
    ``batch``: ``(mean, var)`` are x's own statistics (their gradient is part of x's); else
    constants (the running statistics). The statistics come detached."""
    index = None
    if kept:
        flags = small_gamma_mask(weight.detach(), bias.detach(), gamma_limit(x.dtype))
        index = torch.topk(flags.to(torch.int32), kept, sorted=False).indices
    invstd = torch.rsqrt(var + eps)
    return RebuiltNormAct.apply(x, weight, bias, mean, invstd, index, batch, activation, slope)


def _channel_view(v: torch.Tensor, dims: int) -> torch.Tensor:
    return v.view(1, -1, *([1] * (dims - 2)))


class RebuiltNormAct(torch.autograd.Function):
    """``(x, w, b) -> y = act((x - mean) * invstd * w + b)``, keeping y (and the input of the
    channels ``index``) for backward, where ``z = act^-1(y)`` and ``xhat = (z - b) / w``;
    the other channels' ``xhat`` comes from their input. Traced by Dynamo into the compiled
    graph (forward and backward in ATen ops, for Inductor to fuse)."""

    @staticmethod
    def forward(ctx, x, weight, bias, mean, invstd, index, batch: bool, activation: str,
                slope: float):
        v = lambda t: _channel_view(t, x.dim())  # noqa: E731
        z = (x.to(mean.dtype) - v(mean)) * v(invstd) * v(weight) + v(bias)
        y = activations.ACTIVATIONS[activation].forward(z, slope).to(x.dtype)
        kept_input = None if index is None else x.index_select(1, index)
        ctx.save_for_backward(y, weight, bias, mean, invstd, index, kept_input)
        ctx.batch, ctx.activation, ctx.slope = batch, activation, slope
        return y

    @staticmethod
    def backward(ctx, dy):
        y, weight, bias, mean, invstd, index, kept_input = ctx.saved_tensors
        acc, dims = mean.dtype, y.dim()
        v = lambda t: _channel_view(t, dims)  # noqa: E731
        definition = activations.ACTIVATIONS[ctx.activation]
        dy_acc = dy.to(acc)
        z, dz = torch.empty_like(dy_acc), torch.empty_like(dy_acc)
        definition.inverse(y.to(acc), dy_acc, ctx.slope, z, dz, None)
        xhat = (z - v(bias)) * v(weight.reciprocal())  # a product an element: cheaper
        if index is not None:  # the channels kept aside, from their input
            kept_xhat = (kept_input.to(acc) - v(mean[index])) * v(invstd[index])
            kept_dy = dy_acc.index_select(1, index)
            kept_dz = kept_dy
            if definition.derivative is not None:
                kept_z = kept_xhat * v(weight[index]) + v(bias[index])
                kept_dz = definition.derivative(kept_dy, kept_z, ctx.slope,
                                                torch.empty_like(kept_z))
            xhat = xhat.index_copy(1, index, kept_xhat)
            dz = dz.index_copy(1, index, kept_dz)
        reduced = [0, *range(2, dims)]
        sum_dz = dz.sum(reduced)
        sum_dz_xhat = (dz * xhat).sum(reduced)
        scale = v(weight * invstd)
        if ctx.batch:
            n = dz.numel() // dz.shape[1]
            dx = (dz - v(sum_dz / n) - xhat * v(sum_dz_xhat / n)) * scale
        else:
            dx = dz * scale
        return (dx.to(dy.dtype), sum_dz_xhat.to(weight.dtype), sum_dz.to(bias.dtype),
                None, None, None, None, None, None)
