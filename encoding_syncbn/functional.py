"""The layer's autograd Functions: one-pass forward, one-pass-per-reduction backward.

Notation (per channel; see ``kernels/torch_ops.py``)::

    z = (x - mean) * invstd * w + b,   y = act(z),   dz = dy * act'(z),   xhat = (z - b) / w

Training with the whole batch on one replica (``BatchNormAct``): with n elements a channel::

    dx = w * invstd * (dz - sum(dz) / n - xhat * sum(dz * xhat) / n)

Synchronised training splits that in three Functions, so that autograd itself carries the
cross-replica terms through the master's merge (``stats.MergeStats``), and backward never
waits for another replica:

    LocalStats(x_i) -> (mean_i, M2_i)  ...merge on the master...  NormAct(x_i, mean, invstd)

``NormAct.backward`` returns the gradients of mean, invstd, w and b but none for x; it leaves
what it read in a ``_Link`` for ``LocalStats.backward``, which autograd runs after it (through
the merge) and which writes the whole input gradient in one pass:

    dx = w * invstd * dz + dmean_i / n_i + 2 * (x - mean_i) * dM2_i

In place, only y is kept: x, z and xhat are rebuilt from it. Channels whose |w| is too small
to divide by (zero-initialised residual BNs) keep their input aside instead, so every sign and
value of gamma gets exact gradients.
"""

from __future__ import annotations

import functools
from typing import Callable, NamedTuple

import torch

from .kernels import compile_ops, ops_for, reference_ops

# A channel is rebuilt from y only if |w| > _MIN_INVERTIBLE_GAMMA * max(1, |b|): xhat =
# (z - b) / w amplifies z's rounding by |b| / |w|.
_MIN_INVERTIBLE_GAMMA = 1e-3


class ActConfig(NamedTuple):
    """The activation fused after the normalisation, and whether it overwrites its input.

    ``aside``: the channels to keep aside in place (see ``small_gamma_channels``) when they
    are known in advance, as host ints; None: look them up at each call.
    """

    activation: str
    slope: float
    inplace: bool
    aside: tuple[int, ...] | None = None


class _Saved(NamedTuple):
    """What backward reads: x or y, the per-channel vectors and the channels kept aside."""

    tensor: torch.Tensor
    mean: torch.Tensor
    invstd: torch.Tensor
    weight: torch.Tensor
    bias: torch.Tensor
    aside_channels: torch.Tensor
    aside_input: torch.Tensor


class _Link:
    """Hands what ``NormAct.backward`` read to ``LocalStats.backward`` of the same call."""

    __slots__ = ("saved", "grad_output", "config", "scale")

    def __init__(self) -> None:
        self.saved: _Saved | None = None
        self.grad_output: torch.Tensor | None = None
        self.config: ActConfig | None = None
        self.scale: torch.Tensor | None = None  # weight * invstd


def _small_gamma(weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """The channels' indices whose output cannot be inverted: ``(k,)``, sized by the data."""
    with torch.no_grad():
        small = weight.abs() <= bias.abs().clamp_min_(1.0).mul_(_MIN_INVERTIBLE_GAMMA)
        return small.nonzero().view(-1)


def small_gamma_channels(weight: torch.Tensor | None, bias: torch.Tensor | None
                         ) -> tuple[int, ...]:
    """The channels an in-place layer with these parameters keeps aside, as host ints.

    On a GPU this reads the parameters back (one device-to-host copy): ``SyncBatchNorm`` does
    it once per ``replicate()`` on the original parameters, so that its replicas need none.
    """
    if weight is None:  # affine=False: gamma is 1 everywhere
        return ()
    bias = torch.zeros_like(weight) if bias is None else bias
    return tuple(_small_gamma(weight, bias).tolist())


def _aside_channels(weight: torch.Tensor, bias: torch.Tensor, config: ActConfig):
    """Indices of the channels that cannot be rebuilt from the output (none out of place).

    Chosen before the autograd Function runs, and passed to it: while compiling, their number
    is a data-dependent (unbacked) size, which must be bound outside the Function's forward.
    Looking them up costs a device-to-host copy, unless ``config.aside`` already tells.
    """
    if not config.inplace:
        return _nothing(torch.long, weight.device)
    if torch.compiler.is_compiling():
        # A custom op of data-dependent size: Dynamo would refuse nonzero itself.
        return compile_ops.aside_channels(weight.detach(), bias.detach(), _MIN_INVERTIBLE_GAMMA)
    if config.aside is not None:
        return _channel_index(config.aside, weight.device)
    return _small_gamma(weight, bias)


@functools.lru_cache(maxsize=64)
def _nothing(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An empty tensor: no channels, or no inputs kept aside (shared: nothing writes to it)."""
    return torch.empty(0, dtype=dtype, device=device)


@functools.lru_cache(maxsize=256)
def _channel_index(channels: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """``channels`` as an index tensor on ``device``, built once (shared: read only)."""
    if not channels:
        return _nothing(torch.long, device)
    return torch.tensor(channels, dtype=torch.long, device=device)


def _keeps_aside(config: ActConfig, aside_channels: torch.Tensor) -> bool:
    """Whether the layer keeps channels aside: saves their input, recomputes their backward.

    Eagerly: whether there are any. While compiling their number is data-dependent, so the
    aside path (which handles none) is traced whenever the layer is in place.
    """
    if torch.compiler.is_compiling():
        return config.inplace
    return aside_channels.numel() > 0


def _overwrites_input(config: ActConfig) -> bool:
    """Whether the autograd Function itself writes its output over its input.

    Not while compiling: AOTAutograd mis-routes the gradient of an autograd.Function that
    overwrites (``mark_dirty``) a graph input (torch 2.13: the input's gradient bypasses the
    Function). There the Function writes a fresh tensor, still keeping only the output for
    backward, and ``_written_back`` copies it over the input, which functionalization turns
    back into a plain reuse when the input is an intermediate of the compiled graph.
    """
    return config.inplace and not torch.compiler.is_compiling()


def _written_back(x: torch.Tensor, out: torch.Tensor, config: ActConfig) -> torch.Tensor:
    """The layer's result: ``out``, copied over ``x`` where the Function could not do so."""
    if config.inplace and torch.compiler.is_compiling():
        return x.copy_(out)
    return out


def _normalize(ctx, x, mean, invstd, weight, bias, config: ActConfig, aside_channels
               ) -> torch.Tensor:
    """Run the forward pass, in place or not, and save what backward needs."""
    if _keeps_aside(config, aside_channels):
        aside_input = x.index_select(1, aside_channels)
    else:
        aside_input = _nothing(x.dtype, x.device)
    out = x if _overwrites_input(config) else torch.empty_like(x)
    ops_for(x).normalize_act(
        x, mean, invstd, weight, bias, config.activation, config.slope, out
    )
    if _overwrites_input(config):
        ctx.mark_dirty(x)
    ctx.save_for_backward(
        out if config.inplace else x, mean, invstd, weight, bias, aside_channels, aside_input
    )
    ctx.config = config
    return out


def _aside_args(saved: _Saved, grad_output: torch.Tensor, config: ActConfig):
    """The ``reference_ops`` arguments that recompute the channels kept aside from their input."""
    idx = saved.aside_channels
    return (
        saved.aside_input,
        grad_output.index_select(1, idx),
        saved.mean[idx],
        saved.invstd[idx],
        saved.weight[idx],
        saved.bias[idx],
        config.activation,
        config.slope,
        False,
    )


def _reduce(saved: _Saved, grad_output: torch.Tensor, config: ActConfig):
    """Per-channel ``(sum(dz), sum(dz * xhat))``."""
    from_output = config.inplace
    sum_dz, sum_dz_xhat = ops_for(saved.tensor).backward_reduce(
        saved.tensor, grad_output, saved.mean, saved.invstd, saved.weight, saved.bias,
        config.activation, config.slope, from_output,
    )
    if _keeps_aside(config, saved.aside_channels):
        exact_dz, exact_dz_xhat = reference_ops().backward_reduce(
            *_aside_args(saved, grad_output, config)
        )
        sum_dz = sum_dz.index_copy(0, saved.aside_channels, exact_dz)
        sum_dz_xhat = sum_dz_xhat.index_copy(0, saved.aside_channels, exact_dz_xhat)
    return sum_dz, sum_dz_xhat


def _input_grad(saved: _Saved, grad_output, config: ActConfig, coef_dz, coef_xhat, coef_const):
    """``dx = coef_dz * dz + coef_xhat * xhat + coef_const`` in one pass."""
    dx = ops_for(saved.tensor).backward_dx(
        saved.tensor, grad_output, saved.mean, saved.invstd, saved.weight, saved.bias,
        config.activation, config.slope, config.inplace, coef_dz, coef_xhat, coef_const,
    )
    idx = saved.aside_channels
    if _keeps_aside(config, saved.aside_channels):
        exact = reference_ops().backward_dx(
            *_aside_args(saved, grad_output, config), coef_dz[idx], coef_xhat[idx], coef_const[idx]
        )
        dx.index_copy_(1, idx, exact)
    return dx


def _param_grads(needs_weight: bool, needs_bias: bool, sum_dz, sum_dz_xhat):
    """``dw = sum(dz * xhat)``, ``db = sum(dz)``, where autograd asks for them."""
    return (sum_dz_xhat if needs_weight else None), (sum_dz if needs_bias else None)


class BatchNormAct(torch.autograd.Function):
    """Training on one replica's whole batch: ``(x, mean, invstd, w, b) -> y``.

    ``mean`` and ``invstd`` must be x's own batch statistics: the backward includes their
    dependence on x and returns no gradient for them. (The Function returns y alone: one that
    overwrites a view may not return a second tensor.)
    """

    @staticmethod
    def forward(ctx, x, mean, invstd, weight, bias, config: ActConfig, aside_channels):
        ctx.count = x.numel() // x.shape[1]
        return _normalize(ctx, x, mean, invstd, weight, bias, config, aside_channels)

    @staticmethod
    def backward(ctx, grad_output):
        saved = _Saved(*ctx.saved_tensors)
        sum_dz, sum_dz_xhat = _reduce(saved, grad_output, ctx.config)
        grad_input = None
        if ctx.needs_input_grad[0]:
            scale = saved.weight * saved.invstd
            per_element = scale * (-1.0 / ctx.count)
            grad_input = _input_grad(
                saved, grad_output, ctx.config,
                scale, per_element * sum_dz_xhat, per_element * sum_dz,
            )
        grad_weight, grad_bias = _param_grads(*ctx.needs_input_grad[3:5], sum_dz, sum_dz_xhat)
        return grad_input, None, None, grad_weight, grad_bias, None, None


class NormAct(torch.autograd.Function):
    """``y = act((x - mean) * invstd * w + b)`` with given statistics.

    With a ``link`` (synchronised training), the input gradient is left to ``LocalStats``;
    without one (evaluation: constant statistics) it is ``w * invstd * dz``.
    """

    @staticmethod
    def forward(ctx, x, mean, invstd, weight, bias, config: ActConfig, link: _Link | None,
                aside_channels):
        ctx.link = link
        return _normalize(ctx, x, mean, invstd, weight, bias, config, aside_channels)

    @staticmethod
    def backward(ctx, grad_output):
        saved = _Saved(*ctx.saved_tensors)
        config = ctx.config
        sum_dz, sum_dz_xhat = _reduce(saved, grad_output, config)
        scale = saved.weight * saved.invstd
        grad_input = grad_mean = grad_invstd = None
        if ctx.link is not None:
            link = ctx.link
            link.saved, link.grad_output, link.config, link.scale = (
                saved, grad_output, config, scale
            )
        elif ctx.needs_input_grad[0]:
            zeros = torch.zeros_like(scale)
            grad_input = _input_grad(saved, grad_output, config, scale, zeros, zeros)
        if ctx.needs_input_grad[1]:
            grad_mean = -scale * sum_dz
        if ctx.needs_input_grad[2]:
            grad_invstd = saved.weight * sum_dz_xhat / saved.invstd
        return (
            grad_input, grad_mean, grad_invstd,
            *_param_grads(*ctx.needs_input_grad[3:5], sum_dz, sum_dz_xhat), None, None, None,
        )


class LocalStats(torch.autograd.Function):
    """``x_i -> (mean_i, M2_i)`` of one replica; its backward writes the whole ``dx``."""

    @staticmethod
    def forward(ctx, x, link: _Link):
        mean, m2, count = ops_for(x).channel_stats(x)
        # ctx attributes, not saved tensors: a checkpoint recompute must save exactly what
        # NormAct saves, and these per-channel vectors are tiny.
        ctx.link, ctx.mean, ctx.count = link, mean, count
        return mean, m2

    @staticmethod
    def backward(ctx, grad_mean, grad_m2):
        link = ctx.link
        if link.saved is None:
            raise RuntimeError(
                "SyncBatchNorm: the input gradient needs the normalisation's backward first; "
                "differentiate through the layer's output"
            )
        saved, grad_output, config, scale = link.saved, link.grad_output, link.config, link.scale
        link.saved = link.grad_output = None  # free y and dy as soon as dx exists
        # Tensor-tensor calls only: ATen first copies a Python number operand (grad * 2,
        # grad / n) into a tensor, which costs more than the arithmetic on C values.
        twice_grad_m2 = grad_m2 + grad_m2
        grad_input = _input_grad(
            saved, grad_output, config,
            scale,
            twice_grad_m2 / saved.invstd,
            torch.add(twice_grad_m2 * (saved.mean - ctx.mean), grad_mean,
                      alpha=1 / max(ctx.count, 1)),
        )
        return grad_input, None


def batch_norm_act(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float, config: ActConfig
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Normalise ``x`` with its own batch statistics; also returns them as ``(mean, M2)``."""
    with torch.no_grad():
        mean, m2, count = ops_for(x).channel_stats(x)
        invstd = torch.rsqrt(m2 / count + eps)
    aside = _aside_channels(weight, bias, config)
    out = BatchNormAct.apply(x, mean, invstd, weight, bias, config, aside)
    return _written_back(x, out, config), mean, m2


def synced_batch_norm_act(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    config: ActConfig,
    exchange: Callable[[torch.Tensor, torch.Tensor, int], tuple[torch.Tensor, torch.Tensor]],
) -> torch.Tensor:
    """Normalise ``x`` with statistics merged across replicas by ``exchange``.

    ``exchange(mean_i, M2_i, count_i)`` returns the global ``(mean, invstd)`` on x's device,
    still attached to the autograd graph of the merge.
    """
    link = _Link()
    mean_i, m2_i = LocalStats.apply(x, link)
    count_i = x.numel() // x.shape[1]
    mean, invstd = exchange(mean_i, m2_i, count_i)
    aside = _aside_channels(weight, bias, config)
    out = NormAct.apply(x, mean, invstd, weight, bias, config, link, aside)
    return _written_back(x, out, config)


def normalize_with(
    x: torch.Tensor,
    mean: torch.Tensor,
    invstd: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    config: ActConfig,
) -> torch.Tensor:
    """Normalise with fixed statistics (evaluation, or a recompute reusing global ones)."""
    aside = _aside_channels(weight, bias, config)
    out = NormAct.apply(x, mean, invstd, weight, bias, config, None, aside)
    return _written_back(x, out, config)
