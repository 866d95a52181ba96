"""The activations the layer fuses: one definition each, the one place that lists them.

Per activation: its name, its torch forward (out of place, differentiable; and in place), its
derivative from the pre-activation ``z``, its inverse from the output ``y`` when it has one
(which alone decides whether the layer may run in place: backward then rebuilds ``z`` from
``y``), the torch modules it converts to and from, and the id its Triton code is selected by.
The torch ops, the Triton kernels, the argument checks, convert/revert, ``convert_inplace_abn``
and ``inplace_abn`` all read this table. Adding an activation is one entry here, its Triton
code under that id, and its tests.

``activation_param`` is the activation's one float parameter where it has one (leaky_relu's
negative slope, ELU's alpha: the layer's ``slope``); activations without one ignore it.
Derivatives come from ATen's own activation backwards, so that every branch convention (NaN,
z == 0) is exactly torch's, except where ATen's CPU kernels disagree with themselves: ELU's
backward gives NaN at a NaN z in its vectorised body and ``dy`` in its scalar loop (a tensor's
tail, a strided walk), so the same input got a NaN or a finite gradient by its size and layout;
here it is NaN everywhere, as in the vectorised body (what nn.ELU gives on tensors of any
realistic size) and the Triton kernels.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

_aten = torch.ops.aten


def elu_inverse_floor(dtype: torch.dtype) -> float:
    """Where ELU's inverse ``log1p(y / alpha)`` is clamped: the ``dtype`` number nearest -1
    from above. The inverse diverges as y -> -alpha, and rounding can even put y / alpha below
    -1; clamped elements carry a vanishing gradient (dz = dy * (y + alpha)). Any higher floor
    would cut off z that ``dtype`` still holds (down to -16.6 in fp32, -36.7 in fp64)."""
    return -1.0 + torch.finfo(dtype).eps / 2


class TorchModule(NamedTuple):
    """A torch module class computing the activation (exact class: a subclass may compute
    something else)."""

    cls: type[nn.Module]
    #: The attribute (and constructor keyword) holding ``activation_param``; None: the module
    #: has none.
    parameter: str | None = None
    #: Attributes the module must have, with these values, to compute this activation
    #: (``nn.GELU``'s ``approximate``); also passed to its constructor.
    fixed: tuple[tuple[str, object], ...] = ()


class Activation(NamedTuple):
    """One fused activation. Functions take ``(tensor, activation_param)`` unless said otherwise."""

    name: str
    #: ``act(z)`` out of place, differentiable any number of times (double backward).
    forward: Callable[[torch.Tensor, float], torch.Tensor]
    #: ``act(z)`` written over ``z``.
    forward_: Callable[[torch.Tensor, float], torch.Tensor]
    #: ``(dy, z, activation_param, out) -> out = dy * act'(z)`` (``out`` may be ``z``); None:
    #: act' = 1.
    derivative: Callable[..., torch.Tensor] | None
    #: ``(y, dy, activation_param, z_out, dz_out, aux) -> None``: writes ``z = act^-1(y)`` into
    #: ``z_out`` and ``dy * act'(z)`` into ``dz_out``, from the output alone (``z_out`` may be
    #: ``y``; ``aux`` is scratch, and may hold ``dy``; None: the inverse allocates any scratch
    #: it needs, as a caller's untouched full-size buffer still costs an allocation). None:
    #: not invertible, never in place.
    inverse: Callable[..., None] | None
    #: Torch modules computing it: the first is what revert builds, all convert to it.
    modules: tuple[TorchModule, ...]
    #: The Triton ``ACTIVATION`` constexpr its kernels are specialised on, and the parameter
    #: they are called with (None: the layer's own). "none" and "identity" run as leaky_relu
    #: with slope 1, which is exact (z * 1 == z, y / 1 == y) and saves a specialisation per
    #: kernel.
    kernel: str
    kernel_param: float | None = None
    #: Whether the inverse needs ``activation_param > 0`` (it divides by it).
    inverse_needs_positive_param: bool = False
    #: ``(activation_param) -> bool``: the ``inplace`` of the module ``to_module`` builds (True
    #: where torch differentiates it from its output; it applies to a fresh tensor, the norm's
    #: output). None: the module takes no ``inplace``.
    module_inplace: Callable[[float], bool] | None = None
    #: ``torch.nn.functional`` forms ``convert_inplace_abn`` recognises in a traced model, with
    #: the keyword and default of their parameter.
    functional: tuple[tuple[Callable, str, float], ...] = ()

    @property
    def has_param(self) -> bool:
        return any(module.parameter for module in self.modules)


def _identity(z: torch.Tensor, _: float) -> torch.Tensor:
    return z


def _invert_identity(y, dy, _, z_out, dz_out, aux) -> None:
    dz_out.copy_(dy)
    if z_out is not y:
        z_out.copy_(y)


def _invert_leaky_relu(y, dy, activation_param, z_out, dz_out, aux) -> None:
    # z = y where y > 0, y / activation_param elsewhere
    _aten.leaky_relu_backward.grad_input(dy, y, activation_param, True, grad_input=dz_out)
    _aten.leaky_relu.out(y, 1.0 / activation_param, out=z_out)


def _elu_derivative(dy, z, activation_param, out, is_result: bool = False) -> torch.Tensor:
    """``out = dy * elu'(z)`` (from the output where ``is_result``), NaN where ``z`` is NaN
    (see the module docstring)."""
    nan = torch.isnan(z)  # before ``out``, which may be ``z``, is written
    _aten.elu_backward.grad_input(dy, activation_param, 1, 1, is_result, z, grad_input=out)
    return out.masked_fill_(nan, float("nan"))


def _invert_elu(y, dy, activation_param, z_out, dz_out, aux) -> None:
    # z = y where y > 0, log1p(y / alpha) (clamped) elsewhere; aux (maybe dy) used after dz.
    _elu_derivative(dy, y, activation_param, dz_out, is_result=True)
    if aux is None:
        aux = torch.empty_like(z_out)
    torch.clamp(y, max=0, out=aux).div_(activation_param)
    aux.clamp_(min=elu_inverse_floor(aux.dtype)).log1p_()
    torch.clamp(y, min=0, out=z_out).add_(aux)


def _positive(activation_param: float) -> bool:
    return activation_param > 0


def _gelu(approximate: str) -> dict:
    """The fields of GELU in its exact (erf) or its tanh form."""
    return dict(
        forward=lambda z, _: F.gelu(z, approximate=approximate),
        forward_=lambda z, _: _aten.gelu_(z, approximate=approximate),
        derivative=lambda dy, z, _, out: _aten.gelu_backward.grad_input(
            dy, z, approximate=approximate, grad_input=out),
        inverse=None, modules=(TorchModule(nn.GELU, None, (("approximate", approximate),)),),
    )


_DEFINITIONS = (
    # A plain BatchNorm: no activation. Invertible, but never in place by the layer's
    # contract (it keeps its input; "identity" is the in-place form).
    Activation(name="none", forward=_identity, forward_=_identity, derivative=None,
               inverse=_invert_identity, modules=(), kernel="leaky_relu", kernel_param=1.0),
    Activation(name="identity", forward=_identity, forward_=_identity, derivative=None,
               inverse=_invert_identity, modules=(TorchModule(nn.Identity),),
               kernel="leaky_relu", kernel_param=1.0),
    Activation(
        name="leaky_relu", forward=F.leaky_relu, forward_=F.leaky_relu_,
        derivative=lambda dy, z, activation_param, out: _aten.leaky_relu_backward.grad_input(
            dy, z, activation_param, False, grad_input=out),
        inverse=_invert_leaky_relu, inverse_needs_positive_param=True,
        modules=(TorchModule(nn.LeakyReLU, "negative_slope"),), module_inplace=_positive,
        kernel="leaky_relu", functional=((F.leaky_relu, "negative_slope", 0.01),),
    ),
    Activation(
        name="elu", forward=F.elu, forward_=F.elu_,
        derivative=_elu_derivative, inverse=_invert_elu, inverse_needs_positive_param=True,
        modules=(TorchModule(nn.ELU, "alpha"),), module_inplace=_positive,
        kernel="elu", functional=((F.elu, "alpha", 1.0),),
    ),
    # relu loses z < 0: not invertible.
    Activation(
        name="relu", forward=lambda z, _: torch.relu(z), forward_=lambda z, _: z.relu_(),
        derivative=lambda dy, z, _, out: _aten.threshold_backward.grad_input(
            dy, z, 0, grad_input=out),
        inverse=None, modules=(TorchModule(nn.ReLU),), module_inplace=lambda _: True,
        kernel="relu",
    ),
    # SiLU and GELU are not monotonic: not invertible, out of place only.
    # silu(z) = z * sigmoid(z)
    Activation(
        name="silu", forward=lambda z, _: F.silu(z),
        forward_=lambda z, _: F.silu(z, inplace=True),
        derivative=lambda dy, z, _, out: _aten.silu_backward.grad_input(
            dy, z, grad_input=out),
        inverse=None, modules=(TorchModule(nn.SiLU),), kernel="silu",
    ),
    # gelu(z) = z / 2 * (1 + erf(z / sqrt(2)))
    Activation(name="gelu", kernel="gelu", **_gelu("none")),
    # gelu_tanh(z) = z / 2 * (1 + tanh(sqrt(2 / pi) * (z + 0.044715 z^3)))
    Activation(name="gelu_tanh", kernel="gelu_tanh", **_gelu("tanh")),
)

#: Name -> definition, for every activation the layer fuses.
ACTIVATIONS: dict[str, Activation] = {a.name: a for a in _DEFINITIONS}


def get(name: str, layer: str = "SyncBatchNorm") -> Activation:
    """The definition of ``name``; a ValueError naming ``layer`` and the choices if unknown."""
    try:
        return ACTIVATIONS[name]
    except (KeyError, TypeError):
        raise ValueError(
            f"{layer}: activation must be one of {sorted(ACTIVATIONS)}, got {name!r}"
        ) from None


def runs_in_place(name: str, activation_param: float) -> bool:
    """Whether ``name`` at ``activation_param`` can be inverted from its output (so may run
    in place)."""
    definition = ACTIVATIONS[name]
    return definition.inverse is not None and (
        not definition.inverse_needs_positive_param or activation_param > 0
    )


def to_module(activation: str, activation_param: float) -> nn.Module | None:
    """The torch module computing ``activation`` (None for ``"none"``), in place where torch
    can differentiate that."""
    definition = ACTIVATIONS[activation]
    if not definition.modules:
        return None
    entry = definition.modules[0]
    kwargs = dict(entry.fixed)
    if entry.parameter:
        kwargs[entry.parameter] = activation_param
    if definition.module_inplace is not None:
        kwargs["inplace"] = definition.module_inplace(activation_param)
    return entry.cls(**kwargs)


def from_module(module: nn.Module) -> tuple[str, float] | None:
    """``(activation, activation_param)`` of the fused activation computing what ``module``
    does, or None when the layer has no fused form of it (Hardswish, a subclass, ...)."""
    for definition in _DEFINITIONS:
        for entry in definition.modules:
            if type(module) is entry.cls and all(
                getattr(module, attribute, None) == value for attribute, value in entry.fixed
            ):
                param = float(getattr(module, entry.parameter)) if entry.parameter else 0.0
                return definition.name, param
    return None


class ActConfig(NamedTuple):
    """The activation a layer fuses after its normalisation, and whether it overwrites its
    input (the layer's, and what a call computes with).

    ``activation_param``: leaky_relu's negative slope, ELU's alpha (the layer's ``slope``).
    ``layer``: how errors name the layer (``SyncBatchNorm._label``).
    """

    activation: str
    activation_param: float
    inplace: bool
    layer: str = "SyncBatchNorm"

    def out_of_place(self) -> ActConfig:
        """This configuration, computing into a new tensor. Field by field, not ``_replace``:
        Dynamo (torch 2.11) rebuilds ``_replace``'s result short of its fields after a graph
        break, and reading one fails there."""
        return ActConfig(self.activation, self.activation_param, False, self.layer)
