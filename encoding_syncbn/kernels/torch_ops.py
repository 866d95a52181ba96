"""The layer's four elementwise/reduction ops in plain ATen calls.

This is the CPU path and the reference every other backend is tested against. All per-channel
vectors (``mean``, ``invstd``, ``weight``, ``bias`` and the coefficients) are in the statistics
dtype: float32 for half, bfloat16 and float32 inputs, float64 for float64 inputs. Element
tensors (``x``, ``y``, ``dy``, ``dx``) have shape ``(N, C, *)`` in any memory format.

Notation, per channel c and element e of that channel::

    z     = (x - mean) * invstd * weight + bias          pre-activation
    y     = act(z)                                        what the layer returns
    dz    = dy * act'(z)                                  gradient at the pre-activation
    xhat  = (x - mean) * invstd = (z - bias) / weight     normalised input

``saved`` is what the layer kept for backward: the input ``x`` (``saved_is_output=False``) or
the output ``y`` (``saved_is_output=True``, the in-place case), from which ``z`` and ``xhat``
are rebuilt by inverting the activation.
"""

from __future__ import annotations

import torch

#: Activations and whether they can be inverted (needed to run in place).
ACTIVATIONS = {"none": True, "identity": True, "leaky_relu": True, "elu": True, "relu": False}

# ELU's inverse log1p(y / alpha) diverges as y -> -alpha; rounding can even put y / alpha below
# -1. Clamping keeps z finite; such elements carry a vanishing gradient (dz = dy * (y + alpha)).
_ELU_INVERSE_FLOOR = -1.0 + 1e-7


def stats_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 stays float64; every other floating dtype accumulates in float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _per_channel(v: torch.Tensor, ndim: int) -> torch.Tensor:
    """Reshape a (C,) vector to broadcast against an (N, C, *) tensor of ``ndim`` dims."""
    return v.view((1, -1) + (1,) * (ndim - 2))


def _reduce_dims(ndim: int) -> list[int]:
    return [0] + list(range(2, ndim))


def channel_stats(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Per-channel ``(mean, M2, count)`` with ``M2 = sum((x - mean)^2)``.

    Two-pass in the statistics dtype (ATen's ``var_mean``), never ``E[x^2] - E[x]^2``.
    An empty batch gives zeros, so that it drops out of any Chan merge.
    """
    channels = x.shape[1]
    count = x.numel() // channels if channels else 0
    acc = stats_dtype(x.dtype)
    if count == 0:
        zeros = torch.zeros(channels, dtype=acc, device=x.device)
        return zeros, zeros.clone(), 0
    var, mean = torch.var_mean(x.to(acc), dim=_reduce_dims(x.dim()), correction=0)
    return mean, var * count, count


def _activate_(z: torch.Tensor, activation: str, slope: float) -> torch.Tensor:
    if activation == "leaky_relu":
        return torch.nn.functional.leaky_relu_(z, slope)
    if activation == "elu":
        return torch.nn.functional.elu_(z, slope)
    if activation == "relu":
        return z.relu_()
    return z


def normalize_act(
    x: torch.Tensor,
    mean: torch.Tensor,
    invstd: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    activation: str,
    slope: float,
    out: torch.Tensor,
) -> torch.Tensor:
    """``out = act((x - mean) * (invstd * weight) + bias)``; ``out`` may be ``x`` itself.

    The mean is subtracted before scaling: ``x * scale + shift`` loses the normalised value
    to cancellation when |mean| >> std.
    """
    nd = x.dim()
    scale = _per_channel(invstd * weight, nd)
    z = torch.addcmul(_per_channel(bias, nd), x.to(scale.dtype) - _per_channel(mean, nd), scale)
    out.copy_(_activate_(z, activation, slope))
    return out


def _pre_activation_and_grad(
    saved: torch.Tensor,
    dy: torch.Tensor,
    mean: torch.Tensor,
    invstd: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    activation: str,
    slope: float,
    saved_is_output: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(xhat, dz)`` in the statistics dtype, rebuilt from the saved input or output."""
    nd = saved.dim()
    acc = mean.dtype
    s = saved.to(acc)
    dy = dy.to(acc)
    w, b = _per_channel(weight, nd), _per_channel(bias, nd)
    if saved_is_output:
        y = s
        if activation == "leaky_relu":
            positive = y > 0
            z = torch.where(positive, y, y / slope)
            dz = torch.where(positive, dy, dy * slope)
        elif activation == "elu":
            positive = y > 0
            ratio = (y / slope).clamp_min(_ELU_INVERSE_FLOOR)
            z = torch.where(positive, y, torch.log1p(ratio))
            dz = torch.where(positive, dy, dy * (y + slope))
        elif activation in ("none", "identity"):
            z, dz = y, dy
        else:
            raise ValueError(f"activation {activation!r} cannot be inverted from its output")
        xhat = (z - b) / w
    else:
        xhat = (s - _per_channel(mean, nd)) * _per_channel(invstd, nd)
        z = xhat * w + b
        if activation == "leaky_relu":
            dz = torch.where(z > 0, dy, dy * slope)
        elif activation == "elu":
            dz = torch.where(z > 0, dy, dy * (slope * torch.exp(z)))
        elif activation == "relu":
            dz = torch.where(z > 0, dy, torch.zeros_like(dy))
        else:
            dz = dy
    return xhat, dz


def backward_reduce(
    saved: torch.Tensor,
    dy: torch.Tensor,
    mean: torch.Tensor,
    invstd: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    activation: str,
    slope: float,
    saved_is_output: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel ``(sum(dz), sum(dz * xhat))`` in the statistics dtype."""
    xhat, dz = _pre_activation_and_grad(
        saved, dy, mean, invstd, weight, bias, activation, slope, saved_is_output
    )
    dims = _reduce_dims(saved.dim())
    return dz.sum(dims), (dz * xhat).sum(dims)


def backward_dx(
    saved: torch.Tensor,
    dy: torch.Tensor,
    mean: torch.Tensor,
    invstd: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    activation: str,
    slope: float,
    saved_is_output: bool,
    coef_dz: torch.Tensor,
    coef_xhat: torch.Tensor,
    coef_const: torch.Tensor,
) -> torch.Tensor:
    """``dx = coef_dz * dz + coef_xhat * xhat + coef_const``, in ``saved``'s dtype.

    Every input gradient of the layer has this form (see ``functional.py`` for the
    coefficients of the local and the synchronised case).
    """
    xhat, dz = _pre_activation_and_grad(
        saved, dy, mean, invstd, weight, bias, activation, slope, saved_is_output
    )
    nd = saved.dim()
    dx = torch.addcmul(_per_channel(coef_const, nd), dz, _per_channel(coef_dz, nd))
    dx.addcmul_(xhat, _per_channel(coef_xhat, nd))
    return dx.to(saved.dtype)
