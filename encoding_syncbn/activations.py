"""The activations the layer fuses, and the torch module each one converts to and from.

The one table of activation modules: ``convert_sync_batchnorm`` reads it to fuse a norm layer's
activation module, ``revert_sync_batchnorm`` to give a fused activation back as a module.
"""

from __future__ import annotations

from typing import NamedTuple

from torch import nn


class TorchActivation(NamedTuple):
    """The torch module computing one fused activation."""

    module: type[nn.Module]
    #: The module attribute holding the layer's ``slope`` (None: the activation has none).
    slope_attribute: str | None


#: Fused activation name -> its torch module ("none" has no module).
TORCH_MODULES: dict[str, TorchActivation] = {
    "identity": TorchActivation(nn.Identity, None),
    "relu": TorchActivation(nn.ReLU, None),
    "leaky_relu": TorchActivation(nn.LeakyReLU, "negative_slope"),
    "elu": TorchActivation(nn.ELU, "alpha"),
}
# Exact classes only: a subclass may compute something else.
_NAME_BY_MODULE = {entry.module: name for name, entry in TORCH_MODULES.items()}


def to_module(activation: str, slope: float) -> nn.Module | None:
    """The torch module computing ``activation`` (None for ``"none"``).

    In place where torch can differentiate that (it applies to a fresh tensor, the norm's
    output): ReLU always, leaky_relu and ELU for slope > 0.
    """
    entry = TORCH_MODULES.get(activation)
    if entry is None:
        return None
    if entry.slope_attribute is None:
        return entry.module(inplace=True) if entry.module is nn.ReLU else entry.module()
    return entry.module(slope, inplace=slope > 0)


def from_module(module: nn.Module) -> tuple[str, float] | None:
    """``(activation, slope)`` of the fused activation computing what ``module`` does, or None
    when the layer has no fused form of it (SiLU, GELU, a subclass, ...)."""
    name = _NAME_BY_MODULE.get(type(module))
    if name is None:
        return None
    attribute = TORCH_MODULES[name].slope_attribute
    return name, float(getattr(module, attribute)) if attribute else 0.0
