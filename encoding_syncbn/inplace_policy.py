"""When ``SyncBatchNorm`` may run in place: a slope it can invert, an input it may overwrite.

Both are decided before anything is computed: a refusal by autograd inside the Function would
come after the input, and the running statistics, had been written.
"""

from __future__ import annotations

import warnings

import torch

from . import _compat, activations
from .kernels import torch_ops


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
    elif _compat.has_internal_overlap(x):
        reason = "a tensor whose elements share memory (torch.expand, ...)"
    elif (base := _compat.view_base(x)) is not None and base.requires_grad and base.is_leaf:
        reason = "a view of a leaf tensor that requires grad"
    elif base is not None and (kind := _compat.view_kind(x)) is not None:
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
