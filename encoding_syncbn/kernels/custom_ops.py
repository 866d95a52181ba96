"""The layer's ops as ``torch.library`` custom ops: opaque to ``torch.compile`` and the other
tracers, which see only their fake (shape-only) implementations.

An op is written once, with the bundles of ``kernels.backend`` (``NormParams``, ``DxCoefs``,
...) as its arguments, like the backends' own ops. :class:`CustomOp` registers it under a
flat schema derived from the bundles' fields (``params: NormParams`` becomes ``params_mean,
params_invstd, ...``; an optional bundle's fields may be None), and packs and unpacks the
bundles at the dispatcher: a new field of a bundle is one line in ``backend.py``, here none.
``DxCoefs | BatchSums`` (``backward_dx``'s coefficients) travels as three tensors and the
count of ``BatchSums`` (``DX_COEFS_COUNT`` for ``DxCoefs``).

The one registry of both backends: each writes its ops once, as a table of :class:`Op`
(implementation and fake); :func:`register` registers a table, :func:`implementations` gives
it for eager calls, and :class:`OpsBackend` is the backend over either. Both backends share
:data:`FLOAT64_BATCH_BACKWARD`, float64's input gradient over few values a channel.
"""

from __future__ import annotations

import inspect
import types
import typing
from collections.abc import Callable, Mapping
from typing import NamedTuple

import torch

from . import double_double
from .backend import (
    BatchSums,
    DxCoefs,
    GammaCheck,
    NormParams,
    RunningParams,
    RunningStats,
    reduce_then_dx,
)
from .torch_ops import finalize_stats, stats_dtype

#: ``coefs_count`` of a ``DxCoefs`` in the flat schema (a ``BatchSums``' count is >= 0).
DX_COEFS_COUNT = -1

_NAMESPACE = "encoding_syncbn"
_COEFS = frozenset((DxCoefs, BatchSums))


def _union_members(hint) -> tuple | None:
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return typing.get_args(hint)
    return None


class _Argument(typing.NamedTuple):
    """One argument of an op as the flat schema spells it: ``fields`` names and types, and
    how the op's argument is rebuilt from them."""

    fields: list[inspect.Parameter]
    pack: Callable[[object], tuple]
    unpack: Callable[[tuple], object]


def _plain(name: str, hint) -> _Argument:
    convert = hint if hint in (float, bool, int) else None
    parameter = inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=hint)
    if convert is None:
        return _Argument([parameter], lambda value: (value,), lambda flat: flat[0])
    return _Argument([parameter], lambda value: (convert(value),), lambda flat: flat[0])


def _bundle(name: str, bundle: type, optional: bool) -> _Argument:
    hints = typing.get_type_hints(bundle)
    fields = []
    for field in bundle._fields:
        hint = hints[field]
        if optional and _union_members(hint) is None:
            hint = hint | None
        fields.append(inspect.Parameter(f"{name}_{field}", inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                        annotation=hint))
    absent = (None,) * len(fields)
    floats = [i for i, field in enumerate(bundle._fields) if hints[field] is float]

    def pack(value) -> tuple:
        if value is None:
            return absent
        if not floats:
            return tuple(value)
        flat = list(value)
        for i in floats:  # the schema's float takes no int from a Python caller's literal
            flat[i] = float(flat[i])
        return tuple(flat)

    def unpack(flat: tuple):
        return None if optional and flat[0] is None else bundle._make(flat)

    return _Argument(fields, pack, unpack)


def _coefs(name: str) -> _Argument:
    fields = [inspect.Parameter(f"{name}_{field}", inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                annotation=hint)
              for field, hint in (("dz", torch.Tensor), ("xhat", torch.Tensor),
                                  ("const", torch.Tensor), ("count", int))]

    def pack(value: DxCoefs | BatchSums) -> tuple:
        if isinstance(value, BatchSums):  # the dz slot unread
            return value.sum_dz, value.sum_dz_xhat, value.sum_dz, int(value.count)
        return (*value, DX_COEFS_COUNT)

    def unpack(flat: tuple) -> DxCoefs | BatchSums:
        dz, xhat, const, count = flat
        return DxCoefs(dz, xhat, const) if count == DX_COEFS_COUNT else BatchSums(const, xhat,
                                                                                  count)

    return _Argument(fields, pack, unpack)


def _argument(name: str, hint) -> _Argument:
    members = _union_members(hint)
    if members is not None and frozenset(members) == _COEFS:
        return _coefs(name)
    if members is not None and len(members) == 2 and type(None) in members:
        (inner,) = (m for m in members if m is not type(None))
        if isinstance(inner, type) and issubclass(inner, tuple) and hasattr(inner, "_fields"):
            return _bundle(name, inner, optional=True)
    if isinstance(hint, type) and issubclass(hint, tuple) and hasattr(hint, "_fields"):
        return _bundle(name, hint, optional=False)
    return _plain(name, hint)


class CustomOp:
    """``fn`` (bundles as arguments) registered as ``encoding_syncbn::<name>``; calling this
    calls the registered op with the same arguments as ``fn``.

    ``mutates_args``: the flat names of what ``fn`` writes (``out``; ``running_mean`` for the
    ``mean`` field of a bundle argument ``running``).
    """

    def __init__(self, name: str, fn: Callable, mutates_args: tuple[str, ...] = ()) -> None:
        hints = typing.get_type_hints(fn)
        names = list(inspect.signature(fn).parameters)
        self._arguments = [_argument(arg, hints[arg]) for arg in names]
        spans, start = [], 0
        for argument in self._arguments:
            spans.append(slice(start, start + len(argument.fields)))
            start += len(argument.fields)
        self._unpackers = [(span, argument.unpack)
                           for span, argument in zip(spans, self._arguments, strict=True)]

        def flat_fn(*flat):
            return fn(*self.unpack(flat))

        flat_fn.__name__ = fn.__name__
        flat_fn.__signature__ = inspect.Signature(
            [field for argument in self._arguments for field in argument.fields],
            # get_type_hints reads ``-> None`` as NoneType; the schema wants None.
            return_annotation=None if hints["return"] is type(None) else hints["return"])
        self._definition = torch.library.custom_op(f"{_NAMESPACE}::{name}", flat_fn,
                                                   mutates_args=mutates_args)
        self.op = getattr(getattr(torch.ops, _NAMESPACE), name)

    def unpack(self, flat: tuple) -> list:
        """The op's arguments from the flat schema's."""
        return [unpack(flat[span]) for span, unpack in self._unpackers]

    def __call__(self, *args):
        flat = []
        for argument, value in zip(self._arguments, args, strict=True):
            flat.extend(argument.pack(value))
        return self.op(*flat)

    def register_fake(self, fake: Callable) -> Callable:
        """``fake``: the op's shapes, taking the same arguments as the op."""
        self._definition.register_fake(lambda *flat: fake(*self.unpack(flat)))
        return fake


def channel_count(x: torch.Tensor) -> int:
    """Elements a channel of an ``(N, C, *)`` tensor."""
    channels = x.shape[1]
    return x.numel() // channels if channels else 0


def channel_vectors(x: torch.Tensor, *_) -> tuple[torch.Tensor, torch.Tensor]:
    """The fake of an op returning two per-channel vectors of ``x`` (its first argument) in
    the statistics dtype."""
    acc, channels = stats_dtype(x.dtype), x.shape[1]
    return x.new_empty(channels, dtype=acc), x.new_empty(channels, dtype=acc)


#: ``double_double.batch_backward`` as tracers see it: one op. Traced, its hundreds of
#: elementwise steps over every value would reach Inductor, which fuses them into a C++
#: kernel of thousands of lines, slow to build for microseconds of work; as one op, a
#: compiled backward calls the eager function and computes bitwise what eager computes.
FLOAT64_BATCH_BACKWARD = CustomOp("float64_batch_backward", double_double.batch_backward)
FLOAT64_BATCH_BACKWARD.register_fake(lambda x, *_: (torch.empty_like(x), *channel_vectors(x)))


class Op(NamedTuple):
    """One op of a backend's table: ``impl`` in the shape of a custom op (bundles as arguments;
    ``channel_stats`` returns ``(mean, M2)``, ``normalize_act`` writes ``out`` and returns
    nothing) and ``fake``, its outputs' shapes from the same arguments (None for an op that
    only writes ``out``: torch derives that one). ``mutates_args``: the flat names it writes."""

    impl: Callable
    fake: Callable | None = None
    mutates_args: tuple[str, ...] = ()


def register(table: Mapping[str, Op], prefix: str = "") -> dict[str, CustomOp]:
    """Every op of ``table`` registered as ``encoding_syncbn::<prefix><name>`` (a trailing
    underscore where it writes ``out``) with its fake: what tracers see of the table."""
    ops = {}
    for name, op in table.items():
        suffix = "_" if "out" in op.mutates_args else ""
        ops[name] = CustomOp(f"{prefix}{name}{suffix}", op.impl, op.mutates_args)
        if op.fake is not None:
            ops[name].register_fake(op.fake)
    return ops


def implementations(table: Mapping[str, Op]) -> dict[str, Callable]:
    """The ops of ``table`` as plain functions: the eager route, with no dispatcher."""
    return {name: op.impl for name, op in table.items()}


class OpsBackend:
    """A :class:`~encoding_syncbn.kernels.backend.Backend` over a table's ops, called directly
    (:func:`implementations`) or registered (:func:`register`): what a registered op cannot
    be (an ``int`` output, an output aliasing an input, a call with no autograd formula) is
    done around them here, for both alike.

    A table without ``batch_stats`` gets ``channel_stats``, then ``torch_ops.finalize_stats``
    (plain ATen on per-channel vectors: traceable as it is). ``batch_backward``: one call for
    ``backward_reduce`` then ``backward_dx`` (None: the two ops). ``records_history``: whether
    the ops record autograd history, which ``batch_stats`` then suspends. ``scratches_saved``:
    whether ``batch_backward`` uses its ``overwrite_saved`` (``Backend.scratches_saved``).
    """

    def __init__(self, name: str, ops: Mapping[str, Callable], *,
                 batch_backward: Callable | None = None, records_history: bool = True,
                 scratches_saved: bool = False) -> None:
        self.name = name
        self.scratches_saved = scratches_saved
        self._channel_stats = ops["channel_stats"]
        self._batch_stats = ops.get("batch_stats", self._finalized_channel_stats)
        self._normalize_act = ops["normalize_act"]
        self._normalize_running = ops["normalize_running"]
        self._backward_reduce = ops["backward_reduce"]
        self._backward_dx = ops["backward_dx"]
        self._batch_backward = batch_backward
        self._records_history = records_history

    def __repr__(self) -> str:
        return f"<backend {self.name!r}>"

    def _finalized_channel_stats(self, x: torch.Tensor, eps: float,
                                 running: RunningStats | None, check: GammaCheck | None
                                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        mean, m2 = self._channel_stats(x)
        invstd, small = finalize_stats(mean, m2, channel_count(x), eps, running, check)
        return mean, invstd, small

    def channel_stats(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
        mean, m2 = self._channel_stats(x)
        channels = x.shape[1]  # channel_count's, inline: every training call counts
        return mean, m2, (x.numel() // channels if channels else 0)

    def batch_stats(self, x: torch.Tensor, eps: float, running: RunningStats | None,
                    check: GammaCheck | None
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        if self._records_history:  # the statistics are taken without grad
            with torch.no_grad():
                mean, invstd, small = self._batch_stats(x, float(eps), running, check)
        else:
            mean, invstd, small = self._batch_stats(x, float(eps), running, check)
        return mean, invstd, (small if check is not None else None)

    def normalize_act(self, x: torch.Tensor, params: NormParams,
                      out: torch.Tensor) -> torch.Tensor:
        self._normalize_act(x, params, out)
        return out

    def normalize_running(self, x: torch.Tensor, running: RunningParams,
                          out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self._normalize_running(x, running, out)

    def backward_reduce(self, saved: torch.Tensor, dy: torch.Tensor, params: NormParams,
                        saved_is_output: bool) -> tuple[torch.Tensor, torch.Tensor]:
        return self._backward_reduce(saved, dy, params, saved_is_output)

    def backward_dx(self, saved: torch.Tensor, dy: torch.Tensor, params: NormParams,
                    saved_is_output: bool, coefs: DxCoefs | BatchSums) -> torch.Tensor:
        return self._backward_dx(saved, dy, params, saved_is_output, coefs)

    def batch_backward(self, saved: torch.Tensor, dy: torch.Tensor, params: NormParams,
                       saved_is_output: bool, count: int, overwrite_saved: bool = False
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if self._batch_backward is not None:
            return self._batch_backward(saved, dy, params, saved_is_output, count,
                                        overwrite_saved)
        return reduce_then_dx(self, saved, dy, params, saved_is_output, count)
