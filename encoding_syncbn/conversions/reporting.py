"""What a conversion did to each norm layer of a model, as data and as a table.

``convert_sync_batchnorm``, ``convert_inplace_abn`` and ``revert_sync_batchnorm`` build a
``ConversionReport`` when asked (``report=True``): one ``NormLayerReport`` per norm layer, with
its path, its class before and after, whether it is synchronised and in place, why (in words
naming the operation, and its source line where the trace knows it), the activation fused,
and how many tensors of its input's size it keeps for backward before and after.
``print(report)`` shows the table; ``report.rows`` are dataclasses for programs. Every
conversion also logs its ``summary()`` at INFO on the ``encoding_syncbn`` logger (silent
unless the application configures logging).

How many tensors a layer keeps for backward is counted over the chain it belongs to: the
norm layer, the activation module it holds (timm's ``act``), and the activation it feeds
(where the conversion judged one). Each step keeps its input, its output, a copy of its
input, or nothing, and writes over its input or makes a new tensor; the count is of distinct
tensors kept, the chain's last output included (the next layer, a convolution, keeps it for
its own backward).
A BatchNorm then LeakyReLU keeps 3 (BatchNorm's input, its output that LeakyReLU keeps, the
LeakyReLU's output); fused in place, 1; in place without activation before an out-of-place
LeakyReLU, 2.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from collections.abc import Sequence
from typing import Literal, NamedTuple

import torch
from torch import nn

from ..layer import inplace_policy
from ..layer.inplace_policy import gamma_limit, running_spread, small_gamma_mask
from ..layer.modules import SyncBatchNorm

_log = logging.getLogger(__name__)


class Step(NamedTuple):
    """One step of a chain: what it keeps for backward (its input, its output, a copy of
    its input that autograd makes before the step overwrites it, or nothing), and whether it
    writes its output over its input."""

    keeps: Literal["input", "output", "copy", "nothing"]
    in_place: bool


def kept_tensors(chain: Sequence[Step]) -> int:
    """The distinct tensors ``chain`` keeps for backward, its last output included."""
    tensor, kept = 0, set()
    for step in chain:
        if step.keeps == "input":
            kept.add(tensor)
        elif step.keeps == "copy":
            kept.add(("copy", tensor))
        tensor += not step.in_place
        if step.keeps == "output":
            kept.add(tensor)
    return len(kept | {tensor})


# Activations whose backward reads their output: they keep it, in place or not.
_KEEP_OUTPUT = frozenset({nn.ReLU, nn.ReLU6, nn.Hardtanh, nn.Sigmoid, nn.Tanh})
# ... and those that read their input, except in place, where they read their output.
_KEEP_OUTPUT_IN_PLACE = frozenset({nn.LeakyReLU, nn.ELU})


def activation_step(module: nn.Module | None, in_place: bool = False) -> Step | None:
    """The step of an activation module, or where ``module`` is None of a LeakyReLU or ELU
    function call run ``in_place`` or not; None for ``nn.Identity``, which keeps nothing and
    makes no tensor. Other activations keep their input, and in place (SiLU, Hardswish) a
    copy of it."""
    if module is None:
        return Step("output", True) if in_place else Step("input", False)
    if type(module) is nn.Identity:
        return None
    in_place = bool(getattr(module, "inplace", False))
    if type(module) in _KEEP_OUTPUT or (in_place and type(module) in _KEEP_OUTPUT_IN_PLACE):
        return Step("output", in_place)
    return Step("copy", True) if in_place else Step("input", False)


def norm_chain(layer: nn.Module, trains_in_place: bool = True) -> list[Step]:
    """The steps of a norm layer with the activation modules it holds (``act``, timm's and
    ``SyncBatchNormAct``'s; a fused activation is part of the layer's own step);
    ``trains_in_place`` False: an in-place ``SyncBatchNorm`` that trains out of place on the
    input (too few values a channel, see ``few_values``)."""
    name = type(layer).__name__.lower()
    if isinstance(layer, SyncBatchNorm):
        in_place = layer.inplace and trains_in_place
        step = Step("output", True) if in_place else Step("input", False)
    elif "inplace" in name:  # mapillary's and timm's InPlaceABN
        step = Step("output", True)
    elif "frozen" in name:  # a product with fixed factors keeps nothing
        step = Step("nothing", False)
    else:
        step = Step("input", False)
    act = layer._modules.get("act")
    after = activation_step(act) if act is not None else None
    return [step] if after is None else [step, after]


@dataclasses.dataclass(frozen=True)
class NormLayerReport:
    """What a conversion made of one norm layer."""

    path: str  #: where it is in the model ("" for the model itself)
    before: str  #: its class before the conversion
    after: str  #: its class after
    synchronised: bool  #: whether it normalises over every replica and process after
    in_place: bool  #: whether it writes its output over its input after
    activation: str  #: the activation it computes itself after ("none": a plain norm)
    reason: str  #: why it is (or is not) what it became, in words
    source: str | None  #: "file.py:line: code" of the operation the reason names, if known
    kept_before: int  #: tensors of its input's size kept for backward before (see module)
    kept_after: int  #: ... and after
    input_bytes: int | None = None  #: one such tensor's size, when the report has shapes
    #: In place after: the channels it keeps aside (their input saved, see
    #: ``inplace_policy.ChannelsAside``) on float32 and on float16 / bfloat16 inputs, by its
    #: parameters now (ELU runs out of place in half precision: all); None for a layer out of
    #: place.
    channels_aside: tuple[int, int] | None = None

    @property
    def saved_bytes(self) -> int | None:
        """The bytes of activations the conversion saves at this layer (negative: adds)."""
        if self.input_bytes is None:
            return None
        return (self.kept_before - self.kept_after) * self.input_bytes


@dataclasses.dataclass(frozen=True)
class MemoryEstimate:
    """Activations a training forward keeps for backward, model-wide, before and after the
    conversion, on an input of ``input_shape`` (counted as ``saved_memory`` does)."""

    input_shape: tuple[int, ...]
    dtype: str
    before_bytes: int
    after_bytes: int


@dataclasses.dataclass(frozen=True)
class ConversionReport:
    """One conversion of a model: ``rows`` (one per norm layer, in the model's order) and,
    where an input shape was given, the model's ``memory`` estimate."""

    converter: str
    rows: tuple[NormLayerReport, ...]
    memory: MemoryEstimate | None = None

    def summary(self) -> str:
        """``N of M norm layers synchronised, K in place, saves ~X% of BN activations``:
        X weighs each layer's kept tensors by their size where the report has shapes, else
        counts them."""
        synced = sum(row.synchronised for row in self.rows)
        in_place = sum(row.in_place for row in self.rows)
        sized = all(row.input_bytes is not None for row in self.rows)
        before = sum(row.kept_before * (row.input_bytes if sized else 1) for row in self.rows)
        after = sum(row.kept_after * (row.input_bytes if sized else 1) for row in self.rows)
        change = 1 - after / before if before else 0.0
        verb = "saves" if change >= 0 else "adds"
        text = (f"{self.converter}: {synced} of {len(self.rows)} norm layers synchronised, "
                f"{in_place} in place, {verb} ~{abs(change):.0%} of BN activations")
        if self.memory is not None:
            text += (f"; kept for backward on {self.memory.input_shape} "
                     f"{self.memory.dtype}: {_size(self.memory.before_bytes)} -> "
                     f"{_size(self.memory.after_bytes)}")
        return text

    def __str__(self) -> str:
        sized = all(row.input_bytes is not None for row in self.rows)
        header = ["layer", "before", "after", "sync", "in place", "aside fp32/half",
                  "activation", "kept", *(["saves"] if sized else []), "why"]
        lines = [
            [row.path or "(model)", row.before, row.after, "yes" if row.synchronised else "no",
             "yes" if row.in_place else "no",
             "" if row.channels_aside is None else "/".join(map(str, row.channels_aside)),
             row.activation, f"{row.kept_before} -> {row.kept_after}",
             *([_size(row.saved_bytes) if row.saved_bytes is not None else ""] if sized else []),
             row.reason + (f"  [{row.source}]" if row.source else "")]
            for row in self.rows
        ]
        widths = [max(len(cell) for cell in column) for column in zip(header, *lines)]
        text = [_line(header, widths), _line(["-" * w for w in widths], widths)]
        text += [_line(line, widths) for line in lines]
        return "\n".join([*text, self.summary()])


def _line(cells: Sequence[str], widths: Sequence[int]) -> str:
    return "  ".join(cell.ljust(width) for cell, width in zip(cells, widths)).rstrip()


def _size(size: int) -> str:
    """``size`` bytes in the largest binary unit that leaves a whole part."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(size) >= scale:
            return f"{size / scale:.1f} {unit}"
    return f"{size} B"


class Judgement(NamedTuple):
    """What a converter says of one norm layer it saw."""

    reason: str
    source: str | None = None
    #: The separate activation the layer feeds, as it ran before the conversion.
    follower: Step | None = None
    #: Whether the conversion fused that activation into the layer.
    absorbed: bool = False


def wanted(asked: bool) -> bool:
    """Whether to build a report: asked for, or its summary would be logged."""
    return asked or _log.isEnabledFor(logging.INFO)


def build(converter: str, originals: dict[str, nn.Module], converted: nn.Module,
          judgements: dict[str, Judgement], input_bytes: dict[str, int] | None = None,
          memory: MemoryEstimate | None = None) -> ConversionReport:
    """The report of ``converter``, which made ``converted`` of a model whose norm layers
    were ``originals`` (by path), and log its summary."""
    rows = []
    dtype = None if memory is None else getattr(torch, memory.dtype)
    for path, original in originals.items():
        final = converted.get_submodule(path)
        judgement = judgements[path]
        follower = [judgement.follower] if judgement.follower is not None else []
        synced = isinstance(final, SyncBatchNorm) and final.sync
        in_place = bool(getattr(final, "inplace", False))
        few = in_place and few_values(final, None if input_bytes is None
                                      else input_bytes.get(path), dtype)
        reason = judgement.reason + (f"; trains out of place on this input: {FEW_VALUES}"
                                     if few else "")
        rows.append(NormLayerReport(
            path=path, before=type(original).__name__, after=type(final).__name__,
            synchronised=synced, in_place=in_place,
            activation=activation_text(final), reason=reason,
            source=judgement.source,
            kept_before=kept_tensors(norm_chain(original) + follower),
            kept_after=kept_tensors(norm_chain(final, not few)
                                    + ([] if judgement.absorbed else follower)),
            # A layer the forward does not call keeps nothing.
            input_bytes=None if input_bytes is None else input_bytes.get(path, 0),
            channels_aside=channels_aside(final),
        ))
    report = ConversionReport(converter, tuple(rows), memory)
    _log.info("%s", report.summary())
    return report


FEW_VALUES = (f"fewer than {inplace_policy.MIN_REBUILT_COUNT} values a channel (float64: "
              f"{inplace_policy.MIN_FLOAT64_REBUILT_COUNT}) to rebuild its input from")


def few_values(layer: nn.Module, input_bytes: int | None, dtype: torch.dtype | None) -> bool:
    """Whether the in-place ``layer``, on an input of ``input_bytes`` bytes of ``dtype`` (one
    replica and process: the whole batch), trains out of place: too few values a channel
    (``inplace_policy.rebuilds_from_count``); False where the input is not known."""
    if not input_bytes or dtype is None or not getattr(layer, "num_features", 0):
        return False
    count = input_bytes // (dtype.itemsize * layer.num_features)
    return not inplace_policy.rebuilds_from_count(count, dtype)


# A class named as a BatchNorm is: BatchNorm2d, FrozenBatchNorm2d, BatchNormAct2d, MyBatchNorm.
_BATCHNORM_NAME = re.compile(r"BatchNorm(Act)?([123]d)?$")


def left_reason(module: nn.Module) -> str | None:
    """Why ``module``, when no conversion knows its class, is left as it is: a class named
    as a BatchNorm (torchvision's and timm's ``FrozenBatchNorm2d``, a user's
    ``MyBatchNorm2d``) with running statistics; None for any other module. Known by their
    names, as the converters import neither library."""
    name = type(module).__name__
    if not _BATCHNORM_NAME.search(name) or not hasattr(module, "running_mean"):
        return None
    if "frozen" in name.lower():
        return "a frozen BatchNorm: fixed statistics, nothing to synchronise"
    return ("an unknown norm class: no conversion is registered for it "
            "(encoding_syncbn.register_conversion teaches one)")


def channels_aside(layer: nn.Module) -> tuple[int, int] | None:
    """The channels the in-place ``layer`` keeps aside on float32 and on half-precision
    inputs, as a single replica's layer chooses them (the limits with their margin), from
    its parameters and running variance now; None for a layer out of place or whose
    parameters have no values."""
    if not isinstance(layer, SyncBatchNorm) or not layer.inplace:
        return None
    weight, bias, running_var = layer.weight, layer.bias, layer.running_var
    if any(t is not None and t.is_meta for t in (weight, bias, running_var)):
        return None
    state = weight if weight is not None else layer.running_mean
    device = state.device if state is not None else None
    with torch.no_grad():
        # As the layer computes with them (mapillary's InPlaceABN: |w| + eps).
        weight, bias = layer._affine_params(
            weight, bias, torch.empty(0, dtype=torch.float32, device=device))
        kept = int(small_gamma_mask(weight, bias, gamma_limit(with_margin=True),
                                    running_spread(layer._running_of(running_var))).sum())
    if not inplace_policy.stays_in_place(layer.activation, torch.float16):
        return kept, layer.num_features
    return kept, kept


def activation_text(layer: nn.Module) -> str:
    """The activation a converted layer computes itself: its fused one, or its ``act``
    module's class (``SyncBatchNormAct``, timm's layers)."""
    act = layer._modules.get("act")
    if act is not None and type(act) is not nn.Identity:
        return f"{type(act).__name__} (module)"
    activation = getattr(layer, "activation", "none")
    if activation in ("leaky_relu", "elu"):
        return f"{activation}({layer.slope:g})"
    return activation


__all__ = ["ConversionReport", "MemoryEstimate", "NormLayerReport"]
