"""When ``SyncBatchNorm`` may run in place: a slope it can invert, an input it may overwrite.

Both are decided before anything is computed: a refusal by autograd inside the Function would
come after the input, and the running statistics, had been written.
"""

from __future__ import annotations

import warnings

import torch

from .. import activations, compat
from ..kernels import torch_ops


def resolve_inplace(layer: str, activation: str, slope: float, inplace: bool | None,
                    dtype: torch.dtype | None) -> bool:
    """Whether a layer with these options runs in place (``inplace=None``: exactly when the
    activation is invertible), or a ValueError naming ``layer`` and what to use instead.

    In place, backward divides by the slope (leaky_relu: z = y / slope; elu: y / alpha): a
    slope that is not positive, or whose inverse overflows the statistics dtype the layer
    computes in (float32 unless ``dtype`` is float64), is refused.
    """
    definition = activations.get(activation, layer)
    invertible = definition.inverse is not None
    if inplace is None:
        inplace = invertible and activation != "none"
    elif inplace and not invertible:
        choices = [a for a, d in activations.ACTIVATIONS.items() if d.inverse and a != "none"]
        raise ValueError(
            f"{layer}: activation={activation!r} with inplace=True: {activation} is not "
            f"invertible, so it cannot run in place; use one of {choices}, or inplace=False"
        )
    if inplace and activation == "none":
        raise ValueError(
            f"{layer}: activation 'none' does not run in place (a plain BatchNorm keeps its "
            "input); use activation='identity' for an in-place BatchNorm, or inplace=False"
        )
    if inplace and definition.inverse_needs_positive_slope:
        acc = torch_ops.stats_dtype(dtype or torch.get_default_dtype())
        if not slope > 0:
            raise ValueError(
                f"{layer}: in-place {activation} needs slope > 0 to be invertible, got "
                f"slope={slope}; use inplace=False for that slope"
            )
        if not 1.0 / slope <= torch.finfo(acc).max or not slope <= torch.finfo(acc).max:
            raise ValueError(
                f"{layer}: in-place {activation}: slope={slope} cannot be inverted in {acc} "
                f"(1/slope overflows); use a slope in [{1 / torch.finfo(acc).max:.3g}, "
                f"{torch.finfo(acc).max:.3g}] or inplace=False"
            )
    return bool(inplace)


# The activations whose inverse cannot rebuild their input from a half-precision output: ELU's
# z = log1p(y / alpha) amplifies y's rounding by exp(-z), and how far z goes below 0 depends
# on the data, not on gamma and beta (at alpha = 1, float16 rounds y to -alpha, losing z
# entirely, below z = -8.3, bfloat16 below -6.2).
_OUT_OF_PLACE_IN_HALF_PRECISION = frozenset({"elu"})


# The fewest values a channel (over the whole synchronised batch: every replica and rank) over
# which an in-place layer trains in place, in every dtype; see ``rebuilds_from_count``.
MIN_REBUILT_COUNT = 23

# What ``MIN_REBUILT_COUNT`` is derived from, besides the largest |beta| / |gamma| of a channel
# rebuilt in half precision (``channels_aside.HALF_PRECISION_LIMIT``): the bound on the
# gradients' error (a multiple of nn.BatchNorm2d's), and the chance per channel and call of
# exceeding it that is accepted.
GRADIENT_ERROR_BOUND = 3.0
ACCEPTED_FAILURE_CHANCE = 1e-6


def rebuilds_from_count(count: int, dtype: torch.dtype) -> bool:
    """Whether an in-place layer whose batch statistics are taken over ``count`` values a
    channel (all replicas and ranks) may rebuild its input for the input gradient; if not, it
    trains out of place (such layers are tiny: an (N, C, 1, 1) pooling branch). The count
    alone decides, in every ``dtype``.

    Why the count matters. Per channel, with xhat the normalised input, dz the gradient
    reaching the activation's input, m = mean(dz * xhat) and n = ``count``::

        dx = w * invstd * r,   r = dz - mean(dz) - xhat * m

    r is dz less its components along 1 and xhat: n - 2 degrees of freedom. In place, xhat
    is rebuilt from the output, whose rounding u (half an ulp) gives each value an error
    d_i with |d_i| <= u (|xhat_i| + rho), rho = |beta| / |gamma|. That changes dx by::

        w * invstd * (d_i * m + xhat_i * mean(dz * d))

    neither of which shrinks with dx. Write dz - mean(dz) = |dz_c| (cos t e + sin t f), e
    along xhat, f orthogonal to it and to 1: m = |dz_c| cos t / sqrt(n) and
    rms(r) = |dz_c| sin t / sqrt(n). Compared in root mean square over the channel's values
    (rms(xhat) <= 1; the second term averages n independent roundings), the error is at most
    ``u |dz_c| (1 + rho) sqrt(cos^2 t + 1 / (3 n)) / sqrt(n)``, and the bound allows
    ``B u rms(r)`` (B = ``GRADIENT_ERROR_BOUND`` times half an ulp of dx: nn.BatchNorm2d's own
    rounding). So the bound holds where::

        cos^2 t <= c* = (B^2 - (1 + rho)^2 / (3 n)) / (B^2 + (1 + rho)^2)

    dz does not depend on how the output rounds: as a direction random against xhat in the
    n - 1 dimensions of centred values, sin^2 t follows Beta((n - 2) / 2, 1 / 2), and the bound
    fails with chance ``I(1 - c*; (n - 2) / 2, 1 / 2)`` (the regularised incomplete beta
    function), which falls with n and, at rho = 1, is first below ``ACCEPTED_FAILURE_CHANCE``
    at ``MIN_REBUILT_COUNT`` (tests/test_half_precision.py derives it again). At n = 2 dx is 0
    whatever the rebuild.

    The same in every dtype, since the analysis is in units of the output's own rounding:
    a call over fewer values computes as ``inplace=False`` does, leaving the gradients the
    error of the layer's arithmetic alone. From ``MIN_REBUILT_COUNT`` values on, the bound
    holds with that chance for a channel of rho <= 1 whose rebuild computes in a dtype finer
    than its output's: every channel rebuilt in float16 and bfloat16 (float32 arithmetic,
    rho <= ``HALF_PRECISION_LIMIT``). In float32 and float64 the rebuild's arithmetic rounds
    as finely as the output, and channels of rho up to ``1 / MIN_INVERTIBLE_GAMMA`` are
    rebuilt: by c* the error there grows as (1 + rho) / sqrt(n), which no count a layer trains
    on bounds for rho in the hundreds; keeping those channels aside is the memory this dtype
    trades for it (README, Limits).
    """
    return count >= MIN_REBUILT_COUNT


def stays_in_place(activation: str, dtype: torch.dtype) -> bool:
    """Whether an in-place layer of ``activation`` computes in place on inputs of ``dtype``:
    in float16 and bfloat16 ELU runs out of place (saving its input, as ``inplace=False``),
    since no choice of channels bounds how much of its input the output loses there."""
    return not (dtype in torch_ops.HALF_DTYPES and activation in _OUT_OF_PLACE_IN_HALF_PRECISION)


# The views autograd restricts in-place writes to, by their creation kind: where they come from.
_RESTRICTED_VIEWS = {
    "MULTI_OUTPUT_NODE": "an output of torch.chunk, split or unbind (or DataParallel's scatter)",
    "IN_CUSTOM_FUNCTION": "a view made by a custom autograd Function (as a full backward hook "
                          "on this layer, register_full_backward_hook, makes of its input)",
    "NO_GRAD_MODE": "a view made in no-grad mode",
}


def can_overwrite(x: torch.Tensor, warned: list[bool]) -> bool:
    """Whether ``x`` may be overwritten by a custom Function; if not, warn unless ``warned[0]``
    (the layer's flag: once per layer). While compiling: yes, unchecked."""
    if torch.compiler.is_compiling():
        # A compiled call runs out of place whatever this answers
        # (``functional._as_computed``), and Dynamo cannot inspect view provenance: no check,
        # and no warning (one inside the traced code would break the graph).
        return True
    # The usual input first, in the fewest checks: a fresh non-leaf tensor, dense (no two
    # elements share memory), outside inference mode.
    if (not x._is_view()
            and not (x.requires_grad and x.is_leaf)
            and (x.is_contiguous() or x.is_contiguous(memory_format=torch.channels_last))
            and not x.is_inference()):
        return True
    reason = None
    if x.requires_grad and x.is_leaf:
        reason = "a leaf tensor that requires grad"
    elif x.is_inference() and not torch.is_inference_mode_enabled():
        # Made under torch.inference_mode, used outside it (DataParallel's replica threads do
        # not inherit the mode): torch refuses in-place updates there.
        reason = "an inference tensor outside inference mode"
    elif shares_memory_within(x):
        reason = "a tensor whose elements share memory (expand, unfold, as_strided, ...)"
    elif (base := compat.view_base(x)) is not None and base.requires_grad and base.is_leaf:
        reason = "a view of a leaf tensor that requires grad"
    elif base is not None and (kind := compat.view_kind(x)) is not None:
        # Autograd refuses in-place writes to views made by a multi-output op (chunk, split,
        # unbind, DataParallel's scatter), inside a custom Function, or in no-grad mode.
        reason = _RESTRICTED_VIEWS.get(kind, f"a view autograd marks {kind}")
    if reason is None:
        return True
    if not warned[0]:
        warned[0] = True
        warnings.warn(
            f"SyncBatchNorm(inplace=True) got {reason}, which cannot be overwritten; "
            "computing out of place (this warning is shown once per layer)",
            stacklevel=4,
        )
    return False


def shares_memory_within(x: torch.Tensor) -> bool:
    """Whether two elements of ``x`` lie at one address (``expand``, an ``unfold`` whose
    windows overlap, ``as_strided`` with overlapping rows): writing the output over such an
    input writes several elements' values to one address, leaving the output, the input it
    came from, and the input backward rebuilds, wrong.

    Exact. torch's quick check answers most layouts; the rest are decided from the sizes and
    strides: taken by increasing stride, dimensions each of whose stride exceeds the farthest
    offset the smaller ones reach cannot overlap; other layouts (those that interleave, as
    strides (3, 2) over sizes (2, 3) do without overlapping) are told by listing the offsets,
    host work the size of the input, paid only by such layouts, never by a dense input.
    """
    known = compat.internal_overlap(x)
    if known is not None:
        return known
    if x.numel() == 0:
        return False
    dims = sorted((stride, size) for size, stride in zip(x.shape, x.stride()) if size > 1)
    farthest = 0
    for stride, size in dims:
        if stride <= farthest:
            break
        farthest += stride * (size - 1)
    else:
        return False
    offsets = torch.zeros(1, dtype=torch.long)
    for stride, size in dims:
        offsets = (offsets.unsqueeze(1) + torch.arange(size) * stride).view(-1)
    return bool(offsets.unique().numel() < offsets.numel())
