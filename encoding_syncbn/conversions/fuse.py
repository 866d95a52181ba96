"""``convert_inplace_abn``: the In-Place ABN memory saving on an existing model, in one call.

Which BatchNorms may run in place is a property of the model's dataflow, not of the layer:
the layer overwrites its input and keeps only its output for backward, so

- its input must be a fresh tensor that nothing else reads (``abn(x) + x`` would read the
  output twice) and that aliases nothing (a view of another tensor would be overwritten too);
- its output must never be modified in place while backward needs it (``out += identity``).

``torch.fx`` gives that dataflow: the model is traced (norm layers and torch's own modules
kept whole), and each BatchNorm call is judged on its graph. A module the tracer cannot follow
(data-dependent control flow) is not traced itself; its children are, each on its own, which
only loses pairs (a child's inputs come from outside, so they are never overwritten), and a
warning says which modules were not traced.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import dataclasses
import logging
import operator
import os
import re
import types
import warnings
from collections import Counter
from collections.abc import Iterator, Sequence
from typing import Any, Literal, NamedTuple, overload

import torch
import torch.nn.functional as F
from torch import fx, nn
from torch.nn.modules.lazy import LazyModuleMixin

from .. import activations, compat
from ..layer.modules import SyncBatchNorm
from ..layer.norm_act import SyncBatchNormAct
from . import convert
from .reporting import (
    ConversionReport,
    Judgement,
    Step,
    activation_step,
    activation_text,
)

_log = logging.getLogger(__name__)
# The functional forms of the activations the layer inverts: what may run in place after a
# BatchNorm (identity runs through nn.Identity modules, never reaching this table).
_FUNCTIONAL_ACTIVATIONS = {
    function: (definition.name, keyword, default)
    for definition in activations.ACTIVATIONS.values() if definition.inverse
    for function, keyword, default in definition.functional
}

# Producers whose output is a fresh tensor (never an alias of their input).
_FRESH_MODULES = (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d,
                  nn.ConvTranspose3d, nn.Linear, nn.Bilinear)
_FRESH_FUNCTIONS = {
    F.conv1d, F.conv2d, F.conv3d, F.conv_transpose1d, F.conv_transpose2d, F.conv_transpose3d,
    F.linear, torch.conv1d, torch.conv2d, torch.conv3d, torch.cat, torch.stack, torch.add,
    torch.sub, torch.mul, torch.matmul, operator.add, operator.sub, operator.mul,
    operator.truediv, operator.matmul, operator.neg,
}
# Readers of a tensor whose result is a fresh tensor: past them, no write reaches the layer's
# output. Anything not listed (and not a torch.nn leaf module) is assumed to return an alias.
_READER_FUNCTIONS = _FRESH_FUNCTIONS | {
    F.relu, F.leaky_relu, F.elu, F.gelu, F.silu, F.hardswish, F.sigmoid, F.tanh,
    F.interpolate, F.avg_pool2d, F.max_pool2d, F.adaptive_avg_pool2d, F.adaptive_max_pool2d,
    F.softmax, torch.sigmoid, torch.tanh, torch.relu, torch.mean, torch.sum,
}
_READER_METHODS = {
    "add", "sub", "mul", "div", "matmul", "sum", "mean", "amax", "amin", "std", "var",
    "norm", "sigmoid", "tanh", "relu", "softmax", "exp", "log", "abs", "clamp", "pow",
}
# torch.nn leaf modules that return their input itself, or a view of it.
_ALIAS_MODULES = (nn.Identity, nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d,
                  nn.AlphaDropout, nn.FeatureAlphaDropout, nn.Flatten, nn.Unflatten)
# The decision for an activation module a fused layer absorbs: it becomes nn.Identity.
_ABSORBED = "absorbed"
# In place as operators: how fx sees `out += x`, `out[i] = v` (see _Tracer).
_INPLACE_OPERATORS = {
    "__iadd__": operator.iadd, "__isub__": operator.isub, "__imul__": operator.imul,
    "__itruediv__": operator.itruediv, "__ifloordiv__": operator.ifloordiv,
    "__imod__": operator.imod, "__ipow__": operator.ipow, "__imatmul__": operator.imatmul,
    "__iand__": operator.iand, "__ior__": operator.ior, "__ixor__": operator.ixor,
    "__ilshift__": operator.ilshift, "__irshift__": operator.irshift,
}


@overload
def convert_inplace_abn(module: nn.Module, process_group: Any = None, *,
                        report: Literal[False] = False,
                        input_shape: Sequence[int] | None = None) -> nn.Module: ...


@overload
def convert_inplace_abn(module: nn.Module, process_group: Any = None, *,
                        report: Literal[True],
                        input_shape: Sequence[int] | None = None
                        ) -> tuple[nn.Module, ConversionReport]: ...


def convert_inplace_abn(module: nn.Module, process_group: Any = None, *,
                        report: bool = False, input_shape: Sequence[int] | None = None
                        ) -> nn.Module | tuple[nn.Module, ConversionReport]:
    """Return ``module`` synchronised as ``convert_sync_batchnorm`` does, with every BatchNorm
    that may safely run in place turned into an In-Place Activated BatchNorm.

    A BatchNorm (``nn.BatchNorm*d``, ``nn.SyncBatchNorm``, timm's ``BatchNormAct2d``,
    mapillary's ``ABN`` ...) whose output feeds only a ``LeakyReLU`` or ``ELU`` (slope > 0),
    or has that activation itself, becomes
    ``SyncBatchNorm(activation=..., inplace=True)``:

    - **fused**, when the activation is a module applied only right after such BatchNorms
      (it becomes ``nn.Identity``), or the norm layer's own (timm's ``act``): only the
      activation's output is kept for backward, one tensor instead of three;
    - **in place without activation** (``activation="identity"``), when the activation is a
      ``torch.nn.functional`` call or a module also applied elsewhere, out of place: the
      BatchNorm's input is no longer kept (two tensors instead of three).

    Only where the traced graph shows it is safe: the BatchNorm's input comes from a
    convolution, linear layer or arithmetic op and is read by nothing else, and the output
    (after any view) is never modified in place (``out += identity``, ``add_``, an in-place
    module) nor returned by the traced module; a BatchNorm with hooks registered on it stays out
    of place, and an activation module with hooks is not fused away. Every other BatchNorm is
    synchronised out of place. Parameters, buffers and hooks are shared with the original, whose
    ``state_dict`` loads into the result with the same keys; the result computes what the
    original computed.

    Every norm layer the registry knows is traced as one call: its ``forward`` never runs
    on the tracer's proxies, so the conversion changes no state (mapillary's layers count
    the batch before their extension fails on a proxy). Modules ``torch.fx`` cannot trace
    are looked into child by child, with a warning naming them (a child called from their
    untraced code in another way is not seen).

    ``report=True``: returns ``(module, report)``, a ``ConversionReport`` with a row per norm
    layer saying why it is in place or not, naming the operation (``out += identity``, a
    second reader of its input or output, an activation it cannot invert, a hook) and its
    source line; ``input_shape``: it also estimates the activations a training step keeps
    for backward on an input of that shape, before and after (see ``saved_memory``). The
    summary is logged at INFO on the ``encoding_syncbn`` logger.
    """
    return convert.run_reported(
        "convert_inplace_abn", module, report, input_shape,
        lambda root, reporting: _convert(root, process_group, reporting, stacklevel=5))


def _convert(module: nn.Module, process_group: Any, reporting: bool, stacklevel: int
             ) -> tuple[nn.Module, convert.Judge]:
    """``convert_inplace_abn`` without its report: the converted model, and what to say of
    each norm layer (from the layer before and after); ``reporting``: with the source line
    of each operation a reason names (recording them costs the trace most of its time)."""
    # Traced in both modes: tracing fixes `if self.training:` branches to the current one.
    flags = [(m, m.training) for m in module.modules()]
    plans = []
    for training in (True, False):
        module.train(training)
        plans.append(_Planner(sources=reporting))
        plans[-1].visit(module, "")
    for child, training in flags:
        child.training = training
    plan = plans[0]
    if plan.untraced:
        warnings.warn(
            "convert_inplace_abn: torch.fx could not trace "
            + "; ".join(f"{_where(path)} ({reason})" for path, reason in plan.untraced)
            + ". Their children were traced one by one, so only BatchNorm + activation pairs "
            "inside one child can run in place; the BatchNorms their own forward calls "
            "directly stay out of place. Their own forward is not seen: where it calls a "
            "child's layers one by one, or keeps a tensor from inside a child, that child's "
            "in-place layers change what it computes (convert_sync_batchnorm keeps every "
            "layer out of place)",
            stacklevel=stacklevel,
        )
    (train_decisions, train_why), (eval_decisions, eval_why) = (p.decide() for p in plans)
    decisions = {key: value for key, value in train_decisions.items()
                 if eval_decisions.get(key) == value}
    outcomes: dict[int, tuple[str, str | None]] = {}
    for norm_id in train_why.keys() | eval_why.keys():
        if norm_id in decisions:
            outcomes[norm_id] = train_why[norm_id]
        elif norm_id not in train_decisions and norm_id in train_why:
            reason, source = train_why[norm_id]
            outcomes[norm_id] = (reason + (" (in train mode)" if norm_id in eval_decisions
                                           else ""), source)
        elif norm_id not in eval_decisions and norm_id in eval_why:
            reason, source = eval_why[norm_id]
            outcomes[norm_id] = (f"{reason} (in eval mode)", source)
        else:
            (train_reason, train_source), (eval_reason, eval_source) = (
                train_why[norm_id], eval_why[norm_id])
            outcomes[norm_id] = (f"the modes disagree: {train_reason} in train mode, "
                                 f"{eval_reason} in eval mode", eval_source or train_source)
    for norm_id, (reason, _) in outcomes.items():
        if norm_id not in decisions:
            _log.debug("convert_inplace_abn: %s stays out of place: %s",
                       plan.paths.get(norm_id) or plans[1].paths[norm_id], reason)

    def to_inplace(child: nn.Module, path: str) -> nn.Module | None:
        decision = decisions.get(id(child))
        if decision is None:
            return None
        if decision == _ABSORBED:
            return nn.Identity()
        return _inplace_layer(child, path, process_group, *decision)

    def judge(original: nn.Module, converted: nn.Module) -> Judgement:
        calls = plan.calls.get(id(original))
        if id(original) in outcomes:
            reason, source = outcomes[id(original)]
            follower = calls[0].follower if calls else None
            fused = decisions.get(id(original), (None,))[0] not in (None, "identity")
            return Judgement(reason, source, follower, absorbed=fused and calls[0].act
                             is not None)
        if id(original) in plan.unjudged:
            return Judgement(plan.unjudged[id(original)])
        return Judgement(_unseen(original, plan))

    module = convert._replace_all(module, to_inplace)
    return convert.synchronise(module, process_group), judge


def _unseen(norm: nn.Module, plan: _Planner) -> str:
    """Why the trace saw no call of the norm layer ``norm``."""
    left = convert.left_reason(norm)
    if left is not None:
        return left
    if plan.untraced:
        return ("no traced graph calls it: out of place (torch.fx could not trace "
                + ", ".join(_where(path) for path, _ in plan.untraced) + ")")
    return "no traced graph calls it: out of place"


# ---- what a BatchNorm call is followed by ------------------------------------------------------


class _Call(NamedTuple):
    """One call of a BatchNorm module in a traced graph, judged."""

    activation: str | None  # None: stays out of place; "identity": in place, no activation
    slope: float
    act: nn.Module | None  # the activation module absorbed (fused), if any
    reason: str  # why, in a user's words (what it is fused with, or what keeps it out)
    source: str | None  # "file.py:line: code" of the operation the reason names
    follower: Step | None = None  # the separate activation it feeds, as it runs before
    act_label: str = ""  # how reasons name that activation


def _refused(reason: str, node: fx.Node | None, follower: Step | None = None) -> _Call:
    return _Call(None, 0.0, None, reason, _source(node), follower)


class _Planner:
    """Traces a module tree and collects every BatchNorm call and activation call in it."""

    def __init__(self, sources: bool) -> None:
        self.sources = sources  # whether the trace records each operation's source line
        self.untraced: list[tuple[str, str]] = []
        self.calls: dict[int, list[_Call]] = {}  # BatchNorm id -> its calls
        self.paths: dict[int, str] = {}  # BatchNorm id -> its path, for the debug log
        self.module_calls: Counter[int] = Counter()  # module id -> its calls, all graphs
        self.unjudged: dict[int, str] = {}  # norm layer id -> why it is not judged

    def visit(self, module: nn.Module, path: str) -> None:
        if isinstance(module, nn.DataParallel):  # a leaf of torch.nn: the model inside it
            self.visit(module.module, f"{path}.module" if path else "module")
            return
        if _is_leaf(module):
            return
        try:
            with _attributes_kept(module) as stored:
                graph = _Tracer(self.sources).trace(module)
        except Exception as error:  # any failure of the tracer: the module's own code
            self.untraced.append((path, f"{type(error).__name__}: {str(error)[:120]}"))
            for name, child in module.named_children():
                self.visit(child, f"{path}.{name}" if path else name)
            return
        kept = dict.fromkeys(stored, "kept in a module attribute") | _seen_by_hooks(graph,
                                                                               module)
        for node in graph.nodes:
            if node.op != "call_module":
                continue
            target = module.get_submodule(node.target)
            self.module_calls[id(target)] += 1
            if not convert.is_norm_layer(target):
                continue
            kind = _norm_kind(target)
            if isinstance(kind, str):
                self.unjudged[id(target)] = kind
                continue
            self.calls.setdefault(id(target), []).append(_judge(node, kind, module, kept))
            self.paths.setdefault(id(target), f"{path}.{node.target}" if path
                                  else node.target)

    def decide(self) -> tuple[dict[int, Any], dict[int, tuple[str, str | None]]]:
        """id -> ``(activation, slope)`` for each BatchNorm to make in place, ``_ABSORBED``
        for each activation module they absorb; and for each BatchNorm judged, why
        (``(reason, source)``).

        A BatchNorm called several times is in place only if every call agrees; an activation
        module is absorbed only if every one of its calls follows a BatchNorm absorbing it
        (else it stays, and those BatchNorms run in place without activation before it,
        when it is out of place)."""
        chosen, outcomes = {}, {}
        for norm_id, calls in self.calls.items():
            first = calls[0]
            refused = next((call for call in calls if call.activation is None), None)
            if refused is not None:
                outcomes[norm_id] = (refused.reason + _of_calls(calls), refused.source)
            elif all(c[:3] == first[:3] for c in calls):
                chosen[norm_id] = first
            else:
                outcomes[norm_id] = (f"its {len(calls)} calls would fuse it differently: "
                                     + "; ".join(sorted({c.reason for c in calls})), None)
        absorbing = Counter(
            id(call.act) for norm_id in chosen for call in self.calls[norm_id]
            if call.act is not None
        )
        decisions: dict[int, Any] = {}
        for norm_id, call in chosen.items():
            act = call.act
            if act is None or absorbing[id(act)] == self.module_calls[id(act)]:
                decisions[norm_id] = (call.activation, call.slope)
                outcomes[norm_id] = (call.reason, call.source)
                if act is not None:
                    decisions[id(act)] = _ABSORBED
            elif not getattr(act, "inplace", False):
                decisions[norm_id] = ("identity", 0.0)
                outcomes[norm_id] = (f"in place without activation: {call.act_label} stays "
                                     "(the module also runs elsewhere)", None)
            else:
                outcomes[norm_id] = (f"its activation {call.act_label} also runs elsewhere, "
                                     "in place: it can be neither fused nor left to read the "
                                     "output", None)
        return decisions, outcomes


def _of_calls(calls: list[_Call]) -> str:
    return f" (in one of its {len(calls)} calls)" if len(calls) > 1 else ""


def _synced_form(module: nn.Module) -> nn.Module | None:
    """What ``convert_sync_batchnorm`` makes of the norm layer ``module`` (a synchronised
    layer it keeps: itself); None for any other module, and for one it refuses (it says
    why)."""
    if type(module) is not SyncBatchNorm and convert.is_norm_layer(module):
        if isinstance(module, LazyModuleMixin) and module.has_uninitialized_params():
            return None
        try:
            conversion = convert._conversion_for(module, "")
        except TypeError:  # convert_sync_batchnorm raises it, with the module's path
            return None
        if conversion is not None:
            return conversion.to_sync(module, None)
    return module if isinstance(module, SyncBatchNorm) else None


def _norm_kind(module: nn.Module) -> tuple[str, float] | str:
    """``(activation, slope)`` of the out-of-place layer ``module`` converts to, when that is
    a plain ``SyncBatchNorm`` whose activation is none or may run in place; else why it is
    not judged."""
    synced = _synced_form(module)
    if synced is None:
        return "it is not converted (convert_sync_batchnorm says why)"
    if isinstance(synced, SyncBatchNormAct):
        between = synced.drop_between()
        if between is not None:
            return f"{between}, so both stay after the layer"
        return (f"its activation module {type(synced.act).__name__} has no fused form, so "
                "it stays after the layer")
    if synced.inplace:
        return "in place already" + ("" if type(synced) is SyncBatchNorm
                                     else f", as {type(synced).__name__}")
    if synced.activation not in ("none", "identity") and not activations.runs_in_place(
            synced.activation, synced.slope):
        return (f"its own activation {activation_text(synced)} is not invertible (only "
                "leaky_relu and elu of slope > 0 are)")
    if type(synced) is not SyncBatchNorm:
        return (f"its synchronised form {type(synced).__name__} stays as it is (only a "
                "SyncBatchNorm is made in place)")
    # Of the invertible ones, identity is left out of place: its conversion chose that.
    if synced.activation == "none" or (synced.activation != "identity" and activations
                                       .runs_in_place(synced.activation, synced.slope)):
        return synced.activation, synced.slope
    return "its own activation is an identity, converted out of place as it was"


def _judge(node: fx.Node, kind: tuple[str, float], root: nn.Module,
           kept: dict[fx.Node, str]) -> _Call:
    """Whether this call of a norm layer (``kind``: its activation and slope) may run in
    place, and with which activation; ``kept``: the values that outlive the graph's use of
    them, and how (stored in a module attribute, ``_attributes_kept``; handed to a hook,
    ``_seen_by_hooks``)."""
    producer = node.args[0] if node.args else None
    if not isinstance(producer, fx.Node) or len(node.args) != 1 or node.kwargs:
        return _refused("it is called with other arguments than one tensor", node)
    if compat.has_call_hooks(root.get_submodule(node.target)):
        # A pre-hook may keep the input, which would then be overwritten; a forward hook
        # would see the activation's output once fused.
        return _refused("a hook is registered on it (a hook may keep its input, which "
                        "would be overwritten)", node)
    if not _is_fresh(producer, root):
        return _refused(f"its input may be shared: it comes from {_describe(producer, root)}"
                        ", not from a convolution, linear layer or arithmetic", producer)
    if producer in kept:
        return _refused(f"its input, from {_describe(producer, root)}, is {kept[producer]}, "
                        "where it would be overwritten", producer)
    if len(producer.users) != 1:
        other = next(user for user in producer.users if user is not node)
        return _refused(f"its input is read again, by {_describe(other, root)}: it would "
                        "read the output", other)
    if kind[0] != "none":  # the norm layer's own activation (timm's BatchNormAct2d)
        writer = _writer_after(node, root)
        if writer is not None:
            return _refused(_written_reason(writer, root), writer)
        return _Call(*kind, None, f"fused with its own {kind[0]}", None)
    # Through nn.Identity modules (timm's disabled drop_block), to the activation.
    value = node
    while True:
        if value in kept:
            return _refused(f"its output, from {_describe(value, root)}, is {kept[value]}, "
                            "where the activation would overwrite it", value)
        if not value.users:
            return _refused("its output is not read", value)
        if len(value.users) != 1:
            first, second = list(value.users)[:2]
            return _refused(f"its output is read twice, by {_describe(first, root)} and "
                            f"{_describe(second, root)}", second)
        act_node = next(iter(value.users))
        if act_node.op == "output":
            return _refused(_written_reason(act_node, root), act_node)
        if act_node.args[:1] != (value,) or _count_uses(act_node, value) != 1:
            return _refused(_no_activation(act_node, root), act_node)
        if act_node.op != "call_module" or type(root.get_submodule(act_node.target)) \
                is not nn.Identity:
            break
        value = act_node
    found = _activation_of(act_node, root)
    if found is None:
        if act_node.op == "call_module" and activations.from_module(
                root.get_submodule(act_node.target)) is not None:
            return _refused(f"its activation {_describe(act_node, root)} is not invertible "
                            "(only LeakyReLU and ELU of slope > 0 are)", act_node)
        if _writes(act_node, value, root):
            return _refused(_written_reason(act_node, root), act_node)
        return _refused(_no_activation(act_node, root), act_node)
    activation, slope, act_module, inplace = found
    follower = activation_step(act_module, inplace)
    label = _describe(act_node, root)
    if slope <= 0:
        return _refused(f"its activation {label} is not invertible (slope {slope:g})",
                        act_node, follower)
    # Fused, the activation module becomes nn.Identity: not when hooks are registered on it.
    writer = _writer_after(act_node, root) if act_module is not None else None
    if act_module is None:
        why, where = "a function call, not a module to absorb", act_node
    elif writer is not None:
        why, where = _written_reason(writer, root), writer
    elif compat.has_call_hooks(act_module):
        why, where = "a hook is registered on it", act_node
    else:
        return _Call(activation, slope, act_module, f"fused with {label}", None, follower,
                     label)
    if not inplace:
        # The activation stays; it only reads the BatchNorm's output.
        return _Call("identity", 0.0, None,
                     f"in place without activation: {label} stays ({why})", _source(where),
                     follower, label)
    return _refused(f"its activation {label} writes over its output (inplace=True) and "
                    f"cannot be fused: {why}", where, follower)


def _no_activation(node: fx.Node, root: nn.Module) -> str:
    return (f"no LeakyReLU or ELU follows it to fuse: its output goes to "
            f"{_describe(node, root)}")


def _written_reason(writer: fx.Node, root: nn.Module) -> str:
    if writer.op == "output":
        return "its output is returned by the traced module, whose caller may modify it"
    return f"its output is modified in place by {_describe(writer, root)}"


def _activation_of(node: fx.Node, root: nn.Module):
    """``(activation, slope, module or None, inplace)`` of a LeakyReLU/ELU call, else None."""
    if node.op == "call_module":
        module = root.get_submodule(node.target)
        found = activations.from_module(module)
        if found is None or activations.ACTIVATIONS[found[0]].inverse is None:
            return None
        return (*found, module, bool(getattr(module, "inplace", False)))
    if node.op == "call_function" and node.target in _FUNCTIONAL_ACTIVATIONS:
        activation, name, default = _FUNCTIONAL_ACTIVATIONS[node.target]
        slope = node.args[1] if len(node.args) > 1 else node.kwargs.get(name, default)
        inplace = node.args[2] if len(node.args) > 2 else node.kwargs.get("inplace", False)
        if not isinstance(slope, (int, float)) or not isinstance(inplace, bool):
            return None
        return activation, float(slope), None, inplace
    return None


def _is_fresh(node: fx.Node, root: nn.Module) -> bool:
    """Whether ``node``'s result is a new tensor (aliases none of the graph's tensors)."""
    if node.op == "call_module":
        return isinstance(root.get_submodule(node.target), _FRESH_MODULES)
    if node.op == "call_function":
        return node.target in _FRESH_FUNCTIONS and "out" not in node.kwargs
    return False


def _writer_after(node: fx.Node, root: nn.Module) -> fx.Node | None:
    """The node that modifies ``node``'s result, or a possible alias of it, in place, or
    that returns it from the graph (its caller may modify it); None if none does."""
    pending, seen = [node], {node}
    while pending:
        current = pending.pop()
        for user in current.users:
            if user.op == "output" or _writes(user, current, root):
                return user
            if user not in seen and not _returns_fresh(user, root):
                seen.add(user)
                pending.append(user)
    return None


def _writes(user: fx.Node, value: fx.Node, root: nn.Module) -> bool:
    """Whether ``user`` modifies ``value`` in place."""
    if "out" in user.kwargs:
        return True
    first = user.args[0] if user.args else None
    if first is not value:
        return False
    if user.op == "call_method":
        return user.target.endswith("_") and not user.target.startswith("__")
    if user.op == "call_function":
        if user.target in _INPLACE_OPERATORS.values() or user.target is operator.setitem:
            return True
        if user.kwargs.get("inplace") is True:
            return True
        name = getattr(user.target, "__name__", "")
        return name.endswith("_") or any(arg is True for arg in user.args[1:])
    if user.op == "call_module":
        # A norm layer as the conversion makes it: mapillary's InPlaceABN, timm's InplaceAbn
        # have no `inplace` flag, and become in-place layers.
        module = root.get_submodule(user.target)
        synced = _synced_form(module)
        return bool(getattr(module if synced is None else synced, "inplace", False))
    return False


def _returns_fresh(user: fx.Node, root: nn.Module) -> bool:
    """Whether ``user``'s result certainly aliases none of its inputs."""
    if user.op == "call_module":
        module = root.get_submodule(user.target)
        return _is_leaf(module) and not isinstance(module, _ALIAS_MODULES)
    if user.op == "call_function":
        return user.target in _READER_FUNCTIONS
    if user.op == "call_method":
        return user.target in _READER_METHODS
    return False


def _count_uses(user: fx.Node, value: fx.Node) -> int:
    """How many times ``value`` appears in ``user``'s arguments."""
    count = 0

    def seen(node: fx.Node) -> fx.Node:
        nonlocal count
        count += node is value
        return node

    fx.node.map_arg((user.args, user.kwargs), seen)
    return count


# How reasons write the operators fx records.
_OPERATOR_TEXT = {
    operator.iadd: "`+=`", operator.isub: "`-=`", operator.imul: "`*=`",
    operator.itruediv: "`/=`", operator.setitem: "`[...] =`", operator.getitem: "`[...]`",
    operator.add: "`+`", operator.sub: "`-`", operator.mul: "`*`", operator.truediv: "`/`",
    operator.matmul: "`@`", operator.neg: "unary `-`",
}
# Module prefixes users write: torch.nn.functional.leaky_relu as F.leaky_relu.
_MODULE_TEXT = {"torch.nn.functional": "F", "torch._C._nn": "F",
                "torch._C._VariableFunctions": "torch", "torch.functional": "torch"}


def _describe(node: fx.Node, root: nn.Module) -> str:
    """``node``'s operation in the words of the model's code."""
    if node.op == "placeholder":
        return "the traced module's own input"
    if node.op == "output":
        return "the traced module's output"
    if node.op == "call_module":
        return f"{node.target} ({type(root.get_submodule(node.target)).__name__})"
    if node.op == "call_method":
        return f"`.{node.target}()`"
    if node.target in _OPERATOR_TEXT:
        return _OPERATOR_TEXT[node.target]
    name = getattr(node.target, "__name__", str(node.target))
    module = getattr(node.target, "__module__", None) or "torch"
    return f"{_MODULE_TEXT.get(module, module)}.{name}"


# Frames no user wrote: torch's own (fx, its modules, the __torch_function__ handling through
# which fx records F.leaky_relu) and this module's.
_OWN_FILES = (os.path.dirname(torch.__file__) + os.sep, __file__)
# A frame of a formatted stack: its code line (indented deeper) only where the file is known.
_FRAME = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+), in \S+(?:\n {4}(?P<code>\S.*))?')


def _source(node: fx.Node | None) -> str | None:
    """Where ``node``'s operation is written (``"file.py:line: code"``): the innermost frame
    of the trace's stack outside torch and this module, where the trace recorded one."""
    stack = getattr(node, "stack_trace", None)
    frames = [frame for frame in _FRAME.finditer(stack or "")
              if not frame["file"].startswith(_OWN_FILES)]
    if not frames:
        return None
    frame = frames[-1]
    where = f"{os.path.basename(frame['file'])}:{frame['line']}"
    return f"{where}: {frame['code'].strip()}" if frame["code"] else where


def _where(path: str) -> str:
    return repr(path) if path else "the model"


def _is_leaf(module: nn.Module) -> bool:
    """torch's own modules and every norm layer the registry knows are traced as single
    calls: a norm layer's ``forward`` never runs on the tracer's proxies, where it could
    update its state before failing (mapillary's counts the batch first)."""
    return convert.is_norm_layer(module) or (
        module.__module__.startswith(("torch.nn", "torch.ao.nn"))
        and not isinstance(module, nn.Sequential)
    )


@contextlib.contextmanager
def _attributes_kept(module: nn.Module) -> Iterator[set[fx.Node]]:
    """Around a trace of ``module``: the nodes whose values its code stores in an attribute
    of one of its modules (``self.feat = h``, ``self.feats.append(h)``, in containers or
    plain objects within them), added to the set yielded once the trace ends; kept past the
    call, such a value must not be overwritten. The trace leaves proxies there: every
    attribute, container and object reached is put back as it was."""
    saved: dict[int, tuple[Any, Any]] = {}
    for owner in module.modules():
        _snapshot(owner.__dict__, saved, _KEPT_DEPTH)
    stored: set[fx.Node] = set()
    try:
        yield stored
    finally:
        for owner in module.modules():
            stored.update(proxy.node for proxy in _proxies(owner.__dict__, _KEPT_DEPTH))
        for state, content in saved.values():
            _restore(state, content)


# How deep in containers and objects a stored value is looked for (``self.store["feats"]
# .append((h, i))`` is three levels down from the attribute).
_KEPT_DEPTH = 4


def _state_of(value: Any) -> Any:
    """The mutable part of ``value`` that a trace could write a proxy into: a container
    itself, a holder object's (``SimpleNamespace``, a dataclass) ``__dict__``; None for
    anything else (tensors, modules, which are walked as modules, functions, immutable
    values)."""
    if isinstance(value, (list, dict, set, collections.deque)):
        return value
    if isinstance(value, types.SimpleNamespace) or (
            dataclasses.is_dataclass(value) and not isinstance(value, type)
            and hasattr(value, "__dict__")):
        return vars(value)
    return None


def _items(value: Any) -> Iterator[Any]:
    if isinstance(value, dict):
        yield from value.values()
    elif isinstance(value, (list, tuple, set, frozenset, collections.deque)):
        yield from value
    elif (state := _state_of(value)) is not None:
        yield from state.values()


def _snapshot(value: Any, saved: dict[int, tuple[Any, Any]], depth: int) -> None:
    state = _state_of(value)
    if state is not None and id(state) not in saved:
        saved[id(state)] = (state, copy.copy(state))
    if depth:
        for item in _items(value):
            if not isinstance(item, nn.Module):
                _snapshot(item, saved, depth - 1)


def _restore(state: Any, content: Any) -> None:
    state.clear()
    if isinstance(state, (dict, set)):
        state.update(content)
    else:
        state.extend(content)


def _proxies(value: Any, depth: int) -> Iterator[fx.Proxy]:
    if isinstance(value, fx.Proxy):
        yield value
    elif depth and not isinstance(value, nn.Module):
        for item in _items(value):
            yield from _proxies(item, depth - 1)


def _seen_by_hooks(graph: fx.Graph, root: nn.Module) -> dict[fx.Node, str]:
    """The values a forward hook of a module the trace went through or called may keep:
    each hooked module's output, and a traced-through one's inputs (a leaf's hooks are the
    norm layer's and the activation's own, judged apart, or its producer's, whose output
    counts here)."""
    # By call (the stack's key; a module called twice has a key per call), with its path.
    inside: dict[str, tuple[str, set[fx.Node]]] = {}
    for node in graph.nodes:
        for call, (path, _) in (node.meta.get("nn_module_stack") or {}).items():
            inside.setdefault(call, (path, set()))[1].add(node)
    seen: dict[fx.Node, str] = {}
    for path, nodes in inside.values():
        hooked = root.get_submodule(path)
        forward, before = bool(hooked._forward_hooks), bool(hooked._forward_pre_hooks)
        if not (forward or before):
            continue
        how = f"handed to a forward hook of {path!r}"
        for node in nodes:
            if forward and any(user not in nodes for user in node.users):
                seen[node] = how
            if not _is_leaf(hooked):
                for arg in node.all_input_nodes:
                    if arg not in nodes:
                        seen[arg] = how
    return seen


class _InplaceAwareProxy(fx.Proxy):
    """fx records ``out += x`` as ``out + x`` (a Proxy has no ``__iadd__``, so Python falls
    back to ``__add__``), which would hide the write: these record it as ``operator.iadd``,
    and ``out[i] = v`` as ``operator.setitem``."""

    def __setitem__(self, index: Any, value: Any) -> None:
        self.tracer.create_proxy("call_function", operator.setitem, (self, index, value), {})


def _inplace_operator(function):
    def method(self, other):
        return self.tracer.create_proxy("call_function", function, (self, other), {})

    return method


for _name, _function in _INPLACE_OPERATORS.items():
    setattr(_InplaceAwareProxy, _name, _inplace_operator(_function))


class _Tracer(fx.Tracer):
    def __init__(self, sources: bool) -> None:
        super().__init__()
        self.record_stack_traces = sources  # for the reasons to name source lines

    def is_leaf_module(self, module: nn.Module, qualified_name: str) -> bool:
        return _is_leaf(module)

    def proxy(self, node: fx.Node) -> fx.Proxy:
        return _InplaceAwareProxy(node, self)


def _inplace_layer(norm: nn.Module, path: str, process_group: Any, activation: str,
                   slope: float) -> SyncBatchNorm:
    """``norm`` as an in-place ``SyncBatchNorm``, sharing its Parameters and buffers, and
    reverting as the out-of-place layer it converts to would."""
    if type(norm) is SyncBatchNorm:
        synced = norm
    else:
        conversion = convert._conversion_for(norm, path)
        synced = conversion.to_sync(norm, process_group)
        setattr(synced, convert.SOURCE_ATTRIBUTE, conversion.source)
    layer = SyncBatchNorm(
        *convert._norm_args(synced), synced.process_group, device="meta", sync=synced.sync,
        activation=activation, slope=slope, inplace=True,
    )
    layer._last_input_dim[0] = synced._last_input_dim[0]
    source = getattr(synced, convert.SOURCE_ATTRIBUTE, None)
    if source is not None:
        setattr(layer, convert.SOURCE_ATTRIBUTE, source)
    return convert.share_state(synced, layer)


__all__ = ["convert_inplace_abn"]
