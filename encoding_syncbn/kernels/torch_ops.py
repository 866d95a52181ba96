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

Every op walks the tensors in slabs of at most ``_SLAB_ELEMENTS`` elements through small
scratch buffers, with ``out=`` and in-place ATen calls: full-size temporaries would cost
memory (the layer's point is to keep one activation, not three) and, on the CPU, more time
in page faults than the arithmetic itself.
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


# Elements per slab: large enough to amortise the per-call overhead, small enough to stay in
# cache between the few ops applied to it.
_SLAB_ELEMENTS = 1 << 16


def _as_rows(t: torch.Tensor) -> torch.Tensor | None:
    """A view of ``(N, C, *)`` as ``(A, C, B)`` with the channel in the middle, or None.

    NCHW-contiguous gives ``(N, C, H*W)``; channels_last gives ``(N*H*W, C, 1)``.
    """
    channels = t.shape[1]
    if t.is_contiguous():
        return t.view(t.shape[0], channels, -1)
    moved = t.movedim(1, -1)
    if moved.is_contiguous():
        return moved.view(-1, channels, 1)
    return None


def _slabs(rows: torch.Tensor):
    """Slices of the first dim of an ``(A, C, B)`` view, each about ``_SLAB_ELEMENTS``."""
    per_row = max(1, rows.shape[1] * rows.shape[2])
    step = max(1, _SLAB_ELEMENTS // per_row)
    return [slice(a, min(a + step, rows.shape[0])) for a in range(0, rows.shape[0], step)]


def _channel(v: torch.Tensor) -> torch.Tensor:
    """A (C,) vector broadcast against an ``(A, C, B)`` slab."""
    return v.view(1, -1, 1)


def channel_stats(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Per-channel ``(mean, M2, count)`` with ``M2 = sum((x - mean)^2)``.

    Two passes in the statistics dtype (the sum, then the centred squares), never
    ``E[x^2] - E[x]^2``. An empty batch gives zeros, so that it drops out of any Chan merge.
    """
    channels = x.shape[1]
    count = x.numel() // channels if channels else 0
    acc = stats_dtype(x.dtype)
    mean = torch.zeros(channels, dtype=acc, device=x.device)
    m2 = torch.zeros_like(mean)
    if count == 0:
        return mean, m2, 0
    rows = _as_rows(x)
    if rows is None:
        rows = x.contiguous().view(x.shape[0], channels, -1)
    mean = rows.sum(dim=(0, 2), dtype=acc).div_(count)
    centred = mean.new_empty((_slabs(rows)[0].stop,) + rows.shape[1:])
    for part in _slabs(rows):
        slab = torch.sub(rows[part], _channel(mean), out=centred[: part.stop - part.start])
        m2 += slab.mul_(slab).sum(dim=(0, 2))
    return mean, m2, count


def _activate_(z: torch.Tensor, activation: str, slope: float) -> torch.Tensor:
    if activation == "leaky_relu":
        return torch.nn.functional.leaky_relu_(z, slope)
    if activation == "elu":
        return torch.nn.functional.elu_(z, slope)
    if activation == "relu":
        return z.relu_()
    return z


def _written_through(out: torch.Tensor, compute) -> torch.Tensor:
    """Run ``compute(out_rows)`` on an (A, C, B) view of ``out``, or via a copy if it has none."""
    rows = _as_rows(out)
    if rows is not None:
        compute(rows)
        return out
    dense = torch.empty_like(out, memory_format=torch.contiguous_format)
    compute(dense.view(out.shape[0], out.shape[1], -1))
    return out.copy_(dense)


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
    if x.numel() == 0:
        return out
    mean_c, scale_c, bias_c = _channel(mean), _channel(invstd * weight), _channel(bias)
    rows_in = _as_rows(x)
    if rows_in is None or (out is not x and _as_rows(out) is None):
        rows_in = x.contiguous().view(x.shape[0], x.shape[1], -1)

    def compute(rows_out: torch.Tensor) -> None:
        in_place = rows_out.data_ptr() == rows_in.data_ptr() and rows_out.dtype == mean.dtype
        scratch = None if in_place else mean.new_empty(
            (_slabs(rows_in)[0].stop,) + rows_in.shape[1:]
        )
        for part in _slabs(rows_in):
            z = rows_out[part] if in_place else scratch[: part.stop - part.start]
            torch.sub(rows_in[part], mean_c, out=z).mul_(scale_c).add_(bias_c)
            _activate_(z, activation, slope)
            if not in_place:
                rows_out[part].copy_(z)

    return _written_through(out, compute)


class _Backward:
    """Rebuilds ``xhat`` and ``dz`` slab by slab from the saved input or output.

    ``dz`` comes from ATen's own activation backward (``leaky_relu_backward`` and
    ``elu_backward`` accept the output in place of the input), so the branch conventions are
    exactly those of ``F.leaky_relu`` / ``F.elu`` / ``F.relu``.
    """

    def __init__(self, saved, dy, mean, invstd, weight, bias, activation, slope,
                 saved_is_output):
        if saved_is_output and activation == "relu":
            raise ValueError("activation 'relu' cannot be inverted from its output")
        self.saved = _as_rows(saved)
        if self.saved is None:
            saved = saved.contiguous()
            self.saved = _as_rows(saved)
        self.dy = _as_rows(dy)
        if self.dy is None or self.dy.stride() != self.saved.stride():
            # One copy of dy into saved's layout, so that both walk in step.
            self.dy = _as_rows(torch.empty_like(saved, dtype=dy.dtype).copy_(dy))
        self.mean, self.invstd = _channel(mean), _channel(invstd)
        self.weight, self.bias = _channel(weight), _channel(bias)
        self.inverse_weight = _channel(weight.reciprocal())
        self.activation, self.slope, self.saved_is_output = activation, slope, saved_is_output
        # Half-precision tensors are widened to the statistics dtype before any arithmetic
        # (ATen's activation backwards compute in their inputs' dtype).
        self.widen = saved.dtype != mean.dtype or dy.dtype != mean.dtype
        self.parts = _slabs(self.saved)
        shape = (self.parts[0].stop,) + self.saved.shape[1:]
        self._xhat, self._dz, self._aux = (mean.new_empty(shape) for _ in range(3))

    def slab(self, part: slice) -> tuple[torch.Tensor, torch.Tensor]:
        """``(xhat, dz)`` of one slab, in scratch buffers valid until the next call."""
        n = part.stop - part.start
        s, dy = self.saved[part], self.dy[part]
        xhat, dz, aux = self._xhat[:n], self._dz[:n], self._aux[:n]
        act, slope = self.activation, self.slope
        aten = torch.ops.aten
        if self.widen:
            dy = aux.copy_(dy)
        if self.saved_is_output:
            # Without widening, y is the layer's output itself: read it, never write it.
            y = xhat.copy_(s) if self.widen else s
            if act == "leaky_relu":  # z = y where y > 0, y / slope elsewhere
                aten.leaky_relu_backward.grad_input(dy, y, slope, True, grad_input=dz)
                aten.leaky_relu.out(y, 1.0 / slope, out=xhat)
            elif act == "elu":  # z = y where y > 0, log1p(y / alpha) (clamped) elsewhere
                aten.elu_backward.grad_input(dy, slope, 1, 1, True, y, grad_input=dz)
                torch.clamp(y, max=0, out=aux).div_(slope)
                aux.clamp_(min=_ELU_INVERSE_FLOOR).log1p_()
                torch.clamp(y, min=0, out=xhat).add_(aux)
            else:
                dz.copy_(dy)
                if not self.widen:
                    xhat.copy_(y)
            xhat.sub_(self.bias).mul_(self.inverse_weight)
        else:
            torch.sub(s, self.mean, out=xhat).mul_(self.invstd)
            if act in ("leaky_relu", "elu", "relu"):
                z = torch.mul(xhat, self.weight, out=dz).add_(self.bias)
                if act == "leaky_relu":
                    aten.leaky_relu_backward.grad_input(dy, z, slope, False, grad_input=dz)
                elif act == "elu":
                    aten.elu_backward.grad_input(dy, slope, 1, 1, False, z, grad_input=dz)
                else:
                    aten.threshold_backward.grad_input(dy, z, 0, grad_input=dz)
            else:
                dz.copy_(dy)
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
    sum_dz, sum_dz_xhat = torch.zeros_like(mean), torch.zeros_like(mean)
    if saved.numel() == 0:
        return sum_dz, sum_dz_xhat
    walk = _Backward(saved, dy, mean, invstd, weight, bias, activation, slope, saved_is_output)
    for part in walk.parts:
        xhat, dz = walk.slab(part)
        sum_dz += dz.sum(dim=(0, 2))
        sum_dz_xhat += xhat.mul_(dz).sum(dim=(0, 2))
    return sum_dz, sum_dz_xhat


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
    dx = torch.empty_like(saved)
    if saved.numel() == 0:
        return dx
    walk = _Backward(saved, dy, mean, invstd, weight, bias, activation, slope, saved_is_output)
    a, k, c = _channel(coef_dz), _channel(coef_xhat), _channel(coef_const)

    def compute(rows_out: torch.Tensor) -> None:
        for part in walk.parts:
            xhat, dz = walk.slab(part)
            torch.add(dz.mul_(a), xhat.mul_(k).add_(c), out=rows_out[part])

    return _written_through(dx, compute)
