"""Activation device functions of the Triton kernels: ``act(z)`` and, for the backward,
``(xhat, dz)`` from the saved input or output.

Each activation's code is selected by its ``ACTIVATION`` constexpr, the ``kernel`` id of its
definition in ``encoding_syncbn/activations.py``; an id with no code here (or, from the
output, one with no inverse) fails to compile (``tl.static_assert``): no catch-all branch.
"""

import triton
import triton.language as tl

# The constants are literals inside jitted functions, each in the dtype of its operand, not
# module-level ``tl.constexpr`` globals: Triton compares every global a kernel reads (its
# callees' included) with its compile-time value at each launch, a host cost per global per
# launch (test_triton_ops checks the literals against their definitions).


@triton.jit
def _elu_floor(like):
    """``activations.elu_inverse_floor`` for ``like``'s dtype: -1 + eps / 2 of float64 for a
    float64 ``like``, else of float32."""
    if like.dtype == tl.float64:
        floor = tl.full([], -0.9999999999999999, like.dtype)  # -1 + 2**-53
    else:
        floor = tl.full([], -0.9999999403953552, like.dtype)  # -1 + 2**-24
    return floor


# GELU's constants, as ATen's: 1/sqrt(2), 1/sqrt(2 pi); tanh form: sqrt(2/pi), 0.044715.


@triton.jit
def _sqrt1_2(like):
    return tl.full([], 0.7071067811865476, like.dtype)


@triton.jit
def _inv_sqrt_2pi(like):
    return tl.full([], 0.3989422804014327, like.dtype)


@triton.jit
def _gelu_tanh_beta(like):
    return tl.full([], 0.7978845608028654, like.dtype)


@triton.jit
def _gelu_tanh_kappa(like):
    return tl.full([], 0.044715, like.dtype)


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
def _sigmoid(t):
    """``(sigmoid(t), 1 - sigmoid(t))``, the second without cancellation where sigmoid(t)
    is near 1 (``exp(-t) * sigmoid(t)``; an fp32 ``1 - s`` there has a relative error of up
    to 1, which SiLU's and GELU's derivatives multiply by z)."""
    e = tl.exp(-t)
    s = 1.0 / (1.0 + e)
    return s, tl.where(t < 0.0, 1.0 - s, e * s)


@triton.jit
def _gelu_tanh_u(z):
    """GELU's tanh form is ``z * (1 + tanh(u)) / 2 = z * sigmoid(2u)`` with this ``u``
    (computed without tanh, which Triton has only through libdevice)."""
    return _gelu_tanh_beta(z) * (z + _gelu_tanh_kappa(z) * z * z * z)


@triton.jit
def activate(z, param, ACTIVATION: tl.constexpr):
    """``act(z)`` for one of KERNEL_ACTIVATIONS, positive branch for ``z > 0`` exactly as torch
    (``param``: leaky_relu's negative slope, ELU's alpha)."""
    if ACTIVATION == "leaky_relu":
        y = tl.where(z > 0.0, z, z * param)
    elif ACTIVATION == "elu":
        # NaN passes through, as in torch's elu.
        y = tl.where(z <= 0.0, param * _expm1_nonpos(tl.minimum(z, 0.0)), z)
    elif ACTIVATION == "relu":
        # NaN passes through, as in torch.relu.
        y = tl.where((z > 0.0) | (z != z), z, 0.0)
    elif ACTIVATION == "silu":
        y = z / (1.0 + tl.exp(-z))  # as ATen's CPU kernel
    elif ACTIVATION == "gelu":
        y = 0.5 * z * (1.0 + tl.math.erf(z * _sqrt1_2(z)))
    elif ACTIVATION == "gelu_tanh":
        y = z / (1.0 + tl.exp(-2.0 * _gelu_tanh_u(z)))
    else:
        tl.static_assert(False, "unknown activation id (see encoding_syncbn/activations.py)")
    return y


@triton.jit
def xhat_dz(s, dy, mean, invstd, weight, bias, param, ACTIVATION: tl.constexpr,
            SAVED_IS_OUTPUT: tl.constexpr):
    """``(xhat, dz)`` from the saved input ``x`` or output ``y``.

    from y:  leaky_relu  z = y if y > 0 else y / param        dz = dy  or dy * param
             elu         z = y if y > 0 else log1p(max(y / alpha, -1 + ulp))
                                                                dz = dy  or dy * (y + alpha)
             xhat = (z - bias) / weight
    from x:  xhat = (x - mean) * invstd,  z = xhat * weight + bias,  dz = dy * act'(z)
    """
    if SAVED_IS_OUTPUT:
        positive = s > 0.0
        if ACTIVATION == "leaky_relu":
            z = tl.where(positive, s, s / param)
            dz = tl.where(positive, dy, dy * param)
        elif ACTIVATION == "elu":
            ratio = tl.maximum(s / param, _elu_floor(s))
            z = tl.where(positive, s, _log1p(ratio))
            dz = tl.where(positive, dy, dy * (s + param))
        else:
            tl.static_assert(False, "activation id without an inverse (or unknown): its "
                                    "kernels cannot read the saved output")
        xhat = (z - bias) / weight
    else:
        xhat = (s - mean) * invstd
        z = xhat * weight + bias
        # Branch tests as ATen's CPU kernels, so that a NaN z takes the same branch (relu's
        # threshold_backward passes dy unless z <= 0).
        if ACTIVATION == "leaky_relu":
            dz = tl.where(z > 0.0, dy, dy * param)
        elif ACTIVATION == "elu":
            # Not tl.minimum(z, 0): it turns a NaN into 0 (ATen's exp(NaN) gives NaN).
            dz = tl.where(z > 0.0, dy, dy * (param * tl.exp(tl.where(z > 0.0, 0.0, z))))
        elif ACTIVATION == "relu":
            dz = tl.where(z <= 0.0, 0.0, dy)
        elif ACTIVATION == "silu":
            sig, one_minus = _sigmoid(z)
            dz = dy * sig * (1.0 + z * one_minus)
        elif ACTIVATION == "gelu":
            cdf = 0.5 * (1.0 + tl.math.erf(z * _sqrt1_2(z)))
            pdf = _inv_sqrt_2pi(z) * tl.exp(-0.5 * z * z)
            dz = dy * (cdf + z * pdf)
        elif ACTIVATION == "gelu_tanh":
            # d/dz z*s = s + z * 2 s (1 - s) * u', u' = sqrt(2/pi) * (1 + 3 * 0.044715 z^2)
            sig, one_minus = _sigmoid(2.0 * _gelu_tanh_u(z))
            du = _gelu_tanh_beta(z) * (1.0 + 3.0 * _gelu_tanh_kappa(z) * z * z)
            dz = dy * sig * (1.0 + 2.0 * z * one_minus * du)
        else:
            tl.static_assert(False, "unknown activation id (see encoding_syncbn/activations.py)")
    return xhat, dz
