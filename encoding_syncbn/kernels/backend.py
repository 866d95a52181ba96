"""The backend protocol: the layer's ops behind one typed signature.

A backend computes, per channel, what ``torch_ops`` (the reference) documents::

    channel_stats(x)                                -> (mean, M2, count)
    batch_stats(x, eps, running, check)
                    -> (mean, invstd, small-gamma flags); running stats updated
    normalize_act(x, params, out)                   out = act((x - mean) * invstd * weight + bias)
    normalize_running(x, running, out)
                    -> (mean, invstd): normalize_act from the running statistics,
                       invstd = 1 / sqrt(running.var + running.eps) (evaluation, in one pass)
    backward_reduce(saved, dy, params, saved_is_output) -> (sum(dz), sum(dz * xhat))
    backward_dx(saved, dy, params, saved_is_output, coefs)
                                    dx = coefs.dz * dz + coefs.xhat * xhat + coefs.const
    batch_backward(saved, dy, params, saved_is_output, count, overwrite_saved)
                    -> (dx, sum(dz), sum(dz * xhat)): backward_reduce, then backward_dx
                       from BatchSums(sum(dz), sum(dz * xhat), count), in one call;
                       overwrite_saved: nothing reads saved afterwards (its memory is
                       the call's scratch; asked only of a backend that
                       ``scratches_saved``)

``params`` bundles what every op but the statistics needs (:class:`NormParams`), ``coefs`` the
backward's per-channel coefficients (:class:`DxCoefs`, or :class:`BatchSums` from which a
backend derives them: the Triton kernel does so per channel, with no ATen call on the host).
``running`` is :class:`RunningParams`. These NamedTuples are each op's arguments, defined here
once: every backend takes them as they are, and where ``torch.library`` needs flat arguments
``custom_ops`` derives the op's schema from their fields.

``batch_stats`` records no autograd history (the statistics are no function of x autograd
should see: the layer's backward differentiates through them itself), whatever the grad mode it
is called under: a backend that computes them in differentiable ops does so without grad.

Every per-channel vector a backend is handed (in ``NormParams``, ``DxCoefs``, ``BatchSums``,
``GammaCheck``, ``RunningParams``' weight and bias) is a contiguous (C,) tensor in the
statistics dtype: the caller makes it so once (:func:`channel_vector`), not every op at every
call. ``RunningStats`` (and ``RunningParams``' mean and variance) are the layer's own buffers,
in whatever dtype and strides they have.
A backend is a table of ops given to ``custom_ops.OpsBackend``; a test double is one class
implementing :class:`Backend`.
"""

from __future__ import annotations

from typing import NamedTuple, Protocol

import torch

from . import double_double as dd


def channel_vector(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t`` as backends take a per-channel vector: contiguous, in ``dtype`` (the statistics
    dtype); ``t`` itself, with no call into torch, where it is already."""
    return t if t.dtype == dtype and t.is_contiguous() else t.to(dtype).contiguous()


class NormParams(NamedTuple):
    """Per-channel vectors in the statistics dtype, and the activation ``y = act(z)`` with its
    parameter (``activation_param``: leaky_relu's negative slope, ELU's alpha; the layer's
    public argument ``slope``)."""

    mean: torch.Tensor
    invstd: torch.Tensor
    weight: torch.Tensor
    bias: torch.Tensor
    activation: str
    activation_param: float


class DxCoefs(NamedTuple):
    """``dx = dz * coef_dz + xhat * coef_xhat + coef_const``, per channel."""

    dz: torch.Tensor
    xhat: torch.Tensor
    const: torch.Tensor


class BatchSums(NamedTuple):
    """The input gradient of a layer normalised with its own batch's statistics, given by
    that batch's sums (``backward_reduce``)::

        dx = w * invstd * (dz - sum_dz / n - xhat * sum_dz_xhat / n)

    i.e. ``DxCoefs(w * invstd, -w * invstd * sum_dz_xhat / n, -w * invstd * sum_dz / n)``:
    see :func:`dx_coefs`, whose order of operations every backend follows (float64's in
    double-double, rounded once each)."""

    sum_dz: torch.Tensor
    sum_dz_xhat: torch.Tensor
    count: int


def dx_coefs(params: NormParams, coefs: DxCoefs | BatchSums) -> DxCoefs:
    """``coefs`` as :class:`DxCoefs` (four ATen calls on (C,) vectors for :class:`BatchSums`;
    float64's from :func:`_float64_dx_coefs`)."""
    if isinstance(coefs, DxCoefs):
        return coefs
    if coefs.sum_dz.dtype == torch.float64:
        return _float64_dx_coefs(params, coefs)
    # Taken in float64 and rounded once each (``w * invstd`` is exact there): every element
    # of dx takes them, unaveraged.
    wide, dtype = torch.float64, coefs.sum_dz.dtype
    scale = params.weight.to(wide) * params.invstd.to(wide)
    per_element = scale * (-1.0 / coefs.count)
    return DxCoefs(scale.to(dtype), (per_element * coefs.sum_dz_xhat.to(wide)).to(dtype),
                   (per_element * coefs.sum_dz.to(wide)).to(dtype))


def _float64_dx_coefs(params: NormParams, sums: BatchSums) -> DxCoefs:
    """float64's coefficients, each rounded once from double-double: ``scale = w * invstd``
    exact as ``two_prod``'s pair, ``p = -scale / n``, then ``p`` times each sum. float64 has
    no wider dtype to take them in, and every element of dx takes them, unaveraged over few
    values a channel (the Triton kernel derives them with the same ops: ``backward_dx``)."""
    weight = params.weight.to(torch.float64)
    scale = dd.two_prod(weight, params.invstd.to(torch.float64))
    zero = torch.zeros_like(scale[0])
    p = dd.quotient(dd.neg(scale), float(sums.count))
    coef_xhat = dd.mul(p, (sums.sum_dz_xhat, zero))
    coef_const = dd.mul(p, (sums.sum_dz, zero))
    return DxCoefs(scale[0], coef_xhat[0] + coef_xhat[1], coef_const[0] + coef_const[1])


class RunningStats(NamedTuple):
    """The buffers a training call folds its batch into, in place (``nn.BatchNorm``'s rule)::

        batches += 1
        r_mean = (1 - f) r_mean + f * mean,   r_var = (1 - f) r_var + f * M2 / (count - 1)

    with ``f = momentum``, or ``1 / batches`` (cumulative average) where ``momentum`` is None.
    ``batches``: ``num_batches_tracked`` (None: a layer without the counter)."""

    mean: torch.Tensor
    var: torch.Tensor
    batches: torch.Tensor | None
    momentum: float | None


class RunningParams(NamedTuple):
    """``normalize_running``'s: :class:`NormParams` with the running buffers (any dtype and
    strides) and ``eps`` in place of the batch's mean and invstd."""

    mean: torch.Tensor
    var: torch.Tensor
    eps: float
    weight: torch.Tensor
    bias: torch.Tensor
    activation: str
    activation_param: float


class Spread(NamedTuple):
    """How spread a channel's normalised input is: xhat's mean square ``s^2 = var / (var +
    eps)``, under 1 in a near-constant channel (``torch_ops.small_gamma``), as ``numerator /
    denominator``, kept apart so that a test of it divides nothing: a batch's ``(invstd^2 *
    M2, count)``, the running statistics' (``inplace_policy.running_spread``)."""

    numerator: torch.Tensor
    denominator: int


def batch_spread(m2: torch.Tensor, count: int, invstd: torch.Tensor) -> Spread:
    """A batch's ``Spread``: ``invstd^2 * M2`` over its count (the Triton finalize kernel takes
    the same products)."""
    return Spread(invstd * invstd * m2, count)


def variance_spread(var: torch.Tensor, eps: float) -> Spread:
    """A variance's ``Spread``: ``var / (var + eps)`` over 1."""
    return Spread(var / (var + eps), 1)


class GammaCheck(NamedTuple):
    """Which channels' gamma is too small to rebuild their input from the output: flagged
    where ``torch_ops.small_gamma(weight, bias, limit, spread)``, with the spread of the batch
    the check rides on."""

    weight: torch.Tensor
    bias: torch.Tensor
    limit: float


class Backend(Protocol):
    """The ops of the layer; ``saved`` is the input (``saved_is_output=False``) or the
    output the activation is inverted from."""

    name: str
    #: Whether ``batch_backward`` uses ``overwrite_saved``: the caller finds it out (host work
    #: at every call) only for a backend that does.
    scratches_saved: bool

    def channel_stats(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]: ...

    def batch_stats(self, x: torch.Tensor, eps: float, running: RunningStats | None,
                    check: GammaCheck | None
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]: ...

    def normalize_act(self, x: torch.Tensor, params: NormParams,
                      out: torch.Tensor) -> torch.Tensor: ...

    def normalize_running(self, x: torch.Tensor, running: RunningParams,
                          out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...

    def backward_reduce(self, saved: torch.Tensor, dy: torch.Tensor, params: NormParams,
                        saved_is_output: bool) -> tuple[torch.Tensor, torch.Tensor]: ...

    def backward_dx(self, saved: torch.Tensor, dy: torch.Tensor, params: NormParams,
                    saved_is_output: bool, coefs: DxCoefs | BatchSums) -> torch.Tensor: ...

    def batch_backward(self, saved: torch.Tensor, dy: torch.Tensor, params: NormParams,
                       saved_is_output: bool, count: int, overwrite_saved: bool = False
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]: ...


def reduce_then_dx(backend: Backend, saved: torch.Tensor, dy: torch.Tensor, params: NormParams,
                   saved_is_output: bool, count: int
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``backend.batch_backward`` as its two ops: ``backward_reduce``, then ``backward_dx``
    from those sums; for a backend with no single call for both."""
    sums = backend.backward_reduce(saved, dy, params, saved_is_output=saved_is_output)
    return (backend.backward_dx(saved, dy, params, saved_is_output=saved_is_output,
                                coefs=BatchSums(*sums, count)),
            *sums)
