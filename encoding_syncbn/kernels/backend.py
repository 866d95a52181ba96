"""The backend protocol: the layer's four ops behind one typed signature.

A backend computes, per channel, what ``torch_ops`` (the reference) documents::

    channel_stats(x)                                -> (mean, M2, count)
    normalize_act(x, params, out)                   out = act((x - mean) * invstd * weight + bias)
    backward_reduce(saved, dy, params, from_output) -> (sum(dz), sum(dz * xhat))
    backward_dx(saved, dy, params, from_output, coefs)
                                    dx = coefs.dz * dz + coefs.xhat * xhat + coefs.const

``params`` bundles what every op but the statistics needs (:class:`NormParams`), ``coefs`` the
backward's per-channel coefficients (:class:`DxCoefs`); both are NamedTuples in the order of the
flat ``torch_ops`` signatures, so an implementation over flat functions unpacks them with ``*``.
A new backend, or a test double, is one class implementing :class:`Backend`, registered with
``kernels.register_backend``.
"""

from __future__ import annotations

from types import ModuleType
from typing import NamedTuple, Protocol

import torch


class NormParams(NamedTuple):
    """Per-channel vectors in the statistics dtype, and the activation ``y = act(z)``
    (``slope``: leaky_relu's negative slope, ELU's alpha)."""

    mean: torch.Tensor
    invstd: torch.Tensor
    weight: torch.Tensor
    bias: torch.Tensor
    activation: str
    slope: float


class DxCoefs(NamedTuple):
    """``dx = dz * coef_dz + xhat * coef_xhat + coef_const``, per channel."""

    dz: torch.Tensor
    xhat: torch.Tensor
    const: torch.Tensor


class Backend(Protocol):
    """The four ops of the layer; ``saved`` is the input (``saved_is_output=False``) or the
    output the activation is inverted from."""

    name: str

    def channel_stats(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]: ...

    def normalize_act(self, x: torch.Tensor, params: NormParams,
                      out: torch.Tensor) -> torch.Tensor: ...

    def backward_reduce(self, saved: torch.Tensor, dy: torch.Tensor, params: NormParams,
                        saved_is_output: bool) -> tuple[torch.Tensor, torch.Tensor]: ...

    def backward_dx(self, saved: torch.Tensor, dy: torch.Tensor, params: NormParams,
                    saved_is_output: bool, coefs: DxCoefs) -> torch.Tensor: ...


class FunctionsBackend:
    """A backend over a module of flat functions with ``torch_ops``' signatures (``torch_ops``
    itself; ``compile_ops``, its traceable twin)."""

    def __init__(self, name: str, functions: ModuleType) -> None:
        self.name = name
        self._f = functions

    def __repr__(self) -> str:
        return f"<backend {self.name!r}>"

    def channel_stats(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
        return self._f.channel_stats(x)

    def normalize_act(self, x: torch.Tensor, params: NormParams,
                      out: torch.Tensor) -> torch.Tensor:
        return self._f.normalize_act(x, *params, out)

    def backward_reduce(self, saved: torch.Tensor, dy: torch.Tensor, params: NormParams,
                        saved_is_output: bool) -> tuple[torch.Tensor, torch.Tensor]:
        return self._f.backward_reduce(saved, dy, *params, saved_is_output)

    def backward_dx(self, saved: torch.Tensor, dy: torch.Tensor, params: NormParams,
                    saved_is_output: bool, coefs: DxCoefs) -> torch.Tensor:
        return self._f.backward_dx(saved, dy, *params, saved_is_output, *coefs)
