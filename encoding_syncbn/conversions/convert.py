"""Swap every norm layer of a model for a synchronised one and back, over a registry of
conversions.

A conversion says, for one source class, how to build the synchronised layer from an instance
(``to_sync``) and how to build the source class back from that layer (``to_original``). torch's
BatchNorms, timm's norm+activation layers and this package's ``BatchNormAct`` are registered
here; other modules register their own with ``register_conversion``. Sources may be named by a
string, so that timm (or any other library) is never imported by the converter.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from typing import Any, Callable, Literal, NamedTuple, overload

from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.lazy import LazyModuleMixin
from torch.nn.utils import parametrize

from .. import activations, compat
from ..layer.modules import SyncBatchNorm, record_paths
from ..layer.norm_act import BatchNormAct, SyncBatchNormAct
from . import reporting, saved_memory
from .reporting import ConversionReport, Judgement, MemoryEstimate

_BATCHNORM_BY_INPUT_DIM = {
    2: nn.BatchNorm1d, 3: nn.BatchNorm1d, 4: nn.BatchNorm2d, 5: nn.BatchNorm3d
}
# What a converted layer remembers as its input's rank until it sees one (1d: 3-D).
_INPUT_DIM_BY_BATCHNORM = {cls: dim for dim, cls in _BATCHNORM_BY_INPUT_DIM.items()}
# The attribute of a converted module naming the registered source it came from: a string, so
# that deepcopy, pickle and DataParallel's replicas keep it (load_state_dict leaves it alone).
SOURCE_ATTRIBUTE = "_converted_from"


class _Conversion(NamedTuple):
    source: str
    to_sync: Callable[[nn.Module, Any], nn.Module]
    to_original: Callable[[nn.Module], nn.Module] | None


_CONVERSIONS: dict[str, _Conversion] = {}


def _key(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def register_conversion(
    source: type | str,
    to_sync: Callable[[nn.Module, Any], nn.Module],
    to_original: Callable[[nn.Module], nn.Module] | None = None,
) -> None:
    """Teach ``convert_sync_batchnorm`` (and ``revert_sync_batchnorm``) a norm layer class.

    Args:
        source: the class, or its ``"module.QualName"`` (matched against
            ``f"{type(m).__module__}.{type(m).__qualname__}"``, so that its library need not
            be imported). Its subclasses that do not override ``forward`` convert like it.
        to_sync: ``(original, process_group) -> module``: the synchronised layer computing
            what ``original`` computes, sharing its Parameters and buffers so that its
            ``state_dict`` loads with the same keys.
        to_original: ``(synced) -> module``: an instance of ``source`` (or what it stands for)
            computing what ``synced`` computes. None: ``synced`` must be a ``SyncBatchNorm``
            computing a plain BatchNorm (with its fused activation), and reverts as one built
            directly does.

    Registering a source again replaces its conversion.
    """
    if isinstance(source, type):
        source = _key(source)
    if not isinstance(source, str) or "." not in source:
        raise TypeError(
            f"register_conversion: source must be a class or its 'module.QualName', got "
            f"{source!r}"
        )
    if not callable(to_sync) or not (to_original is None or callable(to_original)):
        raise TypeError(
            f"register_conversion({source!r}): to_sync must be callable and to_original "
            f"callable or None, got {to_sync!r} and {to_original!r}"
        )
    _CONVERSIONS[source] = _Conversion(source, to_sync, to_original)


@overload
def convert_sync_batchnorm(module: nn.Module, process_group: Any = None, *,
                           report: Literal[False] = False,
                           input_shape: Sequence[int] | None = None) -> nn.Module: ...


@overload
def convert_sync_batchnorm(module: nn.Module, process_group: Any = None, *,
                           report: Literal[True],
                           input_shape: Sequence[int] | None = None
                           ) -> tuple[nn.Module, ConversionReport]: ...


def convert_sync_batchnorm(module: nn.Module, process_group: Any = None, *,
                           report: bool = False, input_shape: Sequence[int] | None = None
                           ) -> nn.Module | tuple[nn.Module, ConversionReport]:
    """Return ``module`` with every norm layer the registry knows replaced by a synchronised
    one computing the same thing.

    torch's ``BatchNorm1d/2d/3d``, ``SyncBatchNorm`` and lazy BatchNorms (once materialised)
    become ``SyncBatchNorm``s; timm's ``BatchNormAct2d`` / ``SyncBatchNormAct`` too, with their
    activation fused (out of place) when the layer has it, else kept as their ``drop`` and
    ``act`` modules (``SyncBatchNormAct``). The new layers reuse the old ones' Parameter
    objects and buffers (so an optimizer built before the conversion keeps working, and the
    old ``state_dict`` loads), and their device, dtype and training flag. A module referenced
    from several places stays one module. Works on a model already wrapped in
    ``nn.DataParallel``. Also ``SyncBatchNorm.convert_sync_batchnorm``.

    ``report=True``: returns ``(module, report)``, a ``ConversionReport`` with a row per norm
    layer (converted, or left and why: a frozen BatchNorm, an unknown norm class);
    ``input_shape``: it also estimates the activations a training step keeps for backward on
    an input of that shape, before and after (see ``saved_memory``). The summary is logged at
    INFO on the ``encoding_syncbn`` logger.

    Raises:
        TypeError: a subclass of a registered class (``_BatchNorm`` included) that overrides
            ``forward`` and is not registered itself: converting it could change what it
            computes (teach it with ``register_conversion``).
        ValueError: a lazy BatchNorm that has not seen an input yet.
    """
    return run_reported("convert_sync_batchnorm", module, report, input_shape,
                        lambda root, _: (synchronise(root, process_group), _sync_judgement))


def synchronise(module: nn.Module, process_group: Any = None) -> nn.Module:
    """``convert_sync_batchnorm`` without its report: for converters that report
    themselves."""

    def to_sync(child: nn.Module, path: str) -> nn.Module | None:
        conversion = _conversion_for(child, path)
        if conversion is None:
            return None
        if isinstance(child, LazyModuleMixin) and child.has_uninitialized_params():
            raise ValueError(
                f"convert_sync_batchnorm: {type(child).__name__} at {_where(path)} has no "
                "num_features yet; run one forward before converting the model"
            )
        converted = conversion.to_sync(child, process_group)
        if not isinstance(converted, nn.Module):
            raise TypeError(
                f"convert_sync_batchnorm: the to_sync registered for {conversion.source} "
                f"returned {type(converted).__name__}, expected an nn.Module"
            )
        setattr(converted, SOURCE_ATTRIBUTE, conversion.source)
        return converted

    module = _replace_all(module, to_sync)
    record_paths(module)  # errors name each layer by its path in the model
    return module


# Where nn.SyncBatchNorm users look for it. Attached here: the layer's module does not import
# its converters (they import it).
SyncBatchNorm.convert_sync_batchnorm = staticmethod(convert_sync_batchnorm)


@overload
def revert_sync_batchnorm(module: nn.Module, *, report: Literal[False] = False,
                          input_shape: Sequence[int] | None = None) -> nn.Module: ...


@overload
def revert_sync_batchnorm(module: nn.Module, *, report: Literal[True],
                          input_shape: Sequence[int] | None = None
                          ) -> tuple[nn.Module, ConversionReport]: ...


def revert_sync_batchnorm(module: nn.Module, *, report: bool = False,
                          input_shape: Sequence[int] | None = None
                          ) -> nn.Module | tuple[nn.Module, ConversionReport]:
    """Return ``module`` with every synchronised layer replaced by a per-replica one.

    A converted layer becomes its source class again (the registered ``to_original``): timm's
    layers come back with their ``act`` and ``drop``. torch's classes, and layers built
    directly, become ``nn.BatchNorm1d/2d/3d`` chosen by the last input's rank (1d for 2-D and
    3-D inputs, 3d for 5-D, 2d otherwise; before any input, the class converted from), or
    ``BatchNormAct`` (any rank, ``drop`` and ``act`` modules after the normalisation) for a
    layer with an activation or an input of more than 5 dimensions: the ``state_dict`` keys
    stay the same. Parameters and buffers are shared, not copied; shared modules stay shared.

    ``report`` and ``input_shape``: as ``convert_sync_batchnorm``'s.
    """
    return run_reported("revert_sync_batchnorm", module, report, input_shape, _revert)


def _revert(module: nn.Module, reporting: bool) -> tuple[nn.Module, Judge]:
    """``revert_sync_batchnorm`` without its report, and what to say of each norm layer
    (``reporting`` changes nothing here: the reasons need no trace)."""

    def to_original(child: nn.Module, path: str) -> nn.Module | None:
        # Its own attribute: a wrapper may forward attribute reads to the module it wraps.
        source = vars(child).get(SOURCE_ATTRIBUTE)
        if source is None and not isinstance(child, SyncBatchNorm):
            return None
        if source is not None:
            conversion = _CONVERSIONS.get(source)
            if conversion is None:
                raise LookupError(
                    f"revert_sync_batchnorm: {type(child).__name__} at {_where(path)} was "
                    f"converted from {source}, whose conversion is not registered in this "
                    "process; import the module that registers it first"
                )
            if conversion.to_original is not None:
                return conversion.to_original(child)
        _check_plain_forward(child, path)
        return _to_plain(child)

    return _replace_all(module, to_original), _revert_judgement


Judge = Callable[[nn.Module, nn.Module], Judgement]


def run_reported(converter: str, module: nn.Module, asked: bool,
                 input_shape: Sequence[int] | None,
                 convert: Callable[[nn.Module, bool], tuple[nn.Module, Judge]]
                 ) -> nn.Module | tuple[nn.Module, ConversionReport]:
    """``convert(module, reporting)`` (the converted model, and what to say of each norm
    layer: from the layer before and after), with the report of ``converter`` when it is
    asked for (``asked``: returned with the model) or logged (``reporting``: either)."""
    if not reporting.wanted(asked):
        return convert(module, False)[0]
    originals = norm_layers(module)
    before = (None if input_shape is None else
              saved_memory.measure_for(converter, module, input_shape, list(originals)))
    converted, judge = convert(module, True)
    memory = None
    if before is not None:
        after = saved_memory.measure_for(converter, converted, input_shape, [])
        memory = MemoryEstimate(tuple(input_shape), str(before.dtype).removeprefix("torch."),
                                before.bytes, after.bytes)
    judgements = {path: judge(original, converted.get_submodule(path))
                  for path, original in originals.items()}
    report = reporting.build(converter, originals, converted, judgements,
                                     None if before is None else before.norm_inputs, memory)
    return (converted, report) if asked else converted


def norm_layers(module: nn.Module) -> dict[str, nn.Module]:
    """Path -> module of every norm layer in ``module`` (each once, at its first path):
    those the registry knows, and those it leaves (``reporting.left_reason``)."""
    return {path: child for path, child in module.named_modules()
            if is_norm_layer(child) or left_reason(child) is not None}


def left_reason(module: nn.Module) -> str | None:
    """Why ``module``, which normalises by batch statistics but is no class the registry
    knows, is left as it is (``reporting.left_reason``); None for any other module."""
    return None if is_norm_layer(module) else reporting.left_reason(module)


def _sync_judgement(original: nn.Module, converted: nn.Module) -> Judgement:
    left = left_reason(original)
    if left is not None:
        return Judgement(left)
    if converted is original:
        return Judgement("synchronised already: left as it is" if converted.sync else
                         "left as it is: sync=False makes it per replica")
    if isinstance(converted, SyncBatchNormAct):
        between = converted.drop_between()
        if between is not None:
            return Judgement(f"synchronised; {between}: both run after it")
        return Judgement(f"synchronised; its {type(converted.act).__name__} module has no "
                         "fused form and runs after it")
    if converted.inplace:
        return Judgement("synchronised, in place as it was")
    if converted.activation not in ("none", "identity"):
        return Judgement(f"synchronised, its {converted.activation} fused out of place")
    return Judgement("synchronised")


def _revert_judgement(original: nn.Module, reverted: nn.Module) -> Judgement:
    left = left_reason(original)
    if left is not None:
        return Judgement(left)
    if reverted is original:
        return Judgement("not synchronised: left as it is")
    return Judgement("per replica again")


def _replace_all(
    root: nn.Module, replace: Callable[[nn.Module, str], nn.Module | None]
) -> nn.Module:
    """Apply ``replace(module, path)`` (None: keep it) to ``root`` and every module under it,
    following every reference (``named_children`` lists a shared child once), so that a
    module referenced twice is replaced in both places by one new module."""
    done: dict[int, tuple[nn.Module, nn.Module]] = {}  # the original kept alive: ids stay unique

    def visit(module: nn.Module, path: str) -> nn.Module:
        seen = done.get(id(module))
        if seen is not None:
            return seen[1]
        new = replace(module, path)
        new = module if new is None else new
        done[id(module)] = (module, new)
        done[id(new)] = (new, new)
        for name, child in list(new._modules.items()):
            if child is not None:
                new_child = visit(child, f"{path}.{name}" if path else name)
                if new_child is not child:
                    new.add_module(name, new_child)
        return new

    return visit(root, "")


def _where(path: str) -> str:
    return repr(path) if path else "the root of the model"


def is_norm_layer(module: nn.Module) -> bool:
    """Whether the registry knows ``module``'s class or one of its bases (``_BatchNorm``,
    and so every synchronised layer, included): a norm layer, whose ``forward`` may update
    its state (count the batch, fold it into running statistics)."""
    return any(_key(cls) in _CONVERSIONS for cls in type(module).__mro__)


def _conversion_for(module: nn.Module, path: str) -> _Conversion | None:
    """The conversion of ``module``'s class, else of the nearest registered base class that
    ``forward`` is inherited from; None for a module that is not a norm layer to convert."""
    overriding = None
    for cls in type(module).__mro__:
        conversion = _CONVERSIONS.get(_key(cls))
        if conversion is not None:
            if overriding is not None:
                raise TypeError(
                    f"convert_sync_batchnorm: {_key(overriding)} at {_where(path)} subclasses "
                    f"{conversion.source} but overrides forward, so converting it like "
                    f"{cls.__name__} could change what the model computes; describe its "
                    f"synchronised form with encoding_syncbn.register_conversion("
                    f"{type(module).__name__}, to_sync, to_original)"
                )
            return conversion
        if cls is SyncBatchNorm:
            return None  # already synchronised
        if overriding is None and "forward" in vars(cls):
            overriding = cls
    return None


def _check_plain_forward(layer: SyncBatchNorm, path: str) -> None:
    """A layer reverted without a ``to_original`` must compute a plain (Sync)BatchNorm."""
    for cls in type(layer).__mro__:
        if cls in (SyncBatchNorm, SyncBatchNormAct):
            return
        if "forward" in vars(cls):
            raise TypeError(
                f"revert_sync_batchnorm: {_key(cls)} at {_where(path)} overrides forward and "
                "was not converted from a class registered with a to_original, so its plain "
                "form is unknown; build it from a registered class, or register one with "
                "encoding_syncbn.register_conversion"
            )


def share_state(source: _BatchNorm, target: _BatchNorm,
                consumed: tuple[str, ...] = ()) -> _BatchNorm:
    """Make ``target`` use ``source``'s Parameter objects (a bias of None too: so are bias-less
    layers made on a torch whose BatchNorms take no ``bias`` argument), buffers (the user's
    own too, persistent or not), child modules it lacks (but those the conversion
    ``consumed``: an activation now fused), hooks and training flag."""
    for name in ("weight", "bias"):
        if parametrize.is_parametrized(source, name):
            _share_parametrization(source, target, name)
        elif name in source._parameters:
            setattr(target, name, source._parameters[name])
        else:  # a plain attribute a forward pre-hook recomputes (torch.nn.utils.prune)
            del target._parameters[name]
            setattr(target, name, getattr(source, name))
    for name, parameter in source._parameters.items():
        if name not in ("weight", "bias"):  # weight_orig of a pruned weight, ...
            target._parameters[name] = parameter
    # BatchNorm's buffers, None where the source lacks one (an old num_batches_tracked), then
    # every buffer the source has.
    for name in ("running_mean", "running_var", "num_batches_tracked"):
        target._buffers[name] = source._buffers.get(name)
    for name, buffer in source._buffers.items():
        target._buffers[name] = buffer
    target._non_persistent_buffers_set = set(source._non_persistent_buffers_set)
    for name, child in source._modules.items():  # a subclass's own (its forward is BN's)
        if name not in target._modules and name not in consumed:
            target._modules[name] = child
    compat.share_hooks(source, target)
    target.train(source.training)
    return target


def _share_parametrization(source: nn.Module, target: nn.Module, name: str) -> None:
    """Parametrize ``target.<name>`` (``torch.nn.utils.parametrize``) by ``source``'s very
    ParametrizationList: the same parametrization modules and original Parameter objects (an
    optimizer made before the conversion keeps training them). The Identity registered first
    only makes ``target``'s class a parametrized one; it is replaced at once."""
    parametrize.register_parametrization(target, name, nn.Identity(), unsafe=True)
    target.parametrizations[name] = source.parametrizations[name]


def _norm_args(module: _BatchNorm) -> tuple:
    return (module.num_features, module.eps, module.momentum, module.affine,
            module.track_running_stats)


def _input_dim_of(module: _BatchNorm) -> int | None:
    """The input rank ``module``'s class stands for (None: any, or unknown)."""
    return next((_INPUT_DIM_BY_BATCHNORM[cls] for cls in type(module).__mro__
                 if cls in _INPUT_DIM_BY_BATCHNORM), None)


def _batchnorm_to_sync(module: _BatchNorm, process_group: Any) -> SyncBatchNorm:
    """torch's BatchNorms (and their subclasses that keep ``forward``)."""
    converted = SyncBatchNorm(*_norm_args(module), process_group, device="meta")
    converted._last_input_dim[0] = _input_dim_of(module)
    return share_state(module, converted)


def _norm_act_to_sync(module: _BatchNorm, process_group: Any) -> SyncBatchNorm:
    """A BatchNorm followed by its ``drop`` and ``act`` modules (timm's layout, absent ones
    standing for identity): the activation fused, out of place as the original, when there
    is no drop and the layer has that activation; else the modules kept (``SyncBatchNormAct``)."""
    drop, act = module._modules.get("drop"), module._modules.get("act")
    fused = None
    if drop is None or type(drop) is nn.Identity:
        fused = activations.from_module(act) if act is not None else ("none", 0.0)
    if fused is not None:
        activation, slope = fused
        converted = SyncBatchNorm(
            *_norm_args(module), process_group, device="meta",
            activation=activation, slope=slope, inplace=False,
        )
    else:
        converted = SyncBatchNormAct(
            *_norm_args(module), process_group, device="meta", drop=drop, act=act
        )
    converted._last_input_dim[0] = _input_dim_of(module)
    return share_state(module, converted, consumed=("drop", "act"))


def _drop_and_act(layer: SyncBatchNorm) -> tuple[nn.Module, nn.Module]:
    """The ``drop`` and ``act`` modules computing what ``layer`` does after normalising."""
    if isinstance(layer, SyncBatchNormAct):
        return layer.drop, layer.act
    act = activations.to_module(layer.activation, layer.slope)
    return nn.Identity(), nn.Identity() if act is None else act


def _to_plain(layer: SyncBatchNorm) -> _BatchNorm:
    """A ``SyncBatchNorm`` (or ``SyncBatchNormAct``) as a per-replica layer."""
    drop, act = _drop_and_act(layer)
    dim = layer.last_input_dim
    if type(drop) is nn.Identity and type(act) is nn.Identity and (dim is None or dim <= 5):
        cls = _BATCHNORM_BY_INPUT_DIM.get(dim, nn.BatchNorm2d)
        plain = cls(*_norm_args(layer), device="meta")
    else:
        plain = BatchNormAct(*_norm_args(layer), device="meta", drop=drop, act=act)
    return share_state(layer, plain, consumed=("drop", "act"))


def resolve_class(name: str) -> type:
    """The class called ``"module.QualName"``, importing its module."""
    parts = name.split(".")
    for split in range(len(parts) - 1, 0, -1):
        try:
            found: Any = importlib.import_module(".".join(parts[:split]))
        except ImportError:
            continue
        for attribute in parts[split:]:
            found = getattr(found, attribute)
        return found
    raise ImportError(f"cannot import the module of {name}")


def _norm_act_to_original(source: str) -> Callable[[nn.Module], nn.Module]:
    """``to_original`` for a class built as ``cls(num_features, eps, momentum, affine,
    track_running_stats, device=...)`` with ``drop`` and ``act`` modules (timm's layout)."""

    def to_original(layer: SyncBatchNorm) -> nn.Module:
        plain = resolve_class(source)(*_norm_args(layer), device="meta")
        plain.drop, plain.act = _drop_and_act(layer)
        return share_state(layer, plain)

    return to_original


for _source in (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm,
                nn.LazyBatchNorm1d, nn.LazyBatchNorm2d, nn.LazyBatchNorm3d, _BatchNorm):
    register_conversion(_source, _batchnorm_to_sync)
register_conversion(
    BatchNormAct, _norm_act_to_sync, _norm_act_to_original(_key(BatchNormAct))
)
# timm: its synchronised variant reverts to the per-replica one, as nn.SyncBatchNorm does.
register_conversion(
    "timm.layers.norm_act.BatchNormAct2d", _norm_act_to_sync,
    _norm_act_to_original("timm.layers.norm_act.BatchNormAct2d"),
)
register_conversion(
    "timm.layers.norm_act.SyncBatchNormAct", _norm_act_to_sync,
    _norm_act_to_original("timm.layers.norm_act.BatchNormAct2d"),
)
