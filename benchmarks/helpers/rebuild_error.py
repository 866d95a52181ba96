"""How far an in-place layer's input gradient is from the bound the README's Limits promise: per
channel, its error against an exact reference over 3x the largest of nn.BatchNorm2d's own error
(+ the activation, in the same dtype), half an ulp of the channel's largest |dx| and
nn.BatchNorm2d's typical relative error times the size of the gradient's xhat term
(``allowed_errors``).

The reference is BatchNorm + the activation's backward in numpy's long double (a 64-bit
significand on x86): 40 bits beyond float32, 11 beyond float64, which a channel's cancellation
(|dz| over |dx|) eats into: a float64 channel is measured to 2^-11 of an ulp times it.

Inputs far from zero are first moved off the activation's kink (``off_kink``).
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from encoding_syncbn import SyncBatchNorm
from encoding_syncbn.testing import SimulatedDataParallel

BOUND = 3.0
EPS = 1e-5


def _exact_pre_activation(x: torch.Tensor, gamma: torch.Tensor, beta: torch.Tensor
                          ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(xhat, invstd, z)`` of training-mode BatchNorm (biased variance, ``EPS``) on the whole
    (N, C, H, W) batch, in long double."""
    wide = np.longdouble
    x = x.double().numpy().astype(wide)
    w = gamma.double().numpy().astype(wide).reshape(1, -1, 1, 1)
    b = beta.double().numpy().astype(wide).reshape(1, -1, 1, 1)
    dims = (0, 2, 3)
    centred = x - x.mean(axis=dims, keepdims=True)
    # The mean's own rounding, about 2^-64 of it, would shift every xhat by that over the
    # standard deviation (an ulp of float64's at a mean of 2^11 standard deviations): x -
    # mean is exact in long double, and its mean corrects it.
    centred -= centred.mean(axis=dims, keepdims=True)
    invstd = 1 / np.sqrt((centred * centred).mean(axis=dims, keepdims=True) + wide(EPS))
    xhat = centred * invstd
    return xhat, invstd, w * xhat + b


def near_kink(x: torch.Tensor, gamma: torch.Tensor, beta: torch.Tensor, activation: str
              ) -> np.ndarray:
    """Per element, whether the exact z lies within z's rounding of the activation's kink
    (z = 0 of leaky_relu and ELU; none for identity): ``|z| <= 2 eps (|gamma| invstd max|x|
    + |beta|)`` in x's dtype, twice the rounding of z's largest term as BatchNorm computes
    it (``x * gamma * invstd`` and the bias)."""
    _, invstd, z = _exact_pre_activation(x, gamma, beta)
    if activation not in ("leaky_relu", "elu"):
        return np.zeros(z.shape, dtype=bool)
    eps = torch.finfo(x.dtype).eps
    largest = x.double().abs().amax(dim=(0, 2, 3)).numpy().reshape(1, -1, 1, 1)
    w = np.abs(gamma.double().numpy()).reshape(1, -1, 1, 1)
    b = np.abs(beta.double().numpy()).reshape(1, -1, 1, 1)
    return np.abs(z) <= 2 * eps * (w * invstd * largest + b)


#: How far ``off_kink`` moves an element, in standard deviations of its channel.
KINK_STEP = 0.1
#: ``off_kink``'s rounds (each moves the elements then near the kink).
KINK_ROUNDS = 8


def off_kink(x: torch.Tensor, gamma: torch.Tensor, beta: torch.Tensor, activation: str
             ) -> torch.Tensor:
    """``x`` with each element ``near_kink`` moved ``KINK_STEP`` standard deviations of its
    channel further from the kink, on the side its z lies, until none is near (a move shifts
    the channel's mean, and so every z of it, a little).

    Why: a z within its rounding of the kink takes the slope of the rounded z's side, which
    every implementation draws by its own roundings (nn.BatchNorm2d's too), and one element's
    other slope reaches every gradient of its channel through the sums of dz: an error of
    hundreds of ulps that says nothing of the arithmetic. With |mean| a thousand standard
    deviations a channel of thousands of values has such an element about one time in five
    (float32), near 0 almost never."""
    for _ in range(KINK_ROUNDS):
        near = near_kink(x, gamma, beta, activation)
        if not near.any():
            return x
        _, _, z = _exact_pre_activation(x, gamma, beta)
        side = np.where(z >= 0, 1.0, -1.0) * np.sign(gamma.double().numpy()).reshape(1, -1, 1, 1)
        std = x.double().std(dim=(0, 2, 3)).numpy().reshape(1, -1, 1, 1)
        step = torch.from_numpy((near * side * KINK_STEP * std).astype(np.float64))
        x = (x.double() + step).to(x.dtype)
    raise RuntimeError(f"elements still near the kink after {KINK_ROUNDS} rounds")


def _exact_slope(z: np.ndarray, activation: str, slope: float) -> np.ndarray:
    """act'(z) of leaky_relu, ELU or identity, in long double."""
    wide = np.longdouble
    if activation == "leaky_relu":
        return np.where(z > 0, wide(1), wide(slope))
    if activation == "elu":
        return np.where(z > 0, wide(1), wide(slope) * np.exp(np.minimum(z, 0)))
    return np.ones_like(z)


def exact_output_and_parameter_gradients(x: torch.Tensor, dy: torch.Tensor,
                                         gamma: torch.Tensor, beta: torch.Tensor,
                                         activation: str, slope: float
                                         ) -> tuple[np.ndarray, ...]:
    """``(y, dw, db)`` of training-mode BatchNorm (biased variance, ``EPS``) + leaky_relu, ELU
    or identity on the whole (N, C, H, W) batch, in long double, and the sizes of their terms
    per channel: the largest ``|gamma * xhat| + |beta|`` (z's terms, whatever cancels in z),
    and the roots of ``sum((dz * xhat)^2)`` and ``sum(dz^2)`` (how large such a sum is,
    whatever cancels in it)."""
    xhat, _, z = _exact_pre_activation(x, gamma, beta)
    wide = np.longdouble
    if activation == "leaky_relu":
        y = np.where(z > 0, z, wide(slope) * z)
    elif activation == "elu":
        y = np.where(z > 0, z, wide(slope) * np.expm1(np.minimum(z, 0)))
    else:
        y = z
    dz = dy.double().numpy().astype(wide) * _exact_slope(z, activation, slope)
    dims = (0, 2, 3)
    terms = dz * xhat
    w = gamma.double().numpy().astype(wide).reshape(1, -1, 1, 1)
    b = beta.double().numpy().astype(wide).reshape(1, -1, 1, 1)
    return (y, terms.sum(axis=dims), dz.sum(axis=dims),
            (np.abs(w * xhat) + np.abs(b)).max(axis=dims),
            np.sqrt((terms * terms).sum(axis=dims)), np.sqrt((dz * dz).sum(axis=dims)))


def exact_input_gradient(x: torch.Tensor, dy: torch.Tensor, gamma: torch.Tensor,
                         beta: torch.Tensor, activation: str, slope: float
                         ) -> tuple[np.ndarray, np.ndarray]:
    """dx of training-mode BatchNorm (biased variance, ``EPS``) + the activation on the whole
    (N, C, H, W) batch, in long double, and per channel the size of its xhat term,
    ``|gamma| invstd |mean(dz * xhat)| max|xhat|`` (``allowed_errors``)."""
    wide = np.longdouble
    dy = dy.double().numpy().astype(wide)
    w = gamma.double().numpy().astype(wide).reshape(1, -1, 1, 1)
    dims = (0, 2, 3)
    xhat, invstd, z = _exact_pre_activation(x, gamma, beta)
    dz = dy * _exact_slope(z, activation, slope)
    m = (dz * xhat).mean(axis=dims, keepdims=True)
    xhat_term = (np.abs(w * invstd * m) * np.abs(xhat).max(axis=dims, keepdims=True))
    return (w * invstd * (dz - dz.mean(axis=dims, keepdims=True) - xhat * m),
            xhat_term.reshape(-1))


def allowed_errors(their_error: np.ndarray, size: np.ndarray, dtype: torch.dtype,
                   xhat_term: np.ndarray | None = None, roundings: int = 1) -> np.ndarray:
    """Per channel, the error the README's bound allows a value of the layer: ``BOUND`` times
    the largest of ``their_error`` (nn.BatchNorm2d + the activation's, in ``dtype``),
    ``roundings`` half ulps of ``size`` (the channel's largest value, or its terms' size) and,
    for an input gradient, ``tau * xhat_term``.

    ``xhat_term`` (``exact_input_gradient``) is the size of dx's xhat term, ``|gamma| invstd
    |mean(dz * xhat)| max|xhat|``; ``tau`` is nn.BatchNorm2d's largest error over the layer's
    channels relative to ``max(size, xhat_term)``. Why: with output gradients along xhat, dx
    is a cancellation of terms larger than itself, each carrying invstd's rounding (up to half
    an ulp, a channel's luck: nn.BatchNorm2d's and ours alike), and nn.BatchNorm2d's error in
    a channel is then often far below its error in the next; the bound holds every channel
    to nn.BatchNorm2d's error in this layer relative to the terms' size, not to one
    channel's luck.
    For ordinary output gradients ``mean(dz * xhat)`` is about ``1 / sqrt(n)``, and the term
    changes nothing. A value ~0 in every channel (a layer whose dz is 0) is held to an
    absolute floor."""
    their_error, size = np.asarray(their_error, dtype=np.float64), np.asarray(size, np.float64)
    half_ulp = torch.finfo(dtype).eps / 2
    allowed = np.maximum(their_error, roundings * half_ulp * size)
    if xhat_term is not None:
        xhat_term = np.asarray(xhat_term, dtype=np.float64)
        scale = np.maximum(size, xhat_term)
        relative = their_error[scale > 0] / scale[scale > 0]
        tau = float(relative.max()) if relative.size else 0.0
        allowed = np.maximum(allowed, tau * xhat_term)
    return np.maximum(BOUND * allowed, 1e-3 * half_ulp * size.max() + 1e-300)


def input_gradient(norm: nn.Module, x: torch.Tensor, dy: torch.Tensor,
                   replicas: int | Sequence[int], activation: str, slope: float,
                   compiler: str | None = None) -> tuple[torch.Tensor, bool]:
    """dx of ``norm`` (+ the activation, unless it fuses one) over ``replicas`` simulated
    DataParallel replicas (a sequence: nested calls, outermost first), and whether its output
    was written over its input (in place). ``compiler``: a ``torch.compile`` backend the
    model runs under (its second call, after the one an in-place layer counts in: see
    ``layer/compiled_inplace.py``); None: eager."""
    model = norm
    for count in reversed([replicas] if isinstance(replicas, int) else replicas):
        model = SimulatedDataParallel(model, count) if count > 1 else model
    if compiler is not None:
        torch._dynamo.reset()
        model = torch.compile(model, backend=compiler)
        model(x.clone()).backward(dy)
        for param in norm.parameters():
            param.grad = None
    leaf = x.clone().requires_grad_()
    h = leaf * 1
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the out-of-place fallback's warning, where it runs
        out = model(h)
    if activation == "leaky_relu" and not isinstance(norm, SyncBatchNorm):
        out = F.leaky_relu(out, slope)
    elif activation == "elu" and not isinstance(norm, SyncBatchNorm):
        out = F.elu(out, slope)
    # Over replicas the output is gathered (a new tensor): in place is judged on the layer.
    in_place = model is norm and out.data_ptr() == h.data_ptr()
    out.backward(dy)
    return leaf.grad, in_place


def ratios_to_bound(x: torch.Tensor, dy: torch.Tensor, gamma: torch.Tensor, beta: torch.Tensor,
                    activation: str, slope: float, replicas: int | Sequence[int],
                    inplace: bool = True, compiler: str | None = None
                    ) -> tuple[torch.Tensor, bool]:
    """Per channel, the layer's dx error over the bound (above 1: the bound fails), and
    whether its output was written over its input (single replica; else False);
    ``replicas``, ``compiler``: as ``input_gradient``'s."""
    layer = SyncBatchNorm(x.shape[1], eps=EPS, activation=activation, slope=slope,
                          inplace=inplace, dtype=x.dtype)
    with torch.no_grad():
        layer.weight.copy_(gamma)
        layer.bias.copy_(beta)
    ours, in_place = input_gradient(layer, x, dy, replicas, activation, slope, compiler)
    return gradient_ratios(ours, x, dy, gamma, beta, activation, slope), in_place


def gradient_ratios(ours: torch.Tensor, x: torch.Tensor, dy: torch.Tensor, gamma: torch.Tensor,
                    beta: torch.Tensor, activation: str, slope: float) -> torch.Tensor:
    """Per channel, the error of ``ours`` (an input gradient of BatchNorm + the activation on
    the whole batch ``x``, however the layer took it) over the bound."""
    dtype = x.dtype
    twin = nn.BatchNorm2d(x.shape[1], eps=EPS, dtype=dtype)
    with torch.no_grad():
        twin.weight.copy_(gamma)
        twin.bias.copy_(beta)
    exact, xhat_term = exact_input_gradient(x, dy, gamma.to(dtype), beta.to(dtype), activation,
                                            slope)
    dims = (0, 2, 3)
    size = np.abs(exact).max(axis=dims)

    def error(got: torch.Tensor) -> np.ndarray:
        return np.abs(got.double().numpy().astype(np.longdouble) - exact).max(axis=dims)

    theirs, _ = input_gradient(twin, x, dy, 1, activation, slope)
    allowed = allowed_errors(error(theirs), size, dtype, xhat_term)
    return torch.from_numpy((error(ours) / allowed).astype(np.float64))
