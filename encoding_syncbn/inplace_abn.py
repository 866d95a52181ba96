r"""A drop-in for mapillary's ``inplace_abn`` package (v1.1.0), with no compile step.

The same public names, signatures, attributes and ``state_dict`` keys (``weight``, ``bias``,
``running_mean``, ``running_var``, ``num_batches_tracked``), built on ``SyncBatchNorm``:

- ``ABN``: BatchNorm then the activation, out of place: ``y = act(xhat * w + b)``.
- ``InPlaceABN``, ``InPlaceABNSync``: ``y = act(xhat * (|w| + eps) + b)``, in place (the
  weight enters as ``|w| + eps``, so gamma is never 0 and the input is always recoverable;
  ``sign(w)`` in its gradient, +1 at ``w = 0``, as mapillary's backward). Without ``weight``
  (``affine=False``) gamma is 1.

where ``xhat = (x - mean) / sqrt(var + eps)``, ``act`` is ``activation`` (``"leaky_relu"``,
``"elu"``, ``"identity"``, and for ``ABN`` also ``"relu"``) with ``activation_param`` its
negative slope or alpha.

Synchronisation. Every class normalises with the whole batch of its *process*: under
``nn.DataParallel`` the statistics are merged across the replicas (a DataParallel batch is
one batch; mapillary's layers normalised each replica apart). Across processes
(``torch.distributed``) ``ABN`` and ``InPlaceABN`` stay per process, as mapillary's;
``InPlaceABNSync`` merges over ``group`` (None: WORLD). The functions ``inplace_abn`` and
``inplace_abn_sync`` see one tensor, so under DataParallel they are per replica (timm's
``InplaceAbn`` calls them: ``convert_sync_batchnorm`` makes it an ``InPlaceABNSync``);
``inplace_abn_sync`` merges across the processes of ``group``.

Where in place is not possible. A leaky_relu of slope <= 0 (smp's ``decoder_use_norm=
"inplace"`` uses slope 0) or an elu of alpha <= 0 cannot be inverted: ``InPlaceABN`` then
computes out of place, with the exact gradient (mapillary's in-place backward lets the
gradient of the zeroed elements through as if they had been positive). An input autograd
will not let us overwrite is handled out of place too (see ``SyncBatchNorm``).

``install()`` makes ``import inplace_abn`` (and ``inplace_abn.abn``, ``.functions``,
``.group``) resolve to this module where mapillary's package is not importable.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.machinery
import importlib.util
import sys
import types
import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from . import activations
from .conversions.convert import SOURCE_ATTRIBUTE, register_conversion, resolve_class, share_state
from .layer.modules import SyncBatchNorm, checked_slope

__all__ = [
    "ABN",
    "InPlaceABN",
    "InPlaceABNSync",
    "active_group",
    "inplace_abn",
    "inplace_abn_sync",
    "install",
    "set_active_group",
]

# The activation names mapillary's layers accept; the in-place ones refuse those this layer
# cannot invert (relu).
_ABN_ACTIVATIONS = ("relu", "leaky_relu", "elu", "identity")
_INPLACE_ACTIVATIONS = tuple(a for a in _ABN_ACTIVATIONS if activations.ACTIVATIONS[a].inverse)
_MAPILLARY = "inplace_abn.abn."  # where mapillary's classes live


class ABN(SyncBatchNorm):
    r"""Activated BatchNorm, out of place: ``y = act((x - E[x]) / sqrt(Var[x] + eps) * w + b)``.

    mapillary's ``inplace_abn.ABN``: same arguments (plus torch's ``device`` / ``dtype``
    keywords), attributes and ``state_dict``. Synchronised across ``nn.DataParallel``
    replicas, per process under ``torch.distributed`` (see the module doc).

    Args:
        num_features: C of an input of shape ``(N, C, *)``.
        eps, momentum, affine, track_running_stats: as ``nn.BatchNorm2d`` (``momentum=None``:
            cumulative average).
        activation: ``"relu"``, ``"leaky_relu"``, ``"elu"`` or ``"identity"``.
        activation_param: the negative slope of leaky_relu or the alpha of elu.
    """

    _activations = _ABN_ACTIVATIONS
    _stands_for = "ABN"  # the mapillary class revert_sync_batchnorm turns it into

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        activation: str = "leaky_relu",
        activation_param: float = 0.01,
        *,
        device: Any = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        if activation not in self._activations:
            raise ValueError(
                f"{type(self).__name__}: activation must be one of {self._activations}, "
                f"got {activation!r}"
            )
        super().__init__(
            num_features, eps, momentum, affine, track_running_stats, None, device, dtype,
            activation=activation, slope=activation_param,
            inplace=self._runs_in_place(activation, checked_slope(
                f"{type(self).__name__}({num_features})", activation_param)),
        )
        setattr(self, SOURCE_ATTRIBUTE, _MAPILLARY + self._stands_for)

    @staticmethod
    def _runs_in_place(activation: str, param: float) -> bool:
        return False

    @property
    def activation_param(self) -> float:
        """mapillary's name for ``slope``: leaky_relu's negative slope, or elu's alpha."""
        return self.slope

    @activation_param.setter
    def activation_param(self, value: float) -> None:
        value = checked_slope(self._label(), value)
        # In place where this class runs in place at that value (InPlaceABN: where it is
        # invertible), unless the layer was set out of place at an invertible value (the
        # user's choice, kept while the values stay invertible), each assignment leaving a
        # valid layer.
        if self._runs_in_place(self.activation, value) and (
                self.inplace or not self._runs_in_place(self.activation, self.slope)):
            self.slope, self.inplace = value, True
        else:
            self.inplace, self.slope = False, value

    def _syncs_processes(self) -> bool:
        return False  # per process, as mapillary's (InPlaceABNSync synchronises)

    def __setstate__(self, state: dict[str, Any]) -> None:
        if "slope" not in state:
            # Pickled by mapillary's package (torch.save of a whole model), unpickled after
            # install(): their attributes only; ``group`` is ours under its other name.
            param = float(state.pop("activation_param"))
            state.update(
                slope=param, sync=True, process_group=state.pop("group", None),
                inplace=self._runs_in_place(state["activation"], param), _last_input_dim=[None],
            )
            state[SOURCE_ATTRIBUTE] = _MAPILLARY + self._stands_for
        super().__setstate__(state)

    def extra_repr(self) -> str:
        text = (
            f"{self.num_features}, eps={self.eps}, momentum={self.momentum}, "
            f"affine={self.affine}, activation={self.activation}"
        )
        if activations.ACTIVATIONS[self.activation].has_param:
            text += f"[{self.activation_param}]"
        return text + f", inplace={self.inplace}" + ("" if self.sync else ", sync=False")


class InPlaceABN(ABN):
    r"""In-Place Activated BatchNorm: ``y = act(xhat * (|w| + eps) + b)``, written over ``x``.

    mapillary's ``inplace_abn.InPlaceABN``: same arguments (plus ``device`` / ``dtype``),
    attributes, ``state_dict`` and math. Synchronised across ``nn.DataParallel`` replicas,
    per process under ``torch.distributed``. In place unless the activation cannot be
    inverted (leaky_relu with ``activation_param <= 0``, elu with alpha <= 0): then out of
    place with exact gradients.

    Args: as ``ABN``; ``activation`` is ``"leaky_relu"``, ``"elu"`` or ``"identity"``.
    """

    _activations = _INPLACE_ACTIVATIONS
    _stands_for = "InPlaceABN"

    @staticmethod
    def _runs_in_place(activation: str, param: float) -> bool:
        return activations.runs_in_place(activation, param)

    def _affine_params(self, weight: torch.Tensor | None, bias: torch.Tensor | None,
                       x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The weight as ``|w| + eps``: ``w * sign`` with a constant sign (+1 at 0), so that
        its gradient is ``sign(w)``, +1 at ``w = 0`` as mapillary's backward.

        The channels ``SyncBatchNorm`` keeps aside in place are picked from this effective
        weight (a single replica's check rides on its statistics) or from the raw ``w``
        (``replicate()``, evaluation): ``|w| <= |w| + eps``, a superset of what it needs.
        """
        affine = weight is not None
        weight, bias = super()._affine_params(weight, bias, x)
        if affine:
            sign = torch.ones_like(weight).masked_fill_(weight.detach() < 0, -1.0)
            weight = weight * sign + self.eps
        return weight, bias


class InPlaceABNSync(InPlaceABN):
    r"""``InPlaceABN`` synchronised over the processes of ``group`` too.

    mapillary's ``inplace_abn.InPlaceABNSync``: ``y = act(xhat * (|w| + eps) + b)`` with the
    statistics of the whole batch of every ``nn.DataParallel`` replica and every process of
    ``group`` (``torch.distributed``; None: WORLD). Without ``torch.distributed`` it is an
    ``InPlaceABN`` (mapillary's warned there; a DataParallel batch is synchronised anyway).

    Args: as ``InPlaceABN``, plus ``group``: the process group (``process_group`` of
    ``SyncBatchNorm``; ``group`` is the same attribute).
    """

    _stands_for = "InPlaceABNSync"

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        activation: str = "leaky_relu",
        activation_param: float = 0.01,
        group: Any = None,
        *,
        device: Any = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(
            num_features, eps, momentum, affine, track_running_stats, activation,
            activation_param, device=device, dtype=dtype,
        )
        self.process_group = group

    @property
    def group(self) -> Any:
        """The ``torch.distributed`` group synchronised over (None: WORLD)."""
        return self.process_group

    @group.setter
    def group(self, group: Any) -> None:
        self.process_group = group

    def set_group(self, group: Any) -> None:
        """Synchronise over ``group`` from the next forward on (not between a forward and
        its backward)."""
        self.process_group = group

    def _syncs_processes(self) -> bool:
        return SyncBatchNorm._syncs_processes(self)


# ---- functions ---------------------------------------------------------------------------


def _call(
    cls: type[InPlaceABN],
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    running_mean: torch.Tensor | None,
    running_var: torch.Tensor | None,
    training: bool,
    momentum: float,
    eps: float,
    activation: str,
    activation_param: float,
    group: Any = None,
) -> torch.Tensor:
    """Run ``x`` through a throw-away layer of class ``cls`` holding the given tensors.

    Built on the meta device, so that nothing is allocated; the given tensors are put in
    place of its parameters and buffers (the running ones are updated in place), and
    ``momentum`` is the factor of that update.
    """
    if not isinstance(x, torch.Tensor) or x.dim() < 2:
        shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"{cls.__name__} function: expected input (N, C, *), got {shape}")
    if training and running_mean is not None and not isinstance(momentum, (int, float)):
        raise TypeError(
            f"{cls.__name__} function: momentum must be a number (the running statistics' "
            f"update factor), got {momentum!r}"
        )
    layer = cls(x.shape[1], eps, momentum, activation=activation,
                activation_param=activation_param, device="meta")
    layer._label_text = f"{cls.__name__} function"  # errors name the call, not a layer
    layer._parameters.update(weight=weight, bias=bias)
    layer._buffers.update(running_mean=running_mean, running_var=running_var,
                          num_batches_tracked=None)
    layer.track_running_stats = running_mean is not None and running_var is not None
    if group is not None:
        layer.process_group = group
    layer.train(training)
    return layer(x)


def inplace_abn(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    running_mean: torch.Tensor | None,
    running_var: torch.Tensor | None,
    training: bool = True,
    momentum: float = 0.1,
    eps: float = 1e-05,
    activation: str = "leaky_relu",
    activation_param: float = 0.01,
) -> torch.Tensor:
    r"""``y = act(xhat * (|weight| + eps) + bias)`` over ``x``'s own batch, written over ``x``.

    mapillary's ``inplace_abn.functions.inplace_abn``: ``xhat`` uses the batch statistics of
    ``x`` when ``training`` (then ``running_mean``/``running_var``, if given, are updated in
    place: ``r = (1 - momentum) r + momentum * stat``, the variance unbiased), else the
    running ones. Returns the output: ``x`` itself, or a new tensor where in place is not
    possible (see the module doc). Not synchronised: it sees only ``x``.
    """
    return _call(InPlaceABN, x, weight, bias, running_mean, running_var, training, momentum,
                 eps, activation, activation_param)


def inplace_abn_sync(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    running_mean: torch.Tensor | None,
    running_var: torch.Tensor | None,
    training: bool = True,
    momentum: float = 0.1,
    eps: float = 1e-05,
    activation: str = "leaky_relu",
    activation_param: float = 0.01,
    group: Any = None,
) -> torch.Tensor:
    r"""``inplace_abn`` with the statistics of ``x`` on every process of ``group`` (None:
    WORLD); every process of the group must call it. Without ``torch.distributed``, it is
    ``inplace_abn``."""
    return _call(InPlaceABNSync, x, weight, bias, running_mean, running_var, training,
                 momentum, eps, activation, activation_param, group)


# ---- groups ------------------------------------------------------------------------------

# The groups ``active_group`` made, by their set of ranks (created once: new_group is collective).
_ACTIVE_GROUPS: dict[frozenset[int], Any] = {}


def active_group(active: bool) -> Any:
    """The process group of the ranks that pass ``active=True`` (collective: every rank calls).

    WORLD when all are active, None when none is; a rank outside the group gets
    ``dist.GroupMember.NON_GROUP_MEMBER``, with which the layers normalise per process.
    """
    flags: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(flags, dist.get_rank() if active else -1)
    ranks = frozenset(rank for rank in flags if rank >= 0)
    if not ranks:
        return None
    if len(ranks) == dist.get_world_size():
        return dist.group.WORLD
    if ranks not in _ACTIVE_GROUPS:
        _ACTIVE_GROUPS[ranks] = dist.new_group(sorted(ranks))
    return _ACTIVE_GROUPS[ranks]


def set_active_group(module: nn.Module, group: Any) -> None:
    """Call ``set_group(group)`` on every submodule of ``module`` that has one."""
    for child in module.modules():
        if hasattr(child, "set_group"):
            child.set_group(group)


# ---- conversions -------------------------------------------------------------------------



def _mapillary_args(layer: nn.Module) -> tuple:
    """mapillary's positional arguments, from one of their layers or a ``SyncBatchNorm``."""
    param = layer.slope if isinstance(layer, SyncBatchNorm) else layer.activation_param
    return (layer.num_features, layer.eps, layer.momentum, layer.affine,
            layer.track_running_stats, layer.activation, param)


def _abn_to_sync(module: nn.Module, process_group: Any) -> SyncBatchNorm:
    """An ``ABN`` (BatchNorm + activation out of place) synchronised over ``process_group``:
    ``SyncBatchNorm`` with the activation fused, the same parameters."""
    args = _mapillary_args(module)
    converted = SyncBatchNorm(*args[:5], process_group, device="meta", activation=args[5],
                              slope=args[6], inplace=False)
    return share_state(module, converted)


def _inplace_abn_to_sync(module: nn.Module, process_group: Any) -> InPlaceABNSync:
    """An ``InPlaceABN`` / ``InPlaceABNSync``: ``InPlaceABNSync`` over the module's own group
    if it has one, else ``process_group``; the same ``weight`` (used as ``|w| + eps`` by
    both), bias and buffers; out of place where ours was set so (mapillary's have no
    ``inplace``: always in place)."""
    group = getattr(module, "group", None)
    converted = InPlaceABNSync(*_mapillary_args(module), process_group if group is None
                               else group, device="meta")
    if not getattr(module, "inplace", True):  # its input is read again after it
        converted.inplace = False
    return share_state(module, converted)


def _to_mapillary(name: str):
    """``to_original`` for mapillary's class ``name``: that class when mapillary's package
    imports, else (also after ``install()``) ours, with ``sync=False``: per replica too. A
    layer set out of place where the class runs in place reverts to ours, out of place:
    mapillary's would write over an input read again."""

    def to_original(layer: SyncBatchNorm) -> nn.Module:
        cls = globals()[name]
        if layer.inplace or not cls._runs_in_place(layer.activation, layer.slope):
            with contextlib.suppress(ImportError, AttributeError):
                cls = resolve_class(_MAPILLARY + name)
        group = {"group": layer.process_group} if name == "InPlaceABNSync" else {}
        original = share_state(layer, cls(*_mapillary_args(layer), **group))
        if isinstance(original, SyncBatchNorm):
            original.sync = False
            if not layer.inplace:  # (ABN never runs in place, whatever it was converted to)
                original.inplace = False
        return original

    return to_original


def _timm_to_sync(module: nn.Module, process_group: Any) -> InPlaceABNSync:
    """timm's ``InplaceAbn`` calls ``inplace_abn`` (per replica): ``InPlaceABNSync`` over
    ``process_group``, the same parameters and buffers (it has no ``num_batches_tracked``)."""
    converted = InPlaceABNSync(
        module.num_features, module.eps, module.momentum, module.affine, True,
        module.act_name, module.act_param, process_group, device="meta",
    )
    return share_state(module, converted)


def _timm_to_original(layer: SyncBatchNorm) -> nn.Module:
    original = resolve_class(_TIMM)(layer.num_features, layer.eps, layer.momentum, layer.affine,
                                    act_layer=layer.activation, act_param=layer.slope)
    return share_state(layer, original)


_TIMM = "timm.layers.inplace_abn.InplaceAbn"
register_conversion(_TIMM, _timm_to_sync, _timm_to_original)
# Theirs, and ours: ours are synchronised under DataParallel already, but ABN and InPlaceABN
# are per process under torch.distributed, which a conversion must not leave.
for _source, _to_sync in ((ABN, _abn_to_sync), (InPlaceABN, _inplace_abn_to_sync),
                          (InPlaceABNSync, _inplace_abn_to_sync)):
    register_conversion(_source, _to_sync, _to_mapillary(_source.__name__))
    register_conversion(_MAPILLARY + _source.__name__, _to_sync, _to_mapillary(_source.__name__))


# ---- install -----------------------------------------------------------------------------

# The modules of mapillary's package and the names each one exports.
_ALIASES = {
    "inplace_abn": ("ABN", "InPlaceABN", "InPlaceABNSync", "active_group", "set_active_group"),
    "inplace_abn.abn": ("ABN", "InPlaceABN", "InPlaceABNSync"),
    "inplace_abn.functions": ("inplace_abn", "inplace_abn_sync"),
    "inplace_abn.group": ("active_group", "set_active_group"),
}
_MARK = "__encoding_syncbn__"  # set on the alias modules: install() ran


def _rebind_importers(package: types.ModuleType) -> list[str]:
    """Libraries that tried ``import inplace_abn`` once, at their own import, and kept a
    fallback: give them ours. Only their fallbacks are replaced. Returns what was patched."""
    patched = []
    timm_iabn = sys.modules.get("timm.layers.inplace_abn")
    if timm_iabn is not None and getattr(timm_iabn, "has_iabn", True) is False:
        timm_iabn.inplace_abn = inplace_abn
        timm_iabn.inplace_abn_sync = inplace_abn_sync
        timm_iabn.has_iabn = True
        patched.append("timm.layers.inplace_abn")
    smp_modules = sys.modules.get("segmentation_models_pytorch.base.modules")
    if smp_modules is not None and getattr(smp_modules, "InPlaceABN", False) is None:
        smp_modules.InPlaceABN = package.InPlaceABN
        patched.append("segmentation_models_pytorch.base.modules")
    return patched


def install() -> bool:
    """Make ``import inplace_abn`` resolve to this module where mapillary's package is absent.

    Registers ``inplace_abn``, ``inplace_abn.abn``, ``inplace_abn.functions`` and
    ``inplace_abn.group`` in ``sys.modules``, holding this module's classes and functions.
    timm and segmentation_models_pytorch try ``import inplace_abn`` once, when they are
    imported: if they already were, the fallbacks they kept (timm's ``inplace_abn`` functions
    that raise, smp's ``InPlaceABN = None``) are replaced by ours, so the call may come before
    or after their import.

    Returns True when ``inplace_abn`` is ours (now or from an earlier call), False when
    mapillary's package imports: then nothing is changed. A mapillary package that is
    installed but fails to import (a broken build) is replaced, with a warning.
    """
    loaded = sys.modules.get("inplace_abn")
    if loaded is not None:
        return getattr(loaded, _MARK, False)
    try:
        found = importlib.util.find_spec("inplace_abn") is not None
    except (ImportError, ValueError):
        found = False
    if found:
        try:
            importlib.import_module("inplace_abn")
            return False
        except ImportError as error:
            warnings.warn(
                f"mapillary's inplace_abn is installed but does not import ({error}); "
                "encoding_syncbn.inplace_abn.install() puts encoding_syncbn's in its place",
                RuntimeWarning,
                stacklevel=2,
            )
    this = sys.modules[__name__]
    modules = {}
    for name, exported in _ALIASES.items():
        alias = types.ModuleType(name, f"encoding_syncbn.inplace_abn, installed as {name!r}.")
        alias.__spec__ = importlib.machinery.ModuleSpec(
            name, None, is_package=name == "inplace_abn"
        )
        if name == "inplace_abn":
            alias.__path__ = []
        for attribute in exported:
            setattr(alias, attribute, getattr(this, attribute))
        setattr(alias, _MARK, True)
        modules[name] = alias
    package = modules["inplace_abn"]
    for name, alias in modules.items():
        if name != "inplace_abn":
            setattr(package, name.rpartition(".")[2], alias)
        sys.modules[name] = alias
    _rebind_importers(package)
    return True
