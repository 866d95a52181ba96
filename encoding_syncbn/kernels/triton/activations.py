"""Activation device functions of the Triton kernels: ``act(z)`` and, for the backward,
``(xhat, dz)`` from the saved input or output."""

import torch
import triton
import triton.language as tl

from ..torch_ops import elu_inverse_floor

_ELU_FLOOR_FP32 = tl.constexpr(elu_inverse_floor(torch.float32))
_ELU_FLOOR_FP64 = tl.constexpr(elu_inverse_floor(torch.float64))


@triton.jit
def _expm1_nonpos(z):
    """``expm1(z)`` for ``z <= 0`` to full relative precision near 0.

    With ``u = exp(z)`` as rounded, ``(u - 1) * z / log(u)`` is accurate (Kahan): the rounding
    error of ``u`` cancels between numerator and denominator. ``u == 1`` gives ``z``, an
    underflowed ``u == 0`` gives -1.
    """
    u = tl.exp(z)
    d = u - 1.0
    ok = (d != 0.0) & (u > 0.0)
    q = z / tl.log(tl.where(ok, u, 0.5))
    return tl.where(ok, d * q, tl.where(u > 0.0, z, -1.0))


@triton.jit
def _log1p(r):
    """``log1p(r)`` for ``r > -1``: ``log(u) * r / (u - 1)`` with ``u = 1 + r`` (Goldberg).

    ``log(1 + r)`` alone loses all of ``r`` below the rounding of 1; the quotient restores it.
    """
    u = 1.0 + r
    d = u - 1.0
    return tl.where(d == 0.0, r, tl.log(u) * (r / tl.where(d == 0.0, 1.0, d)))


@triton.jit
def _activate(z, slope, ACTIVATION: tl.constexpr):
    """``act(z)`` for one of KERNEL_ACTIVATIONS, positive branch for ``z > 0`` exactly as torch
    (``slope`` is ELU's alpha)."""
    if ACTIVATION == "leaky_relu":
        y = tl.where(z > 0.0, z, z * slope)
    elif ACTIVATION == "elu":
        # NaN passes through, as in torch's elu.
        y = tl.where(z <= 0.0, slope * _expm1_nonpos(tl.minimum(z, 0.0)), z)
    else:
        # relu. NaN passes through, as in torch.relu.
        y = tl.where((z > 0.0) | (z != z), z, 0.0)
    return y


@triton.jit
def _xhat_dz(s, dy, mean, invstd, weight, bias, slope, ACTIVATION: tl.constexpr,
             SAVED_IS_OUTPUT: tl.constexpr):
    """``(xhat, dz)`` from the saved input ``x`` or output ``y``.

    from y:  leaky_relu  z = y if y > 0 else y / slope        dz = dy  or dy * slope
             elu         z = y if y > 0 else log1p(max(y / alpha, -1 + ulp))
                                                                dz = dy  or dy * (y + alpha)
             xhat = (z - bias) / weight
    from x:  xhat = (x - mean) * invstd,  z = xhat * weight + bias,  dz = dy * act'(z)
    """
    if SAVED_IS_OUTPUT:
        positive = s > 0.0
        if ACTIVATION == "leaky_relu":
            z = tl.where(positive, s, s / slope)
            dz = tl.where(positive, dy, dy * slope)
        else:
            # elu (relu has no inverse; the launchers refuse it)
            if s.dtype == tl.float64:
                floor = tl.full([], _ELU_FLOOR_FP64, s.dtype)
            else:
                floor = tl.full([], _ELU_FLOOR_FP32, s.dtype)
            ratio = tl.maximum(s / slope, floor)
            z = tl.where(positive, s, _log1p(ratio))
            dz = tl.where(positive, dy, dy * (s + slope))
        xhat = (z - bias) / weight
    else:
        xhat = (s - mean) * invstd
        z = xhat * weight + bias
        # Branch tests as ATen's CPU kernels, so that a NaN z takes the same branch (relu's
        # threshold_backward passes dy unless z <= 0).
        if ACTIVATION == "leaky_relu":
            dz = tl.where(z > 0.0, dy, dy * slope)
        elif ACTIVATION == "elu":
            # Not tl.minimum(z, 0): it turns a NaN into 0 (ATen's exp(NaN) gives NaN).
            dz = tl.where(z > 0.0, dy, dy * (slope * tl.exp(tl.where(z > 0.0, 0.0, z))))
        else:
            dz = tl.where(z <= 0.0, 0.0, dy)
    return xhat, dz
