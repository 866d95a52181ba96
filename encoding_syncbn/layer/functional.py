"""The layer's autograd Functions: one-pass forward, one-pass-per-reduction backward.

Notation (per channel; see ``kernels/torch_ops.py``)::

    z = (x - mean) * invstd * w + b,   y = act(z),   dz = dy * act'(z),   xhat = (z - b) / w

Training with the whole batch on one replica (``BatchNormAct``): with n elements a channel::

    dx = w * invstd * (dz - sum(dz) / n - xhat * sum(dz * xhat) / n)

Synchronised training splits that in two Functions, so that autograd itself carries the
cross-replica terms through the master's merge, and backward never waits for another replica:

    replica i: (mean_i, M2_i) of x_i  ->  master: MergeReplicas(x_1..x_k) -> (mean, M2, invstd)
    replica i: NormAct(x_i, mean, invstd)

``NormAct.backward`` returns the gradients of mean, invstd, w and b but none for x; it leaves
what it read in a ``_Link`` for ``MergeReplicas.backward``, which autograd runs after every
replica's ``NormAct`` and which writes each replica's whole input gradient in one pass.
With g_mean and g_M2 the gradients reaching the merged mean and M2 (directly or through
invstd), n the merged count::

    dx_i = w * invstd * dz_i + g_mean / n + 2 * g_M2 * (x_i - mean)

The last two terms' coefficients are the same for every replica: they are computed once per
device, not once per replica.

In place, only y is kept: x, z and xhat are rebuilt from it. Channels whose |w| is too small
to divide by (zero-initialised residual BNs) keep their input aside instead, so every sign and
value of gamma gets exact gradients (which channels, and how the host learns them:
``inplace_policy.ChannelsAside``).

Double backward (a gradient penalty: ``torch.autograd.grad(..., create_graph=True)``, then a
backward through that gradient): under ``create_graph`` each backward is autograd's gradient of
the forward recomputed in differentiable ATen ops (``_differentiable_grads``,
``_merge_backward_composite``), so that the gradients carry their own graph; the fused
single-pass ops stay the default. In place it is refused: the input is gone, and the second
derivative needs the statistics as a function of it. A synchronised float64 call over few
values a channel takes the gradient's value from double-double (``whole_batch``), its graph
from autograd (``_exactly``).
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Sequence
from typing import Callable, NamedTuple

import numpy as np
import torch

from .. import activations, compat
from ..activations import ActConfig
from ..kernels import (
    Backend,
    BatchSums,
    DxCoefs,
    GammaCheck,
    NormParams,
    RunningParams,
    RunningStats,
    double_double,
    dx_coefs,
    ops_for,
    reference_ops,
    torch_ops,
)
from ..kernels.custom_ops import FLOAT64_BATCH_BACKWARD
from ..sync import stats
from ..sync.streams import stream_event, wait_for
from . import inplace_policy
from .inplace_policy import ChannelsAside
from .whole_batch import WholeBatch


def _no_double_backward_in_place(layer: str) -> RuntimeError:
    return RuntimeError(
        f"{layer} (inplace=True) does not support double backward (differentiating its "
        "gradient, e.g. a gradient penalty with torch.autograd.grad(..., create_graph=True)): "
        "its input was overwritten by its output; use inplace=False for this layer"
    )


def _refused_if_batched(layer: str, grad_output: torch.Tensor, error: RuntimeError) -> None:
    """Raise, naming the layer, where ``error`` came from a batched gradient: the kernels and
    the fused ops' ``out=`` calls take one gradient at a time (asked only once a backward
    failed: no cost to one that does not)."""
    if compat.batched_gradient(grad_output):
        raise RuntimeError(
            f"{layer}: its backward takes one output gradient at a time, not a batch of them "
            "(torch.autograd.grad(..., is_grads_batched=True), torch.autograd.functional."
            "jacobian or hessian with vectorize=True); use vectorize=False, or torch.func."
            "jacrev / vjp, which differentiate the layer's formula in ATen ops (in "
            "evaluation, or with track_running_stats=False: torch.func refuses the running "
            "statistics' update). "
            f"PyTorch said: {error}"
        ) from error


class _Saved(NamedTuple):
    """What backward reads: x or y, the per-channel vectors and the channels kept aside."""

    tensor: torch.Tensor
    mean: torch.Tensor
    invstd: torch.Tensor
    weight: torch.Tensor
    bias: torch.Tensor
    kept_channels: torch.Tensor | None  # None: no channel kept aside
    kept_input: torch.Tensor | None  # their input
    # What ``(x - mean) * invstd`` exceeds the exact xhat by: the float64 mean's rounding
    # (``_mean_offset``); None: nothing to correct.
    offset: torch.Tensor | None = None
    # The bias the forward normalised with: ``bias - weight * offset`` (``_shifted_bias``).
    shifted_bias: torch.Tensor | None = None


class _Link:
    """Hands what ``NormAct.backward`` read to ``MergeReplicas.backward`` of the same call."""

    __slots__ = ("dtype", "saved", "grad_output", "config", "scale", "ready", "total",
                 "parts", "batch", "exact_grad", "direct_grad", "read_grads")

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype  # the replica's input's
        # The values a channel the replica normalised over (every replica and rank); None:
        # not yet known (see ``synced_batch_norm_act``).
        self.total: int | None = None
        # The parts of nested calls' merges the replica's statistics went into
        # (``MergeParts``).
        self.parts: list[Part] = []
        # The call's replicas, where their input gradients may come in double-double at once
        # (``whole_batch``); None: never.
        self.batch: WholeBatch | None = None
        self.saved: _Saved | None = None
        self.grad_output: torch.Tensor | None = None
        self.config: ActConfig | None = None
        self.scale: torch.Tensor | None = None  # weight * invstd
        self.ready: torch.cuda.Event | None = None  # see ``stream_event``
        self.exact_grad: torch.Tensor | None = None  # the input gradient, from ``batch``
        # Under a create_graph backward: the value of the input gradient its NormAct returned
        # (through x directly), which the merge's completes to the exact one.
        self.direct_grad: torch.Tensor | None = None
        # The gradients of the merged (mean, invstd) this backward brought through the graph
        # of an earlier create_graph one (``_ReadInGraph``); None: none.
        self.read_grads: tuple[torch.Tensor | None, torch.Tensor | None] | None = None

    def clear(self) -> None:
        """Drop y and dy. While filled, the link closes a cycle through autograd's C++ nodes
        (y -> its node -> ctx.link -> y) that Python's collector cannot see."""
        self.saved = self.grad_output = self.scale = self.ready = None
        self.exact_grad = self.direct_grad = self.read_grads = None


def _keeps_input(kept_channels: torch.Tensor | None) -> bool:
    """Whether the layer keeps channels aside: saves their input, recomputes their backward
    (None or empty: none, see ``ChannelsAside.index``). Backward reads the answer from
    what forward saved (``_Saved.kept_channels`` None: no channel kept aside)."""
    return kept_channels is not None and kept_channels.numel() > 0


def _normalize(ctx, x, mean, invstd, weight, bias, config: ActConfig, kept_channels,
               backend: Backend | None = None, offset: torch.Tensor | None = None
               ) -> torch.Tensor:
    """Run the forward pass with the statistics ``(mean, invstd)``, in place or not, and save
    what backward needs; ``backend``: the one the caller looked up for ``x`` (None: look it
    up); ``offset``: the mean's error in units of xhat (``_mean_offset``; None: none)."""
    kept = () if kept_channels is None else _keep_aside(x, kept_channels)
    out = _output(x, config)
    shifted = bias if offset is None else _shifted_bias(weight, bias, offset)
    (backend or _ops(x, mean.dtype)).normalize_act(
        x, NormParams(mean, invstd, weight, shifted, config.activation, config.activation_param),
        out)
    _save(ctx, x, out, weight, bias, config, kept, mean, invstd, offset, shifted)
    return out


def _mean_offset(x: torch.Tensor, mean: torch.Tensor, invstd: torch.Tensor
                 ) -> torch.Tensor | None:
    """Per channel, what ``(x - mean) * invstd`` exceeds the exact xhat by: the rounded
    mean's error (``torch_ops.residual_mean``) times invstd; None where it does not count:
    float32 statistics (of float32 and half inputs) within ``FAR_MEAN`` standard deviations
    of 0 (``far_from_zero``).

    Why: the error is the same in every element of a channel, so the backward's sums carry
    it unaveraged: over n values dx errs by about it over sqrt(n) (relative), and ELU's
    slope by all of it. With |mean| / std = 1000 it is hundreds of ulps of xhat, and
    nn.BatchNorm2d's own mean errs as much, by other luck: the README's bound (3x its error)
    then fails in a few channels in a hundred (in float32, ELU's in one in ten, though the
    mean is rounded once, as nn.BatchNorm2d's). The forward normalises with the bias shifted
    by it (``_shifted_bias``), so z is right to its rounding; xhat rebuilt from that output
    is right too, and xhat taken from x is corrected in the backward's per-channel sums and
    coefficients (``_exact_xhat_sums``, ``_on_exact_xhat``): no element pass of its own. Its
    cost is ``residual_mean``'s read of x (float32: only far from 0)."""
    if mean.dtype != torch.float64 and not far_from_zero(mean, invstd):
        return None
    with torch.no_grad():
        return torch_ops.residual_mean(x, mean).mul_(invstd)


#: Standard deviations from 0 beyond which a float32 mean's rounding (half its ulp, up to
#: ``FAR_MEAN`` eps standard deviations) is taken out of xhat: a few ulps of xhat at the most
#: below it, where the gradient's own roundings are as large.
FAR_MEAN = 8.0


def far_from_zero(mean: torch.Tensor, invstd: torch.Tensor) -> bool:
    """Whether some channel's mean lies further than ``FAR_MEAN`` standard deviations from 0,
    read on the host where the statistics are CPU tensors with values, outside a compiled
    graph; elsewhere False (the read would wait for the device, or break the graph: a GPU's
    or a compiled call's float32 statistics keep their rounded mean)."""
    if (not mean.is_cpu or type(mean) is not torch.Tensor or type(invstd) is not torch.Tensor
            or torch.compiler.is_compiling()):
        return False
    far = np.abs(mean.detach().numpy()) * invstd.detach().numpy() > FAR_MEAN
    return bool(far.any())


def _shifted_bias(weight: torch.Tensor, bias: torch.Tensor, offset: torch.Tensor
                  ) -> torch.Tensor:
    """``bias - weight * offset``: the bias that makes ``(x - mean) * invstd * weight + bias``
    the exact pre-activation, to a rounding of the bias (the same in every element, and at
    most an ulp of the bias, where the mean's error is up to hundreds)."""
    with torch.no_grad():
        return torch.addcmul(bias, weight, offset, value=-1.0)


def _normalize_running(ctx, x, running_mean, running_var, eps: float, weight, bias,
                       config: ActConfig, kept_channels) -> torch.Tensor:
    """``_normalize`` with the running statistics: the backend's ``normalize_running``
    derives ``(mean, invstd)`` from them in the same pass, and backward reads those."""
    kept = () if kept_channels is None else _keep_aside(x, kept_channels)
    out = _output(x, config)
    mean, invstd = ops_for(x).normalize_running(x, RunningParams(
        running_mean, running_var, eps, weight, bias, config.activation,
        config.activation_param), out)
    _save(ctx, x, out, weight, bias, config, kept, mean, invstd)
    return out


def computes_in(dtype: torch.dtype, count: int, device: torch.device) -> torch.dtype:
    """The dtype a training call on inputs of ``dtype`` computes in when its statistics cover
    ``count`` values a channel (all replicas and ranks): float64 below
    ``inplace_policy.MIN_OWN_PRECISION_COUNT`` values where ``device`` computes in it, else
    ``torch_ops.stats_dtype``.

    Over so few values (an (N, C, 1, 1) pooling branch) the input gradient is a difference of
    terms larger than itself, and each rounding of the layer's arithmetic reaches it
    unaveraged: in the input's own precision a handful of them exceed 3x nn.BatchNorm2d's
    error wherever its roundings happen to cancel (README, Limits), and an in-place call's
    rebuild has no share of the bound left (``inplace_policy.rebuilds_from_count``). In
    float64 a narrower input's gradient keeps its final rounding and the rebuild's, at no
    cost at that size; a float64 input's, with no wider dtype, computes in double-double,
    below ``MIN_FLOAT64_REBUILT_COUNT`` (``inplace_policy.takes_double_double_gradient``).
    """
    if count >= inplace_policy.MIN_OWN_PRECISION_COUNT:
        return torch_ops.stats_dtype(dtype)
    return torch.promote_types(dtype, torch_ops.widest_dtype(device))


def _ops(x: torch.Tensor, dtype: torch.dtype, backend: Backend | None = None) -> Backend:
    """The backend for a call on ``x`` computing in ``dtype`` (``computes_in``): ATen's ops
    where that is wider than the input's own statistics dtype (they widen each piece they
    read), else ``backend`` (None: ``ops_for(x)``)."""
    if dtype != torch_ops.stats_dtype(x.dtype):
        return reference_ops()
    return ops_for(x) if backend is None else backend


def _backward_ops(forward: Backend, saved: _Saved) -> Backend:
    """The backend a backward of ``saved`` calls: ``forward``, the one its forward called
    (``_ops`` of the same tensor and dtype), unless a tracer may have to see the ops now and
    not then (while compiling, under a dispatch mode): then ``_ops`` again."""
    if _tracing():
        return _ops(saved.tensor, saved.mean.dtype)
    return forward


def _tracing() -> bool:
    """Whether a tracer records this call's ops (``torch.compile``, a dispatch mode): then a
    backward calls what it must see as opaque ops."""
    return torch.compiler.is_compiling() or bool(compat.dispatch_modes())


def _widened(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` as the statistics of a call computing in ``dtype`` read it: in ``dtype`` where that
    is wider than x's own statistics dtype (a copy: the call is tiny), else x itself."""
    return x if dtype == torch_ops.stats_dtype(x.dtype) else x.to(dtype)


def _keep_aside(x, kept_channels) -> tuple:
    """The channels kept aside and their input, to save (usually none: each saved tensor
    costs a pack in forward and an unpack with its version check in backward)."""
    return ((kept_channels, x.index_select(1, kept_channels))
            if _keeps_input(kept_channels) else ())


def _output(x: torch.Tensor, config: ActConfig) -> torch.Tensor:
    return x if config.inplace else torch.empty_like(x)


def _save(ctx, x, out, weight, bias, config: ActConfig, kept: tuple, mean, invstd,
          offset: torch.Tensor | None = None, shifted_bias: torch.Tensor | None = None
          ) -> None:
    if config.inplace:
        ctx.mark_dirty(x)
        # torch checks a saved tensor's version only where no saved-tensor hook packed it: a
        # hook handing backward the output itself (an identity pair, ``save_on_cpu`` of a
        # CPU tensor) would let it rebuild the input from an output modified since (``out +=
        # identity``). Checked here instead (``_check_output_unmodified``); ``mark_dirty``
        # counts one more write as the Function returns.
        ctx.written = ((weakref.ref(out), out._version + 1)
                       if compat.saved_tensor_hooks_may_be_active() else None)
    ctx.save_for_backward(out if config.inplace else x, weight, bias, *kept)
    # Per-channel vectors nothing writes to: kept as they are, without a saved tensor's pack
    # and unpack at every call (BatchNormAct takes them as no input of its own).
    ctx.config, ctx.stats = config, (mean, invstd, offset, shifted_bias)


def _unpack(ctx) -> _Saved:
    """``ctx``'s saved tensors; a tensor modified in place since the forward is named.

    torch's own error names no layer and, for an in-place layer whose output was modified
    (``out += identity``), no fix.
    """
    try:
        saved = ctx.saved_tensors
    except RuntimeError as error:
        if "modified by an inplace operation" not in str(error):
            raise
        raise RuntimeError(_modified_message(ctx.config, str(error))) from error
    if ctx.config.inplace and ctx.written is not None:
        _check_output_unmodified(ctx, saved[0])
    mean, invstd, offset, shifted_bias = ctx.stats
    if len(saved) == 3:  # no channel kept aside (see _normalize)
        return _Saved(saved[0], mean, invstd, saved[1], saved[2], None, None, offset,
                      shifted_bias)
    tensor, weight, bias, kept_channels, kept_input = saved
    return _Saved(tensor, mean, invstd, weight, bias, kept_channels, kept_input, offset,
                  shifted_bias)


def _check_output_unmodified(ctx, saved: torch.Tensor) -> None:
    """Raise where an in-place call's output, saved through a hook that handed backward its
    own memory (``_save``), was written since the forward; a hook's copy (``save_on_cpu``
    of a CUDA tensor) is what the forward wrote, whatever came after."""
    ref, version = ctx.written
    out = ref()
    if (out is not None and out._version != version and out.numel()  # (empty: address 0)
            and saved.untyped_storage().data_ptr() == out.untyped_storage().data_ptr()):
        raise RuntimeError(_modified_message(
            ctx.config, f"the output's version is {out._version}, {version} after the "
            "forward (a saved-tensor hook returned it as it is now, so torch did not check "
            "it)", output=True))


def _modified_message(config: ActConfig, torch_message: str, output: bool = False) -> str:
    if config.inplace and (output or "which is output 0 of" in torch_message):
        return (
            f"{config.layer} (inplace=True) wrote its output over its input and its backward "
            "rebuilds the input from that output, but the output was modified in place after "
            "the layer's forward (`out += identity` after the layer, or another in-place layer "
            "fed this output directly). Fix: write `out = out + identity` instead of "
            "`out += identity`, or use inplace=False for that layer "
            "(encoding_syncbn.convert_inplace_abn chooses the layers that may stay in place). "
            f"PyTorch said: {torch_message}"
        )
    return (
        f"{config.layer}: a tensor its backward needs (its input, weight or bias) was modified "
        f"in place after the layer's forward. PyTorch said: {torch_message}"
    )


def _kept_args(saved: _Saved, grad_output: torch.Tensor, config: ActConfig):
    """The ``reference_ops`` arguments that recompute the channels kept aside from their input
    (which is saved: ``saved_is_output=False``)."""
    idx = saved.kept_channels
    bias = saved.bias if saved.offset is None else saved.shifted_bias
    params = NormParams(saved.mean[idx], saved.invstd[idx], saved.weight[idx], bias[idx],
                        config.activation, config.activation_param)
    return saved.kept_input, grad_output.index_select(1, idx), params


def _params(saved: _Saved, config: ActConfig) -> NormParams:
    """The backend's per-channel vectors for ``saved``: from the input, the bias the forward
    normalised with; rebuilding xhat from the output, the layer's bias (``_mean_offset``)."""
    bias = saved.bias if _from_output(saved, config) else saved.shifted_bias
    return NormParams(saved.mean, saved.invstd, saved.weight, bias, config.activation,
                      config.activation_param)


def _from_output(saved: _Saved, config: ActConfig) -> bool:
    """Whether the backward's xhat is exact as it comes: rebuilt from the output (or from the
    input with no mean offset), so that no sum or coefficient needs ``_mean_offset``'s
    correction."""
    return config.inplace or saved.offset is None


def _exact_xhat_sums(sum_dz: torch.Tensor, sum_dz_xhat: torch.Tensor, offset: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """The sums over xhat taken from the input, ``xhat + offset``, as over the exact xhat:
    ``sum(dz * xhat) = sum(dz * (xhat + offset)) - offset * sum(dz)``."""
    return sum_dz, torch.addcmul(sum_dz_xhat, offset, sum_dz, value=-1.0)


def _on_exact_xhat(coefs: DxCoefs, offset: torch.Tensor) -> DxCoefs:
    """Coefficients of the exact xhat applied to ``xhat + offset``: ``coef_xhat * xhat =
    coef_xhat * (xhat + offset) - coef_xhat * offset``."""
    return DxCoefs(coefs.dz, coefs.xhat, torch.addcmul(coefs.const, coefs.xhat, offset,
                                                       value=-1.0))


def _reduce(saved: _Saved, grad_output: torch.Tensor, config: ActConfig, params: NormParams,
            backend: Backend):
    """Per-channel ``(sum(dz), sum(dz * xhat))``; ``params``: ``_params(saved, config)``,
    ``backend``: the one looked up for ``saved.tensor`` (both made once per backward)."""
    sums = backend.backward_reduce(saved.tensor, grad_output, params,
                                   saved_is_output=config.inplace)
    if not _from_output(saved, config):
        sums = _exact_xhat_sums(*sums, saved.offset)
    return _exact_kept_sums(saved, grad_output, config, *sums)


def _exact_kept_sums(saved: _Saved, grad_output: torch.Tensor, config: ActConfig,
                      sum_dz: torch.Tensor, sum_dz_xhat: torch.Tensor):
    """The sums with those of the channels kept aside recomputed from their input; a float32
    input's summed in the widest dtype, as ATen's CPU BatchNorm backward sums: no rebuild's
    error hides a float32 sum's there (a half-precision input's float32 sums are well under
    its own rounding)."""
    if saved.kept_channels is not None:
        kept_input, kept_dy, params = _kept_args(saved, grad_output, config)
        if kept_input.dtype == torch.float32:
            wide = torch_ops.widest_dtype(kept_input.device)
            kept_input, kept_dy = kept_input.to(wide), kept_dy.to(wide)
            params = params._replace(**{name: getattr(params, name).to(wide)
                                        for name in ("mean", "invstd", "weight", "bias")})
        exact_dz, exact_dz_xhat = reference_ops().backward_reduce(
            kept_input, kept_dy, params, saved_is_output=False
        )
        if saved.offset is not None:
            exact_dz, exact_dz_xhat = _exact_xhat_sums(exact_dz, exact_dz_xhat,
                                                       saved.offset[saved.kept_channels])
        sum_dz = sum_dz.index_copy(0, saved.kept_channels, exact_dz.to(sum_dz.dtype))
        sum_dz_xhat = sum_dz_xhat.index_copy(0, saved.kept_channels,
                                             exact_dz_xhat.to(sum_dz_xhat.dtype))
    return sum_dz, sum_dz_xhat


def _input_grad(saved: _Saved, grad_output, config: ActConfig, coefs: DxCoefs | BatchSums,
                params: NormParams, backend: Backend):
    """``dx = coefs.dz * dz + coefs.xhat * xhat + coefs.const`` in one pass (``BatchSums``:
    the backend derives the coefficients); ``params`` and ``backend`` as ``_reduce``."""
    dx = backend.backward_dx(
        saved.tensor, grad_output, params, saved_is_output=config.inplace,
        coefs=(coefs if _from_output(saved, config)
               else _on_exact_xhat(dx_coefs(params, coefs), saved.offset)))
    _exact_kept_dx(dx, saved, grad_output, config, params, coefs)
    return dx


def _exact_kept_dx(dx: torch.Tensor, saved: _Saved, grad_output: torch.Tensor,
                    config: ActConfig, params: NormParams, coefs: DxCoefs | BatchSums) -> None:
    """Write into ``dx`` the channels kept aside, recomputed from their input."""
    idx = saved.kept_channels
    if idx is not None:
        kept_coefs = DxCoefs(*(c[idx] for c in dx_coefs(params, coefs)))
        if saved.offset is not None:
            kept_coefs = _on_exact_xhat(kept_coefs, saved.offset[idx])
        exact = reference_ops().backward_dx(
            *_kept_args(saved, grad_output, config), saved_is_output=False, coefs=kept_coefs)
        dx.index_copy_(1, idx, exact)


def _channel_view(v: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """A (C,) vector shaped to broadcast against an ``(N, C, *)`` tensor like ``x``."""
    return v.view(1, -1, *([1] * (x.dim() - 2)))


def _differentiable_grads(ctx, grad_output: torch.Tensor, inputs: Sequence[torch.Tensor],
                          composite: Callable[..., torch.Tensor]) -> list[torch.Tensor | None]:
    """The gradients of ``inputs`` under ``create_graph=True``: autograd's, of the forward
    recomputed by ``composite(*inputs)`` in differentiable ATen ops, so that they carry their
    own graph (torch refuses to differentiate the fused ops' ``out=`` calls, and does not see
    inside the Triton kernels)."""
    if ctx.config.inplace:
        raise _no_double_backward_in_place(ctx.config.layer)
    wanted = [i for i, t in enumerate(inputs) if ctx.needs_input_grad[i] and t.requires_grad]
    grads: list[torch.Tensor | None] = [None] * len(inputs)
    if wanted:
        # Differentiated at aliases: x is reachable through the merged statistics' history
        # too, and that path is MergeReplicas' (the gradients still lead to the originals).
        aliases = [t.view_as(t) if t.requires_grad else t for t in inputs]
        found = torch.autograd.grad(composite(*aliases), [aliases[i] for i in wanted],
                                    grad_output, create_graph=True, allow_unused=True)
        for i, grad in zip(wanted, found):
            grads[i] = grad
    return grads


def norm_act_composite(config: ActConfig):
    """``(x, mean, invstd, w, b) -> y`` in differentiable ATen ops, in the statistics dtype."""

    def composite(x, mean, invstd, weight, bias):
        v = functools.partial(_channel_view, x=x)
        z = (x.to(mean.dtype) - v(mean)) * v(invstd) * v(weight) + v(bias)
        act = activations.ACTIVATIONS[config.activation].forward
        return act(z, config.activation_param).to(x.dtype)

    return composite


def _param_grads(needs_weight: bool, needs_bias: bool, sum_dz, sum_dz_xhat):
    """``dw = sum(dz * xhat)``, ``db = sum(dz)``, where autograd asks for them."""
    return (sum_dz_xhat if needs_weight else None), (sum_dz if needs_bias else None)


class BatchNormAct(torch.autograd.Function):
    """Training on one replica's whole batch: ``(x, w, b) -> y``, normalised with x's own batch
    statistics and values per channel ``(mean, invstd, count)``: no input of the Function (the
    backward includes their dependence on x). (The Function returns y alone: one that
    overwrites a view may not return a second tensor.)

    The rest of the call comes as one argument, ``call``: ``(mean, invstd, count, config,
    kept_channels, eps, backend, offset)`` (``apply`` handles each of its arguments in
    Python, and backward answers a gradient slot for each; ``offset``: ``_mean_offset``).
    """

    @staticmethod
    def forward(ctx, x, weight, bias, call: tuple):
        mean, invstd, ctx.count, config, kept_channels, ctx.eps, backend, offset = call
        ctx.backend = backend
        # Saved-tensor hooks may hand backward the caller's own output (see
        # ``compat.saved_output_is_sole``): then backward never writes over it; nor in a
        # traced graph, whose backward counts no storage's holders. Asked only for a backend
        # that would write over it.
        ctx.unhooked = (backend.scratches_saved and not torch.compiler.is_compiling()
                        and not compat.saved_tensor_hooks_may_be_active())
        # The usual call, whose backward is one backend call on what it saved as it lies (see
        # ``_usual_backward``): in place, nothing kept aside, no mean offset. (In place, the
        # gradient is never taken in double-double: ``takes_double_double_gradient``.)
        ctx.usual = config.inplace and kept_channels is None and offset is None
        if ctx.usual:  # ``_normalize`` of it: written over x, nothing kept aside nor shifted
            backend.normalize_act(x, NormParams(mean, invstd, weight, bias, config.activation,
                                                config.activation_param), x)
            _save(ctx, x, x, weight, bias, config, (), mean, invstd, None, bias)
            return x
        return _normalize(ctx, x, mean, invstd, weight, bias, config, kept_channels, backend,
                          offset)

    @staticmethod
    def backward(ctx, grad_output):
        try:
            return _batch_norm_act_grads(ctx, grad_output)
        except RuntimeError as error:
            _refused_if_batched(ctx.config.layer, grad_output, error)
            raise


def _batch_norm_act_grads(ctx, grad_output) -> tuple:
    """``BatchNormAct``'s gradients of ``(x, w, b, call)``."""
    if (ctx.usual and ctx.needs_input_grad[0] and not torch.is_grad_enabled()
            and not torch.compiler.is_compiling() and not compat.dispatch_modes()):
        return _usual_backward(ctx, grad_output)
    saved = _unpack(ctx)
    if torch.is_grad_enabled():  # create_graph: the batch's statistics recomputed too
        config = ctx.config

        def composite(x, weight, bias):
            z = torch.nn.functional.batch_norm(x.to(weight.dtype), None, None, weight,
                                               bias, True, 0.0, ctx.eps)
            act = activations.ACTIVATIONS[config.activation].forward
            return act(z, config.activation_param).to(x.dtype)

        grads = _differentiable_grads(ctx, grad_output,
                                      (saved.tensor, saved.weight, saved.bias), composite)
        return (*grads, None)
    config, needs = ctx.config, ctx.needs_input_grad
    backend = _backward_ops(ctx.backend, saved)
    params = _params(saved, config)
    if not needs[0]:
        sum_dz, sum_dz_xhat = _reduce(saved, grad_output, config, params, backend)
        return (None, *_param_grads(needs[1], needs[2], sum_dz, sum_dz_xhat), None)
    if inplace_policy.takes_double_double_gradient(saved.tensor.dtype, ctx.count,
                                                   config.inplace):
        float64_backward = (FLOAT64_BATCH_BACKWARD if _tracing()
                            else double_double.batch_backward)
        grad_input, sum_dz, sum_dz_xhat = float64_backward(
            saved.tensor, grad_output, saved.weight, saved.bias, ctx.eps,
            config.activation, config.activation_param)
        return (grad_input, *_param_grads(needs[1], needs[2], sum_dz, sum_dz_xhat), None)
    # One backend call, then the channels kept aside, whose dx takes their exact sums (dx
    # of every other channel reads only its own sums). An output that nothing reads after
    # this backward is the call's scratch: the backend may rebuild the input over it
    # instead of into a full-size temporary (the channels kept aside read their own input).
    if not _from_output(saved, config):
        # xhat from the input, off by the mean's error: corrected in the sums and the
        # coefficients between the two passes, which the fused call does not separate.
        sum_dz, sum_dz_xhat = _reduce(saved, grad_output, config, params, backend)
        grad_input = _input_grad(saved, grad_output, config,
                                 BatchSums(sum_dz, sum_dz_xhat, ctx.count), params, backend)
        return (grad_input, *_param_grads(needs[1], needs[2], sum_dz, sum_dz_xhat), None)
    overwrite = (config.inplace and ctx.unhooked
                 and compat.saved_output_is_sole(saved.tensor))
    grad_input, sum_dz, sum_dz_xhat = backend.batch_backward(
        saved.tensor, grad_output, params, saved_is_output=config.inplace, count=ctx.count,
        overwrite_saved=overwrite)
    if saved.kept_channels is not None:
        sum_dz, sum_dz_xhat = _exact_kept_sums(saved, grad_output, config, sum_dz,
                                                sum_dz_xhat)
        _exact_kept_dx(grad_input, saved, grad_output, config, params,
                        BatchSums(sum_dz, sum_dz_xhat, ctx.count))
    return (grad_input, *_param_grads(needs[1], needs[2], sum_dz, sum_dz_xhat), None)


def _usual_backward(ctx, grad_output) -> tuple:
    """``BatchNormAct.backward`` of the usual call (``ctx.usual``) outside a create_graph
    backward, a tracer and a dispatch mode, where the input's gradient is asked: what the
    general branch does there (``_unpack``, ``_params`` from the output, one
    ``batch_backward``, ``_param_grads``), read straight from what ``_save`` saved, with no
    helper of the general branch in between (each a Python frame at every call)."""
    try:
        y, weight, bias = ctx.saved_tensors
    except RuntimeError:
        _unpack(ctx)  # raises, naming the layer and the fix where y was modified
        raise
    if ctx.written is not None:
        _check_output_unmodified(ctx, y)
    config, (mean, invstd, _, _) = ctx.config, ctx.stats
    grad_input, sum_dz, sum_dz_xhat = ctx.backend.batch_backward(
        y, grad_output, NormParams(mean, invstd, weight, bias, config.activation,
                                   config.activation_param),
        saved_is_output=True, count=ctx.count,
        overwrite_saved=ctx.unhooked and compat.saved_output_is_sole(y))
    needs = ctx.needs_input_grad
    return (grad_input, sum_dz_xhat if needs[1] else None, sum_dz if needs[2] else None, None)


class NormAct(torch.autograd.Function):
    """``y = act((x - mean) * invstd * w + b)`` with given statistics.

    With a ``link`` (synchronised training), the input gradient is left to ``MergeReplicas``;
    without one (evaluation: constant statistics) it is ``w * invstd * dz``.
    """

    @staticmethod
    def forward(ctx, x, mean, invstd, weight, bias, config: ActConfig, link: _Link | None,
                kept_channels, offset: torch.Tensor | None = None):
        ctx.link = link
        return _normalize(ctx, x, mean, invstd, weight, bias, config, kept_channels,
                          offset=offset)

    @staticmethod
    def backward(ctx, grad_output):
        try:
            return (*_norm_act_grads(ctx, grad_output), None, None, None, None)
        except RuntimeError as error:
            _refused_if_batched(ctx.config.layer, grad_output, error)
            raise


def _norm_act_grads(ctx, grad_output) -> tuple:
    """``NormAct``'s gradients of ``(x, mean, invstd, w, b)``; ``ctx.link`` None: x's is
    ``w * invstd * dz``."""
    saved = _unpack(ctx)
    config = ctx.config
    if torch.is_grad_enabled():
        # create_graph: the gradient through x directly here, the one through the merged
        # statistics (whose history leads to the merge) in MergeReplicas, from x.
        link = ctx.link
        inputs = saved[:5]
        if link is not None and link.batch is not None:
            inputs = (saved.tensor, *_ReadInGraph.apply(saved.mean, saved.invstd, link),
                      saved.weight, saved.bias)
        grads = _differentiable_grads(ctx, grad_output, inputs, norm_act_composite(config))
        if link is not None:
            if ctx.needs_input_grad[0]:
                link.saved, link.config = saved, config
                link.ready = stream_event(saved.tensor)
                if link.batch is not None:
                    # The merge returns the whole gradient's value, exact where it can be
                    # (``_exactly``): this one keeps its graph, at value 0.
                    link.grad_output = grad_output.detach()
                    if grads[0] is None:
                        link.direct_grad = torch.zeros_like(saved.tensor)
                    else:
                        link.direct_grad = grads[0].detach()
                        grads[0] = _exactly(grads[0], 0.0)
                compat.queue_backward_callback(link.clear)
        return tuple(grads)
    backend, params = _ops(saved.tensor, saved.mean.dtype), _params(saved, config)
    sum_dz, sum_dz_xhat = _reduce(saved, grad_output, config, params, backend)
    scale = saved.weight * saved.invstd
    grad_input = grad_mean = grad_invstd = None
    if ctx.link is not None and ctx.needs_input_grad[0]:
        link = ctx.link
        link.saved, link.grad_output, link.config, link.scale = (
            saved, grad_output, config, scale
        )
        link.ready = stream_event(grad_output)
        # The merge's backward empties the link; one that stops short of the merge
        # (``autograd.grad`` of the parameters alone) must not leave it filled.
        compat.queue_backward_callback(link.clear)
    elif ctx.needs_input_grad[0]:
        zeros = torch.zeros_like(scale)
        grad_input = _input_grad(saved, grad_output, config, DxCoefs(scale, zeros, zeros),
                                 params, backend)
    if ctx.needs_input_grad[1]:
        grad_mean = -scale * sum_dz
    if ctx.needs_input_grad[2]:
        grad_invstd = _from_xhat_units(saved.weight * sum_dz_xhat, saved.invstd)
    return (grad_input, grad_mean, grad_invstd,
            *_param_grads(*ctx.needs_input_grad[3:5], sum_dz, sum_dz_xhat))


class _ReadInGraph(torch.autograd.Function):
    """The merged ``(mean, invstd)`` as a create_graph backward's graph reads them (identity):
    its backward records in the link the gradients that a later backward brings them through
    that graph (a gradient penalty's), for ``whole_batch``, which takes the rest of the
    input gradient from the replicas' inputs and dy alone; and passes them on unchanged, for
    the merges' own backward."""

    @staticmethod
    def forward(ctx, mean, invstd, link: _Link):
        ctx.link = link
        ctx.set_materialize_grads(False)
        return mean.view_as(mean), invstd.view_as(invstd)

    @staticmethod
    def backward(ctx, grad_mean, grad_invstd):
        _record_read(ctx.link, grad_mean, grad_invstd)
        return grad_mean, grad_invstd, None


def _record_read(holder: _Link | Part, *grads: torch.Tensor | None) -> None:
    """Add the gradients a reading node brought to ``holder.read_grads``, where they last to
    the end of the backward pass (``holder.clear`` queued)."""
    read = [None if g is None else g.detach() for g in grads]
    if holder.read_grads is not None:  # read by the graphs of several backward passes
        read = [a if b is None else b if a is None else a + b
                for a, b in zip(read, holder.read_grads)]
    holder.read_grads = tuple(read)
    compat.queue_backward_callback(holder.clear)


class RunningNormAct(torch.autograd.Function):
    """Evaluation: ``y = act((x - running_mean) / sqrt(running_var + eps) * w + b)``, the
    statistics derived in the normalising pass (``normalize_running``). The running buffers
    have no gradient; x's is ``w * invstd * dz``, as ``NormAct``'s without a link.
    """

    @staticmethod
    def forward(ctx, x, running_mean, running_var, weight, bias, config: ActConfig,
                kept_channels, eps: float):
        ctx.link = None
        return _normalize_running(ctx, x, running_mean, running_var, eps, weight, bias, config,
                                  kept_channels)

    @staticmethod
    def backward(ctx, grad_output):
        try:
            grad_input, _, _, grad_weight, grad_bias = _norm_act_grads(ctx, grad_output)
        except RuntimeError as error:
            _refused_if_batched(ctx.config.layer, grad_output, error)
            raise
        return grad_input, None, None, grad_weight, grad_bias, None, None, None


class ReplicaStats(NamedTuple):
    """What one replica brings to the merge: its input (only for autograd to route the input's
    gradient to the merge), the input's per-channel mean and M2 and its count, the link its
    ``NormAct`` fills in backward, and the mean in float64 where the statistics dtype rounds
    it too coarsely for the merge (see ``replica_stats``; None: ``mean`` is precise enough)."""

    x: torch.Tensor
    mean: torch.Tensor
    m2: torch.Tensor
    count: int
    link: _Link
    precise_mean: torch.Tensor | None = None
    # float64 statistics: the error of ``mean`` (``torch_ops.residual_mean``); else None.
    mean_error: torch.Tensor | None = None


class Exchanged(NamedTuple):
    """What a synchronised call's exchange answers (``synced_batch_norm_act``): the global
    ``(mean, invstd)`` on the replica's device, still attached to the autograd graph of the
    merge (``merge_replicas``), the global count (values a channel), and the link the
    replica's ``NormAct`` fills in backward for the merge's (None: no merge, as in a
    checkpoint's recomputation)."""

    mean: torch.Tensor
    invstd: torch.Tensor
    total: int
    link: _Link | None
    # The global mean's error in units of xhat (``_mean_offset``); None: not known.
    offset: torch.Tensor | None = None


def replica_stats(x: torch.Tensor) -> ReplicaStats:
    """The calling replica's contribution to the merge.

    A float32 input also brings its mean in float64 (one more read of x, no temporary): the
    merge's ``n_i (mean_i - mean)^2`` terms are differences of nearby means, so a mean rounded
    to float32 (half an ulp: 0.03 at 1e6) costs the merged variance far more than it costs
    one replica's (at mean 1e6, std 1 and 2-4 replicas: ~1e-3 relative, against ~1e-8).
    Half-precision inputs have float32 statistics, finer than their own rounding. A replica
    of few values takes its statistics in float64 (``local_channel_stats``).
    """
    with torch.no_grad():
        mean, m2, count = local_channel_stats(x, ops_for(x))
        precise_mean = mean_error = None
        if mean.dtype == torch.float32 and x.dtype == torch.float32 and count > 0:
            dims = [0, *range(2, x.dim())]
            precise_mean = x.sum(dim=dims, dtype=torch.float64).div_(count)
        if mean.dtype == torch.float64:
            mean_error = torch_ops.residual_mean(x, mean)
    return ReplicaStats(x, mean, m2, count, _Link(x.dtype), precise_mean, mean_error)


def local_channel_stats(x: torch.Tensor, backend: Backend
                        ) -> tuple[torch.Tensor, torch.Tensor, int]:
    """A replica's ``(mean, M2, count)``: ``backend``'s, or in float64 by ATen's ops where so
    few values that the whole synchronised batch may compute in it (``computes_in`` judges
    the global count, which is at least this one)."""
    wide = computes_in(x.dtype, x.numel() // max(x.shape[1], 1), x.device)
    return _ops(x, wide, backend).channel_stats(_widened(x, wide))


# MergeReplicas.forward's arguments before the replicas' inputs.
_MERGE_LEADING_ARGS = 6


class MergeReplicas(torch.autograd.Function):
    """``(x_1..x_k) -> (mean[C], M2[C], invstd[C], error[C])`` of their union
    (``stats.chan_merge``; ``error``: the merged mean's, the exact mean less it, where the
    replicas bring theirs, ``errors``, in float64, or bring float32 inputs' means in float64,
    else None; not differentiable).

    The statistics come precomputed (``means``, ``m2s``, on the merge's device); the inputs
    are there so that autograd brings the merge's backward each replica's input gradient to
    write (see the module docstring). Its per-channel tensors are ctx attributes, not saved
    tensors: see ``stats``.
    """

    @staticmethod
    def forward(ctx, counts: stats._Counts, eps: float, links: list[_Link],
                means: list[torch.Tensor], m2s: list[torch.Tensor],
                errors: list[torch.Tensor] | None, *xs: torch.Tensor):
        # In float64 (see replica_stats), returned in the replicas' statistics dtype.
        merged = stats.chan_merge(means, m2s, counts, eps, errors)
        dtype = computes_in(xs[0].dtype, int(counts.total), xs[0].device)
        mean, m2, invstd = (t.to(dtype) for t in merged[:3])
        # The merged mean's error (``_mean_offset``): no function of x autograd should see.
        error = None
        if merged.error is not None and dtype == torch.float64:
            error = merged.error
        elif xs[0].dtype == torch.float32 and dtype == torch.float32:
            # float32 replicas bring their means in float64 (``replica_stats``): the merged
            # mean's error is its rounding to float32. Always known, for a merge that follows
            # (a nested call's outer one, the processes'); the replicas take it out of xhat
            # only far from 0 (``exchange.Exchange._merge``).
            error = (merged.mean - mean.to(merged.mean.dtype)).to(dtype)
        if error is not None:
            ctx.mark_non_differentiable(error)
        ctx.links, ctx.total = links, counts.total
        # For a backward that recomputes the merge (see _merge_backward_composite).
        ctx.counts, ctx.eps, ctx.means, ctx.m2s = counts, eps, means, m2s
        ctx.inputs = None
        # Detached aliases: an output kept on its own ctx would close a reference cycle
        # through its grad_fn that Python's collector cannot see, keeping the whole graph.
        ctx.mean, ctx.invstd, ctx.error = mean.detach(), invstd.detach(), error
        ctx.set_materialize_grads(False)
        return mean, m2, invstd, error

    @staticmethod
    def backward(ctx, grad_mean, grad_m2, grad_invstd, _grad_error):
        needed = ctx.needs_input_grad[_MERGE_LEADING_ARGS:]
        create_graph = torch.is_grad_enabled()
        # A float64 call over few values: every replica's input gradient in double-double,
        # taken for the whole batch (``whole_batch``); under create_graph, its value.
        batch = ctx.links[0].batch
        exact = (batch.grads(ctx.links, create_graph)
                 if batch is not None and all(needed) else None)
        if exact is not None and not create_graph:
            for link in ctx.links:
                link.clear()  # free y and dy as soon as dx exists
            return (None,) * _MERGE_LEADING_ARGS + tuple(exact)
        direct = [link.direct_grad for link in ctx.links]
        # Recomputed: every replica under create_graph; otherwise those whose NormAct has not
        # run in this pass (a gradient penalty's backward reaching the merge through the
        # statistics' history), from the inputs a create_graph pass kept.
        recomputed = [need and (create_graph or link.saved is None)
                      for link, need in zip(ctx.links, needed)]
        grads = (_merge_backward_composite(ctx, grad_mean, grad_m2, grad_invstd, recomputed)
                 if any(recomputed) else [None] * len(ctx.links))
        if exact is not None:
            return (None,) * _MERGE_LEADING_ARGS + tuple(
                _exactly(grad, value) for grad, value in zip(grads, exact))
        if create_graph:  # the value the replicas' NormActs left here (see _norm_act_grads)
            grads = [grad if own is None else grad + own for grad, own in zip(grads, direct)]
        grad_m2 = stats.total_grad_m2(grad_m2, grad_invstd, ctx.invstd, ctx.total)
        # Per device: the replicas of one call all normalised with the same statistics.
        coefficients: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
        for i, link in enumerate(ctx.links):
            if not needed[i] or recomputed[i]:
                continue
            saved = link.saved
            # The replica's NormAct.backward ran on its forward's stream, which need not be
            # this node's: read what it left only after it.
            wait_for(link.ready, (saved.tensor, link.grad_output))
            device = saved.mean.device
            if device not in coefficients:
                coefficients[device] = _through_statistics(
                    grad_mean, grad_m2, ctx.mean, ctx.total, saved, ctx.error
                )
            grads[i] = _input_grad(saved, link.grad_output, link.config,
                                   DxCoefs(link.scale, *coefficients[device]),
                                   _params(saved, link.config),
                                   _ops(saved.tensor, saved.mean.dtype))
            link.clear()  # free y and dy as soon as dx exists
        return (None,) * _MERGE_LEADING_ARGS + tuple(grads)


def _exactly(grad: torch.Tensor, value: torch.Tensor | float) -> torch.Tensor:
    """``grad`` (a create_graph backward's, carrying its graph) with the value ``value``
    exactly: the first derivative exact (double-double), the second autograd's. (Adding
    ``value - grad`` would round at the size of grad, a term larger than the gradient.)"""
    return (grad - grad.detach()) + value


def _merge_backward_composite(ctx, grad_mean, grad_m2, grad_invstd, recomputed: list[bool]
                              ) -> list[torch.Tensor | None]:
    """The input gradients of the ``recomputed`` replicas, as autograd's gradient of the merge
    recomputed from their inputs in differentiable ATen ops (``stats.chan_merge``; the other
    replicas' statistics are constants there: partial derivatives).

    Under ``create_graph`` (the gradients then carry their graph) the inputs come from the
    links (an out-of-place NormAct saves x), and are kept on ctx for a later backward that
    reaches the merge without passing through the replicas' NormAct (a gradient penalty's).
    """
    create_graph = torch.is_grad_enabled()
    inputs = list(ctx.inputs) if ctx.inputs is not None else [None] * len(ctx.links)
    for i, link in enumerate(ctx.links):
        if recomputed[i] and create_graph and link.saved is not None:
            if link.config.inplace:
                raise _no_double_backward_in_place(link.config.layer)
            wait_for(link.ready, (link.saved.tensor,))  # see MergeReplicas.backward
            inputs[i] = link.saved.tensor
        if recomputed[i] and inputs[i] is None:
            raise RuntimeError(
                "SyncBatchNorm: a replica's input gradient needs its normalisation's "
                "backward first; differentiate through every replica's output"
            )
    if create_graph:
        ctx.inputs = inputs
    means, m2s = list(ctx.means), list(ctx.m2s)
    device, merge_dtype = means[0].device, means[0].dtype
    sources = {}
    with torch.enable_grad():
        for i, x in enumerate(inputs):
            if not recomputed[i] or x.numel() == 0:  # an empty batch: nothing to differentiate
                continue
            source = x if create_graph else x.detach().requires_grad_()
            wide = on_device(source, device).to(merge_dtype)
            dims = [0, *range(2, x.dim())]
            means[i] = wide.mean(dims)
            m2s[i] = (wide - _channel_view(means[i], wide)).square().sum(dims)
            sources[i] = source
        merged = stats.chan_merge(means, m2s, ctx.counts, ctx.eps)
        pairs = [(out.to(grad.dtype), grad)
                 for out, grad in zip(merged[:3], (grad_mean, grad_m2, grad_invstd))
                 if grad is not None]
        found = (torch.autograd.grad([o for o, _ in pairs], list(sources.values()),
                                     [g for _, g in pairs], create_graph=create_graph,
                                     allow_unused=True)
                 if pairs and sources else [None] * len(sources))
    grads: list[torch.Tensor | None] = [None] * len(inputs)
    for i, x in enumerate(inputs):
        if recomputed[i]:
            grads[i] = torch.zeros_like(x)
            ctx.links[i].clear()
    for (i, _), grad in zip(sources.items(), found):
        if grad is not None:
            grads[i] = grad
    return grads


def _through_statistics(grad_mean, grad_m2, mean, total: float, saved: _Saved,
                        error: torch.Tensor | None = None):
    """``(coef_xhat, coef_const)`` on ``saved``'s device, for the statistics' part of dx::

        g_mean / n + 2 g_M2 (x - mean) = coef_xhat * xhat + coef_const,
        xhat = (x - saved.mean) * saved.invstd,
        coef_xhat = 2 g_M2 / saved.invstd,  coef_const = g_mean / n + 2 g_M2 (saved.mean - mean)

    ``saved`` holds the statistics the replica normalised with: the merged ones, unless a
    cross-process merge or a nested call's outer one followed this one. ``error``: ``mean``'s
    (``merge_replicas``; None: not known), with the xhat and means taken exact
    (``_mean_gap``). Tensor-tensor calls: ATen first copies a Python number operand
    (``g * 2``) into a tensor, which costs more than the arithmetic.
    """
    device = saved.mean.device
    if grad_m2 is None:
        coef_xhat = coef_const = torch.zeros_like(saved.mean)
    else:
        grad_m2 = on_device(grad_m2, device)
        twice_grad_m2 = grad_m2 + grad_m2
        coef_xhat = _from_xhat_units(twice_grad_m2, saved.invstd)
        coef_const = twice_grad_m2 * _mean_gap(saved, mean, error)
    if grad_mean is not None:
        coef_const = torch.add(coef_const, on_device(grad_mean, device),
                               alpha=1 / max(total, 1.0))
    return coef_xhat, coef_const


def _mean_gap(saved: _Saved, mean: torch.Tensor, error: torch.Tensor | None
              ) -> torch.Tensor:
    """The exact mean ``saved`` normalised with less the exact ``mean`` (``error``: its
    error), on ``saved``'s device: ``saved.mean - mean`` plus their errors where both are
    known (``_mean_offset``).

    Why: where a later merge gave the replica other statistics (a nested call's outer merge,
    the processes'), the two means round apart, and the gap multiplies 2 g_M2 in every
    element of the channel: at |mean| a thousand standard deviations, hundreds of ulps of
    that term."""
    device = saved.mean.device
    gap = saved.mean - on_device(mean, device)
    if saved.offset is None or error is None:
        return gap
    return gap.add_(_from_xhat_units(saved.offset, saved.invstd)).sub_(on_device(error, device))


# The smallest positive number of each statistics dtype (a subnormal).
_SMALLEST = {dtype: torch.finfo(dtype).tiny * torch.finfo(dtype).eps
             for dtype in (torch.float32, torch.float64)}


def _from_xhat_units(v: torch.Tensor, invstd: torch.Tensor) -> torch.Tensor:
    """``v / invstd`` for a per-channel ``v`` taken in units of xhat (a multiple of invstd),
    0 where invstd is 0: a variance that overflows (float64 values beyond about 1e154)
    makes invstd 0, as nn.BatchNorm2d's, and xhat 0 with it; there v is 0 too, and so is
    nn.BatchNorm2d's gradient through the statistics, where 0 / 0 would make it NaN.
    Dividing by the dtype's smallest positive number in place of 0 keeps it 0 in one op;
    every other invstd, NaN too, divides as it is."""
    return v / invstd.clamp_min(_SMALLEST[invstd.dtype])


def merge_replicas(replicas: Sequence[ReplicaStats], eps: float
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The merged ``(mean, M2, invstd, error)`` of ``replicas``, on the first one's device,
    in their statistics dtype; merged in float64 (per-channel vectors: cheap). ``error``:
    the merged mean's (the exact mean less it: ``_mean_offset``), where every replica brings
    its own (``ReplicaStats.mean_error``) or its float32 input's mean in float64
    (``ReplicaStats.precise_mean``); else None."""
    device, wide = replicas[0].mean.device, torch.float64
    counts = stats.counts_of([r.count for r in replicas], device, wide)
    errors = (None if any(r.mean_error is None for r in replicas)
              else [on_device(r.mean_error, device) for r in replicas])
    return MergeReplicas.apply(
        counts, eps, [r.link for r in replicas],
        [on_device(r.mean if r.precise_mean is None else r.precise_mean, device).to(wide)
         for r in replicas],
        [on_device(r.m2, device).to(wide) for r in replicas], errors,
        *(r.x for r in replicas),
    )


class Part:
    """One part of a nested calls' merge (``MergeParts``): a nested call's merged statistics,
    or those of the replicas merged beside them. Holds what its input gradient through
    ``(mean, M2)`` needs, and the gradients of them that a backward brings through an earlier
    create_graph backward's graph (``_ReadParts``; None: none)."""

    __slots__ = ("count", "mean", "read_grads")

    def __init__(self, count: int, mean: torch.Tensor) -> None:
        self.count = count
        self.mean = mean  # detached
        self.read_grads: tuple[torch.Tensor | None, torch.Tensor | None] | None = None

    def clear(self) -> None:
        self.read_grads = None

    def input_grad(self, x: torch.Tensor) -> torch.Tensor | None:
        """The gradient, at ``x`` (one replica's input, a share of the part's values), of
        the read gradients (``read_grads``): ``g_mean / n + 2 g_M2 (x - mean)``, n the part's
        count; None: none read."""
        if self.read_grads is None:
            return None
        grad_mean, grad_m2 = (None if g is None else _channel_view(on_device(g, x.device), x)
                              for g in self.read_grads)
        grad = torch.zeros_like(x)
        if grad_mean is not None:
            grad += grad_mean / self.count
        if grad_m2 is not None:
            grad += 2 * grad_m2 * (x - _channel_view(on_device(self.mean, x.device), x))
        return grad


class MergeParts(torch.autograd.Function):
    """``(mean_1..mean_k, M2_1..M2_k) -> (mean, M2, invstd, error)`` of nested calls' merged
    statistics (``stats.chan_merge``, as ``MergeReplicas``; ``errors``: the parts' mean
    errors, or None).

    A Function, not ATen ops, for a float64 call's double-double input gradient
    (``whole_batch``) after a create_graph backward: that backward's graph reads the parts'
    statistics through ``_ReadParts`` alone, which records what a later backward brings them
    that way (a gradient penalty's share); the share that comes through the merge's outputs
    the merge's own backward passes on, and ``whole_batch`` takes it from the replicas'
    inputs and dy. In ATen ops the two would reach the parts summed.
    """

    @staticmethod
    def forward(ctx, counts: stats._Counts, eps: float, errors: list[torch.Tensor] | None,
                parts: list[Part], *means_and_m2s: torch.Tensor):
        k = len(parts)
        merged = stats.chan_merge(means_and_m2s[:k], means_and_m2s[k:], counts, eps, errors)
        if merged.error is not None:
            ctx.mark_non_differentiable(merged.error)
        ctx.save_for_backward(*means_and_m2s)
        ctx.counts, ctx.eps, ctx.errors, ctx.parts = counts, eps, errors, parts
        ctx.set_materialize_grads(False)
        return merged.mean, merged.m2, merged.invstd, merged.error

    @staticmethod
    def backward(ctx, grad_mean, grad_m2, grad_invstd, _grad_error):
        create_graph, k = torch.is_grad_enabled(), len(ctx.parts)
        inputs = ctx.saved_tensors
        with torch.enable_grad():
            sources = (_ReadParts.apply(ctx.parts, *inputs) if create_graph
                       else [t.detach().requires_grad_() for t in inputs])
            merged = stats.chan_merge(sources[:k], sources[k:], ctx.counts, ctx.eps,
                                      ctx.errors)
            pairs = [(out, grad) for out, grad in zip(merged[:3], (grad_mean, grad_m2,
                                                                   grad_invstd))
                     if grad is not None]
            grads = (torch.autograd.grad([o for o, _ in pairs], sources,
                                         [g for _, g in pairs], create_graph=create_graph,
                                         allow_unused=True)
                     if pairs else (None,) * len(sources))
        return (None,) * 4 + tuple(grads)


class _ReadParts(torch.autograd.Function):
    """The parts' ``(mean_1..mean_k, M2_1..M2_k)`` as a create_graph backward of
    ``MergeParts`` reads them (identity): its backward records in each ``Part`` the
    gradients a later backward brings them through that graph, and passes them on."""

    @staticmethod
    def forward(ctx, parts: list[Part], *means_and_m2s: torch.Tensor):
        ctx.parts = parts
        ctx.set_materialize_grads(False)
        return tuple(t.view_as(t) for t in means_and_m2s)

    @staticmethod
    def backward(ctx, *grads):
        k = len(ctx.parts)
        for part, grad_mean, grad_m2 in zip(ctx.parts, grads[:k], grads[k:]):
            _record_read(part, grad_mean, grad_m2)
        return (None, *grads)


def merge_parts(means: Sequence[torch.Tensor], m2s: Sequence[torch.Tensor],
                counts: Sequence[int], links: Sequence[Sequence[_Link]], eps: float,
                errors: list[torch.Tensor] | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The merged ``(mean, M2, invstd, error)`` of nested calls' statistics (and of the
    replicas merged beside them), float64, on the first mean's device (``error``: the merged
    mean's, where ``errors`` gives the parts'); ``links[j]``, the replicas behind part j,
    learn their part (``_Link.parts``)."""
    device = means[0].device
    parts = [Part(count, mean.detach()) for count, mean in zip(counts, means)]
    for part, part_links in zip(parts, links):
        for link in part_links:
            link.parts.append(part)
    return MergeParts.apply(stats.counts_of(list(counts), device, torch.float64), eps, errors,
                            parts, *means, *m2s)


def on_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` on ``device``; no call into torch when it is there already."""
    return t if t.device == device else t.to(device)


def track_batch(running: RunningStats | None, mean: torch.Tensor | None,
                m2: torch.Tensor | None, count: int) -> None:
    """Count the batch and fold it into ``running`` (nothing when None: not tracked; see
    ``torch_ops.track_batch``)."""
    if running is not None:
        torch_ops.track_batch(*running, mean, m2, count)


def batch_norm_act(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float, config: ActConfig,
    running: RunningStats | None = None, channels_aside: ChannelsAside | None = None,
    recomputing: bool = False, count: int | None = None, check: GammaCheck | None = None,
) -> torch.Tensor:
    """Normalise ``x`` with its own batch statistics, folded into ``running`` on the way;
    ``config``: as the call computes (``inplace_policy.plan_call``); ``count``: x's values
    per channel, where the caller knows them.

    In place, the channels kept aside come from ``channels_aside`` (None: read now, with a
    device sync), given the flags of ``check`` (``CallPlan.check``), which rides on the launch
    that finishes the statistics; ``recomputing``: a checkpoint's recomputation, which keeps
    the original call's channels.
    """
    if count is None:
        count = x.numel() // x.shape[1]
    wide = computes_in(x.dtype, count, x.device)
    return widened_batch_norm_act(x, _widened(x, wide), _ops(x, wide), weight, bias, eps,
                                  config, running, channels_aside, recomputing, count, check)


def widened_batch_norm_act(
    x: torch.Tensor, widened: torch.Tensor, backend: Backend, weight: torch.Tensor,
    bias: torch.Tensor, eps: float, config: ActConfig, running: RunningStats | None,
    channels_aside: ChannelsAside | None, recomputing: bool, count: int,
    check: GammaCheck | None,
) -> torch.Tensor:
    """``batch_norm_act`` once the call's dtype is chosen: ``widened``, x as its statistics
    read it (``_widened``), and ``backend``, the ops computing in that dtype (``_ops``); a
    repeat call whose key computes in x's own statistics dtype knows both without asking
    (``call_memo``)."""
    mean, invstd, flags = backend.batch_stats(widened, eps, running, check)
    kept = None
    if config.inplace:
        if channels_aside is None:
            channels_aside = ChannelsAside()
        kept = channels_aside.index(weight, bias, recomputing, flags,
                                    None if running is None else (running.var, eps))
    offset = _mean_offset(widened, mean, invstd)
    return BatchNormAct.apply(x, weight, bias,
                              (mean, invstd, count, config, kept, eps, backend, offset))


def synced_batch_norm_act(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    config: ActConfig,
    exchange: Callable[[torch.Tensor], Exchanged],
    kept: torch.Tensor | None = None,
) -> torch.Tensor:
    """Normalise ``x`` with statistics merged across replicas by ``exchange``.

    ``exchange(x)`` meets x's statistics (``replica_stats``) with the other replicas' and
    answers the global ones (``Exchanged``), whose count ``inplace_policy.for_count`` judges;
    in a checkpoint's recomputation it is the layer's memory of the original call
    (``RecomputeCache.replay``). ``config`` and ``kept``: as ``inplace_policy.plan_call``
    decided them.
    """
    mean, invstd, total, link, offset = exchange(x)
    if link is not None:
        link.total = total
    if config.inplace:
        config = inplace_policy.for_count(config, total, x.dtype)
        kept = kept if config.inplace else None
    return NormAct.apply(x, mean, invstd, weight, bias, config, link, kept,
                         None if offset is None else on_device(offset, x.device))


def normalize_running(
    x: torch.Tensor,
    running_mean: torch.Tensor,
    running_var: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    bias: torch.Tensor,
    config: ActConfig,
    kept: torch.Tensor | None = None,
) -> torch.Tensor:
    """Normalise with the running statistics (evaluation): ``invstd`` is derived in the same
    pass as the output (``Backend.normalize_running``). ``config`` and ``kept``: as
    ``inplace_policy.plan_call`` decided them."""
    return RunningNormAct.apply(x, running_mean, running_var, weight, bias, config, kept, eps)
