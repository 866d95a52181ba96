"""Running in place: when ``SyncBatchNorm`` may, which of its channels keep their input, and the
opt-in checks of its misuse.

When: a slope it can invert, an input it may overwrite, a dtype and a count it can rebuild the
input from. Decided before anything is computed: a refusal by autograd inside the Function
would come after the input, and the running statistics, had been written.

Which channels: in place, backward rebuilds the input from the output, dividing by gamma; the
channels whose gamma is too small for that (against beta, and against the spread of their
normalised input) keep their input (it is saved for backward, "kept aside") and get their
gradients from it. ``ChannelsAside`` is the layer's one handle on them:
which channels, and how the host learns them without waiting for the device.

Misuse checks, at the operation that misuses an in-place layer. An in-place layer writes its
output over its input and keeps only the output for backward. Two misuses follow:

- the **input used again** after the layer (``abn(x) + x``): ``x`` now holds the output, so
  the result is silently wrong (no error ever comes);
- the **output modified in place** after the layer (``out += identity``, or a second
  in-place layer fed the output directly): backward cannot rebuild the input; without
  checks the layer's backward raises, naming the layer (see ``functional._unpack``).

With checks on (``with encoding_syncbn.check_inplace():``, or ``ENCODING_SYNCBN_CHECK=1`` in
the environment for the whole process), each in-place call

- turns the tensor it overwrote into an ``OverwrittenTensor``: any later torch operation on
  it raises, naming the layer (metadata such as ``.shape`` still works);
- returns its output as an ``InPlaceOutput``: an in-place operation on it (``+=``, ``add_``,
  ``out=``, ``inplace=True``, an in-place layer), or any use after a write through another
  alias (its version counter moved), raises while the output's gradient is still needed.

Checks cost a Python-level hook per operation on those tensors: a debugging mode, off by
default. What they cannot see: writes through a view taken before the misuse (``out[:, :2]
+= 1``; backward still names the layer), and tensors that share the input's memory under
another name (``y = x.view(...)`` before ``abn(x)``; ``y`` is silently overwritten too).
"""

from __future__ import annotations

import contextlib
import os
import threading
import warnings
from collections.abc import Iterator
from typing import Any, NamedTuple

import numpy as np
import torch

from .. import activations, compat
from ..activations import ActConfig
from ..kernels import GammaCheck, Spread, torch_ops, variance_spread
from ..sync.streams import stream_event
from ..tensor_cache import tensor_cache

# ---- when a call runs in place ----------------------------------------------------------

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
    if inplace and definition.inverse_needs_positive_param:
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
# which an in-place layer trains in place, where its rebuild computes in a dtype finer than its
# output's; see ``rebuilds_from_count``.
MIN_REBUILT_COUNT = 23
# The fewest over which a rebuild computing as finely as its output meets the same chance: a
# call over fewer computes in float64 (``functional.computes_in``).
MIN_OWN_PRECISION_COUNT = 38
# The fewest over which float64, with nothing finer to compute in, trains in place: its
# per-channel coefficients round as well as its arithmetic, leaving the rebuild one share.
MIN_FLOAT64_REBUILT_COUNT = 112

# What the counts are derived from, besides the largest |beta| / |gamma| of a channel rebuilt
# (``REBUILD_LIMIT``): the bound on the gradients' error (a multiple of nn.BatchNorm2d's), and
# the chance per channel and call of exceeding it that is accepted.
GRADIENT_ERROR_BOUND = 3.0
ACCEPTED_FAILURE_CHANCE = 1e-6


def takes_double_double_gradient(dtype: torch.dtype, count: int, inplace: bool) -> bool:
    """Whether a training call's input gradient is taken in double-double
    (``kernels/double_double.py``): float64 inputs whose statistics cover fewer than
    ``MIN_FLOAT64_REBUILT_COUNT`` values a channel (all replicas and ranks), which train out
    of place (their input saved).

    The rebuild's count, for the rebuild's reason: float64's per-channel coefficients
    (invstd, ``sum(dz * xhat) / n``) round in float64, an error along xhat that does not
    shrink with dx, as the rebuilt input's does. The failure-chance model
    (``rebuilds_from_count``) bounds the chance of both together exceeding the bound only
    from ``MIN_FLOAT64_REBUILT_COUNT`` on; below it, out of place, the coefficients' alone
    still exceed it in single channels where nn.BatchNorm2d's own roundings happen to cancel,
    so the whole gradient is rounded once instead: hundreds of elementwise operations over
    the saved input and dy, paid only by layers this small
    (``benchmarks/float64_few_values_cost.py``).
    """
    return dtype == torch.float64 and not inplace and not rebuilds_from_count(count, dtype)


def rebuilds_from_count(count: int, dtype: torch.dtype) -> bool:
    """Whether an in-place layer whose batch statistics are taken over ``count`` values a
    channel (all replicas and ranks) on inputs of ``dtype`` may rebuild its input for the
    input gradient; if not, it trains out of place (such layers are tiny: an (N, C, 1, 1)
    pooling branch).

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
    function), which falls with n and, at rho = 1 (``REBUILD_LIMIT``: channels of larger rho
    keep their input aside), is first below ``ACCEPTED_FAILURE_CHANCE`` at
    ``MIN_REBUILT_COUNT`` (tests/test_half_precision.py derives it again). At n = 2 dx is 0
    whatever the rebuild.

    That holds where the layer's own arithmetic is finer than the output's rounding (float16
    and bfloat16 in float32; float32 below ``MIN_OWN_PRECISION_COUNT`` values, which computes
    in float64). Arithmetic as fine as the output errs about as nn.BatchNorm2d's does, taking
    one of the bound's B shares: with B - 1 the chance is first below the accepted one at
    ``MIN_OWN_PRECISION_COUNT``, from which float32 computes in float32. A call over fewer
    values computes as ``inplace=False`` does, in float64 (``functional.computes_in``).
    float64, with nothing finer, rounds its per-channel coefficients (invstd, the in-place
    backward's) in its own arithmetic as well, a second share where nn.BatchNorm2d's
    roundings cancel: with B - 2 the chance is first below the accepted one at
    ``MIN_FLOAT64_REBUILT_COUNT``, below which float64 trains out of place.
    """
    if dtype == torch.float64:
        return count >= MIN_FLOAT64_REBUILT_COUNT
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


def can_overwrite(x: torch.Tensor, warned: list[bool], layer: str) -> bool:
    """Whether ``x`` may be overwritten by a custom Function; if not, warn, naming ``layer``,
    unless ``warned[0]`` (the layer's flag: once per layer). Never asked while compiling (a
    compiled call runs out of place, ``plan_call``): Dynamo cannot inspect view provenance,
    and a warning inside the traced code would break the graph."""
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
            f"{layer} (inplace=True) got {reason}, which cannot be overwritten; "
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


# ---- the channels kept aside ------------------------------------------------------------

# Rebuilding a channel's input from its output y divides by gamma: xhat = (z - b) / w, with z
# the activation's inverse of y. That multiplies y's rounding by |z| / |w| <= |xhat| + |b| / |w|,
# in units of the output's own rounding, the unit nn.BatchNorm's own gradients err in, in every
# dtype: a channel is rebuilt where |w| > REBUILD_LIMIT * |b| (and |w| is above
# torch_ops.SMALL_GAMMA_FLOOR), so that the rebuild adds about as much again, not amplify it
# (the counts of ``rebuilds_from_count`` follow from it); against xhat's own size, where its
# spread s is under 1 (a near-constant channel), where |w| s > REBUILD_LIMIT * |b| too.
REBUILD_LIMIT = 1.0

# ChannelsAside keeps aside channels up to this many times the limit where its answer may
# be a few calls old: |b| / |w| rarely grows by a quarter in a few optimiser steps.
MARGIN = 1.25


def gamma_limit(with_margin: bool = False) -> float:
    """The ``limit`` of ``torch_ops.small_gamma`` for an in-place layer; ``with_margin``:
    times ``MARGIN``, for an answer that may be a few calls old."""
    return REBUILD_LIMIT * MARGIN if with_margin else REBUILD_LIMIT


#: A layer's running variance and eps: what ``running_spread`` reads.
Running = tuple[torch.Tensor, float]


def running_spread(running: Running | None) -> Spread | None:
    """xhat's spread as the running statistics see it, ``running_var / (running_var + eps)``
    (None without them), for a call whose own batch's spread is not checked: its channels are
    chosen before its statistics (replicas, a synchronised call, evaluation, a compiled call's
    count). A near-constant channel stays near-constant from step to step, and the running
    variance, an average of the batches', tells it apart once it has come down to it: from
    its initial 1, about 100 steps at momentum 0.1 (0.9^100 = 3e-5) for a variance near eps
    1e-5; at once from a trained model's statistics. A new tensor: the buffer may be updated
    before the spread is read (a compiled call folds its batch in first)."""
    if running is None:
        return None
    running_var, eps = running
    return variance_spread(running_var.to(torch.promote_types(running_var.dtype, torch.float32)),
                           eps)


def small_gamma_mask(weight: torch.Tensor, bias: torch.Tensor | None, limit: float,
                     spread: Spread | None = None) -> torch.Tensor:
    """Per channel: ``torch_ops.small_gamma(weight, bias, limit, spread)``: gamma too small
    for the output's dtype to rebuild the input (against xhat's ``spread``, where given), or
    w or b NaN or inf (no host sync; no bias: ``b = 0``)."""
    bias = torch.zeros_like(weight) if bias is None else bias
    return torch_ops.small_gamma(weight, bias, limit, spread)


def small_gamma_index(weight: torch.Tensor, bias: torch.Tensor | None, limit: float,
                      spread: Spread | None = None) -> torch.Tensor:
    """The channels' indices whose output cannot be inverted: ``(k,)``, sized by the data."""
    return small_gamma_mask(weight, bias, limit, spread).nonzero().view(-1)


# What ChannelsAside holds for flags without values (the meta device, fake tensors): a
# pass that computes no values keeps nothing aside, and leaves no answer for the calls after it.
_NO_VALUES = object()


class ChannelsAside:
    """The channels an in-place layer keeps aside (its small-gamma channels), known on the
    host: one per layer and replica.

    ``index`` gives the layer's autograd Function their indices, chosen by the parameters of
    the call. They are known in advance where ``replicate()`` read them for the replicas
    (``found``). Else reading them from the current parameters would cost a device sync per
    call (``nonzero``); instead each call checks the parameters on the device (single
    replica: in the launch that finishes the batch statistics, see ``check``) and copies the
    flags to (pinned) host memory without waiting, unless an earlier call's are still on their
    way; a call uses the newest answer whose copy is done (on the CPU: its own), and only a
    layer's first call on a GPU waits for one. That check keeps aside every channel up to
    ``MARGIN`` times the limit, so an answer a few calls old still covers a channel whose
    |beta| / |gamma| grew past the limit since, unless it grew more than that. xhat's spread
    (``torch_ops.small_gamma``) comes from the batch in that check, from the running variance
    where the parameters are checked without one (``index``, ``read_now``).

    ``recomputing`` (a checkpoint's recomputation of a call): the call keeps the answer the
    original call used.
    """

    __slots__ = ("found", "known", "_host", "_ready", "_pinned", "_check", "_viewed", "_view")

    def __init__(self, found: tuple[int, ...] | None = None) -> None:
        self.found = found
        # The newest answer that arrived.
        self.known: tuple[int, ...] | None = None
        # An answer on its way, as flags in host memory (_NO_VALUES: this call's, from a pass
        # without values).
        self._host: torch.Tensor | object | None = None
        self._ready: torch.cuda.Event | None = None
        # Reused from call to call (one answer is on its way at a time).
        self._pinned: torch.Tensor | None = None
        # The last call's check, for the calls with the same parameters.
        self._check: GammaCheck | None = None
        # The flags read last, and a view of their bytes (``_read``).
        self._viewed: torch.Tensor | None = None
        self._view: memoryview | None = None

    @classmethod
    def read_now(cls, weight: torch.Tensor | None, bias: torch.Tensor | None,
                 running: Running | None = None) -> ChannelsAside:
        """Channels found now: ``replicate()`` reads them once (on a GPU one device-to-host
        copy) for all the replicas of a step; each replica is handed its own ``copy()``."""
        return cls(small_gamma_channels(weight, bias, running_spread(running)))

    def copy(self) -> ChannelsAside:
        """The channels found in advance, without the answers learnt since."""
        return ChannelsAside(self.found)

    def check(self, weight: torch.Tensor, bias: torch.Tensor, recomputing: bool = False
              ) -> GammaCheck | None:
        """The check for the backend to run in this call (in the launch that finishes the
        batch statistics; its flags then go to ``index``), or None where the call takes no
        new answer: the channels are found in advance, or the call keeps its answer (never
        asked while compiling, as ``index``). While an answer is on its way the check runs
        all the same and ``index`` drops its flags: a layer's training calls launch alike
        whenever the copies land (one set of launches kept, ``TrainingStep``), at the cost
        of a few bytes the launch writes."""
        if self.found is not None or self._frozen(weight, recomputing):
            return None
        check = self._check
        if check is None or check.weight is not weight or check.bias is not bias:
            check = self._check = GammaCheck(weight, bias, gamma_limit(with_margin=True))
        return check

    def index(self, weight: torch.Tensor, bias: torch.Tensor, recomputing: bool = False,
              flags: torch.Tensor | None = None, running: Running | None = None
              ) -> torch.Tensor | None:
        """The indices of the channels to keep aside in a call, or None where there are
        none (the usual answer, which costs the layer's Function no index); ``flags``: the
        result of this call's ``check``; without them the parameters are checked against
        the spread of the ``running`` statistics, where there are (``running_spread``).

        Never asked while compiling: a compiled layer keeps its input instead (see
        ``plan_call``).
        """
        channels = (self.found if self.found is not None
                    else self._channels(weight, bias, recomputing, flags, running))
        return channel_index(channels, weight.device) if channels else None

    def _frozen(self, weight: torch.Tensor, recomputing: bool) -> bool:
        """Whether the call must keep the answer it has: a checkpoint's recompute (the
        original call's), or a CUDA graph capture (the warm-up calls': querying an event is
        not allowed there)."""
        if self.known is None:
            return False
        return recomputing or (weight.is_cuda and torch.cuda.is_current_stream_capturing())

    def _channels(self, weight: torch.Tensor, bias: torch.Tensor, recomputing: bool,
                  flags: torch.Tensor | None, running: Running | None) -> tuple[int, ...]:
        """The newest answer, ``flags`` (this call's check) offered first unless one is on
        its way (its copy is not reused before it lands). Without a check offered, the
        parameters are checked here, in ATen calls, with the running statistics' spread."""
        if flags is not None:
            if self._host is None:
                self._offer(flags)
        elif self._frozen(weight, recomputing):
            return self.known
        elif self._host is None:
            self._offer(small_gamma_mask(weight, bias, gamma_limit(with_margin=True),
                                         running_spread(running)))
        host = self._host
        if host is None:  # none on its way: the newest answer (on the CPU: this call's)
            return self.known
        if self.known is None and self._ready is not None:
            self._ready.synchronize()  # the layer's first call on a GPU: once
        if self._ready is None or self._ready.query():
            self._host = self._ready = None
            if host is _NO_VALUES:  # this call's answer, not one for the calls after it
                return ()
            self.known = self._read(host)
        return self.known

    def _offer(self, small: torch.Tensor) -> None:
        """Start bringing per-channel flags (nonzero: keep aside) to the host, without
        waiting for the device (on a GPU; other devices than the CPU wait). Flags in host
        memory are read now: the answer is ``known`` at once."""
        if type(small) is not torch.Tensor or small.is_meta:
            # No values to read (the meta device, a tracing tool's fake tensors): no answer.
            self._host, self._ready = _NO_VALUES, None
            return
        if small.is_cpu:  # read where they lie: no device sync
            self.known = self._read(small)
            return
        if not small.is_cuda:  # mps, xpu: after a blocking copy
            self._host, self._ready = small.cpu(), None
            return
        pinned = self._pinned
        if pinned is None or pinned.shape != small.shape or pinned.dtype != small.dtype:
            # Written by the calls after this one, in inference mode or not: a normal tensor
            # (see ``tensor_cache``).
            with torch.inference_mode(False):
                pinned = self._pinned = torch.empty(small.shape, dtype=small.dtype,
                                                    pin_memory=True)
        pinned.copy_(small, non_blocking=True)
        # The copy's end: the host polls it (``_channels``), no other stream waits for it.
        self._host, self._ready = pinned, stream_event(small)

    def _read(self, flags: torch.Tensor) -> tuple[int, ...]:
        """The indices of the nonzero flags of ``flags``, a (C,) tensor in host memory, of
        any dtype and strides.

        Through numpy, not torch: ``nonzero`` or ``tolist`` here would be host reads that a
        training step must not dispatch (on a GPU they sync with the device; this tensor is
        already on the host, but the step's no-sync test cannot tell them apart). All bytes
        zero, the usual answer, is told from the bytes alone (all values are zero then).

        A layer's calls hand it one buffer call after call (a training step's flags on the
        CPU, the layer's pinned copy on a GPU), written anew by each: its view is kept
        (``_view`` of ``_viewed``, held so that no other tensor takes its place), and a call
        reads the bytes it holds, where making the numpy array of the tensor again would cost
        more host time than the rest of the read."""
        view = self._view
        if self._viewed is not flags:
            view = self._view = memoryview(flags.numpy())
            self._viewed = flags
        if view.tobytes().count(0) == view.nbytes:
            return ()
        return tuple(np.asarray(view).nonzero()[0].tolist())


def small_gamma_channels(weight: torch.Tensor | None, bias: torch.Tensor | None,
                         spread: Spread | None = None) -> tuple[int, ...]:
    """The channels an in-place layer with these parameters (and xhat's ``spread``) keeps
    aside, as host ints.

    On a GPU this reads the parameters back (one device-to-host copy): ``SyncBatchNorm`` does
    it once per ``replicate()`` on the original parameters, so that its replicas need none.
    """
    if weight is None:  # affine=False: gamma is 1 everywhere and beta 0
        return ()
    return tuple(small_gamma_index(weight, bias, gamma_limit(), spread).tolist())


@tensor_cache(maxsize=256)
def channel_index(channels: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """``channels`` as an index tensor on ``device``, built once (shared: read only)."""
    return torch.tensor(channels, dtype=torch.long, device=device)


# ---- checks of misuse -------------------------------------------------------------------

# Whole process, every thread: DataParallel's replicas run the layers on threads of their own.
_ENV = "ENCODING_SYNCBN_CHECK"
_lock = threading.Lock()
_active = 0
# Read once, at import: the check runs on every in-place call.
_FROM_ENV = os.environ.get(_ENV, "0") not in ("", "0")


def checking() -> bool:
    """Whether in-place calls are checked now (``check_inplace`` or ENCODING_SYNCBN_CHECK)."""
    return (_active > 0 or _FROM_ENV) and not torch.compiler.is_compiling()


@contextlib.contextmanager
def check_inplace() -> Iterator[None]:
    """Check every in-place layer's misuse while the block runs, in every thread.

    See this module's docstring for what is checked. Nestable.
    """
    global _active
    with _lock:
        _active += 1
    try:
        yield
    finally:
        with _lock:
            _active -= 1


# Tensor attributes that read no values: allowed on an overwritten tensor.
_METADATA = frozenset({
    "shape", "size", "dim", "ndim", "dtype", "device", "layout", "numel", "stride",
    "storage_offset", "is_contiguous", "requires_grad", "is_leaf", "grad_fn", "data_ptr",
    "names", "is_cuda", "is_sparse", "is_quantized", "is_meta", "element_size",
    "nelement", "__class__", "__len__",
})
_INPLACE_OPERATORS = frozenset({
    "__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__", "__imod__",
    "__ipow__", "__iand__", "__ior__", "__ixor__", "__ilshift__", "__irshift__",
    "__imatmul__", "__setitem__",
})


def _name(func: Any) -> str:
    """``func``'s name; for a property getter (``Tensor.shape.__get__``) the property's."""
    name = getattr(func, "__name__", "")
    if name in ("__get__", "__set__"):
        return getattr(getattr(func, "__self__", None), "__name__", name)
    return name


def _writes_first_argument(func: Any, args: tuple, kwargs: dict) -> bool:
    """Whether ``func(*args, **kwargs)`` writes its first argument (or writes to ``out=``)."""
    name = _name(func)
    if name in _INPLACE_OPERATORS or (name.endswith("_") and not name.startswith("__")):
        return True
    if kwargs.get("inplace") is True:
        return True
    # torch.nn.functional's activations take ``inplace`` positionally too.
    return any(arg is True for arg in args[1:]) and name in _POSITIONAL_INPLACE


_POSITIONAL_INPLACE = frozenset({
    "relu", "leaky_relu", "elu", "celu", "selu", "hardtanh", "relu6", "silu", "mish",
    "hardswish", "hardsigmoid", "rrelu", "threshold",
})


class _Checked(torch.Tensor):
    """Both checked kinds: one ``__torch_function__`` sees every tensor of a call, whichever
    kind torch asks first."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        with compat.disable_torch_function_subclass():
            for arg in (*args, *kwargs.values()):
                if isinstance(arg, OverwrittenTensor):
                    _check_overwritten_use(arg, func)
                elif isinstance(arg, InPlaceOutput) and arg.requires_grad:
                    _check_output_use(arg, func, args, kwargs)
            return func(*args, **kwargs)


class OverwrittenTensor(_Checked):
    """A tensor an in-place layer overwrote (checks on): using it again is an error."""

    _overwritten_by: str


class InPlaceOutput(_Checked):
    """An in-place layer's output (checks on): writing it while backward needs it is an
    error, raised at the write."""

    _written_by: str
    _expected_version: int


def _check_overwritten_use(stale: OverwrittenTensor, func: Any) -> None:
    name = _name(func)
    # Private attributes are autograd's bookkeeping (``_backward_hooks`` when a view of the
    # tensor is written), not a read of its values.
    private = name.startswith("_") and not name.startswith("__")
    if name in _METADATA or private or func is torch.Tensor.__repr__:
        return
    raise RuntimeError(
        f"{stale._overwritten_by} (inplace=True) overwrote this tensor with its output, and "
        f"it was used again after the layer ({_name(func)}; e.g. `abn(x) + x`, which silently "
        "adds the output to itself). Use the value the layer returned, keep a copy of the "
        "input before the layer, or use inplace=False for that layer"
    )


def _check_output_use(out: InPlaceOutput, func: Any, args: tuple, kwargs: dict) -> None:
    if out._version != out._expected_version:
        raise RuntimeError(_output_written_message(out._written_by, "through another alias"))
    if out is kwargs.get("out") or (out is args[0] and _writes_first_argument(func, args, kwargs)):
        raise RuntimeError(_output_written_message(out._written_by, f"by {_name(func)}"))


def _output_written_message(layer: str, how: str) -> str:
    return (
        f"{layer} (inplace=True): its output is modified in place {how} while its backward "
        "still needs it to rebuild the input (`out += identity` after the layer, or another "
        "in-place layer fed this output directly). Fix: write `out = out + identity` instead "
        "of `out += identity`, or use inplace=False for that layer"
    )


def before_write(x: torch.Tensor, layer: str) -> None:
    """Raise if ``x``, which ``layer`` is about to overwrite, is an in-place layer's output
    that its backward still needs."""
    with compat.disable_torch_function_subclass():
        if isinstance(x, InPlaceOutput) and x.requires_grad:
            raise RuntimeError(_output_written_message(x._written_by, f"by {layer}"))


def after_write(x: torch.Tensor, out: torch.Tensor, layer: str) -> torch.Tensor:
    """Mark ``x`` (overwritten by ``layer``) stale; return ``out`` as a checked alias."""
    with compat.disable_torch_function_subclass():
        result = out.as_subclass(InPlaceOutput)
        result._written_by, result._expected_version = layer, out._version
    # Only plain tensors change class: a user's own subclass keeps its behaviour.
    if type(x) in (torch.Tensor, InPlaceOutput):
        x.__class__ = OverwrittenTensor
        x._overwritten_by = layer
    return result


# ---- one call's decision ----------------------------------------------------------------

class CallPlan(NamedTuple):
    """How one call of an in-place layer runs, decided before its statistics are taken.

    ``config``: the layer's ``ActConfig`` as the call computes (``inplace`` False: out of
    place). ``kept``: the channels it keeps aside, where they are known before the statistics
    (None: none, or not yet). ``check``: where they are not, the check of the parameters that
    the launch finishing the batch statistics runs; its flags then go to
    ``ChannelsAside.index``.
    """

    config: ActConfig
    kept: torch.Tensor | None = None
    check: GammaCheck | None = None


def in_place_by_key(config: ActConfig, dtype: torch.dtype, count: int | None) -> bool:
    """Whether a call of an in-place layer configured as ``config`` may run in place as far as
    its input's dtype and its values a channel tell (``count``: as ``plan_call``'s): the part
    of ``plan_call``'s decision that is the same for every call of one key
    (``call_memo``)."""
    return (stays_in_place(config.activation, dtype)
            and (count is None or rebuilds_from_count(count, dtype)))


def plan_call(config: ActConfig, x: torch.Tensor, warned: list[bool],
              channels_aside: ChannelsAside, weight: torch.Tensor, bias: torch.Tensor, *,
              count: int | None = None, recomputing: bool = False,
              running: Running | None = None) -> CallPlan:
    """Whether a call of a layer configured as ``config`` runs in place on ``x``, and which of
    its channels keep their input: the one place the layer asks. ``warned``: the layer's
    out-of-place warning flag (``can_overwrite``); ``channels_aside``: the layer's; ``count``:
    the values a channel of a training call on ``x``'s own batch (its statistics then choose
    the channels kept aside, ``CallPlan.check``), None for a call with running or exchanged
    statistics (the count rule then waits for the exchange's count: ``for_count``);
    ``recomputing``: a checkpoint's recomputation, which keeps the original call's channels;
    ``running``: the layer's running variance and eps (None: no running statistics), for a
    call whose channels are chosen before its statistics (``ChannelsAside.index``).

    With checks on (``check_inplace``), ``x`` is refused first where it is an in-place
    layer's output that its backward still needs (``before_write``).

    While compiling the call runs out of place. An in-place Function could neither overwrite
    its input there (AOTAutograd mis-routes the gradient of an autograd.Function that
    overwrites a graph input with ``mark_dirty``), nor keep aside the channels its output
    cannot rebuild the input of (their number depends on the values: a size Dynamo breaks the
    graph at), nor copy its output over an input it saved. Out of place, the Function keeps its
    input, its gradients are exact for every gamma, its graph has static shapes throughout,
    and which buffers hold what is Inductor's to plan. (Traced as its formula in one process
    on the CPU, an in-place call keeps only its output and a static number of channels'
    input instead, without this plan: ``compiled_inplace``.)
    """
    if not config.inplace:
        return CallPlan(config)
    if checking():
        before_write(x, config.layer)
    if torch.compiler.is_compiling():
        return CallPlan(config.out_of_place())
    return plan_overwrite(config, x, warned, channels_aside, weight, bias,
                          in_place_by_key(config, x.dtype, count), count is not None,
                          recomputing, running)


def plan_overwrite(config: ActConfig, x: torch.Tensor, warned: list[bool],
                   channels_aside: ChannelsAside, weight: torch.Tensor, bias: torch.Tensor,
                   by_key: bool, own_batch: bool, recomputing: bool = False,
                   running: Running | None = None) -> CallPlan:
    """``plan_call`` of an in-place layer's call outside ``torch.compile`` and the misuse
    checks, whose key lets it run in place or not (``by_key``: ``in_place_by_key``):
    whether ``x`` may be overwritten, and the channels kept aside, or their check where
    ``own_batch`` (a training call on x's own batch). A repeat call asks this alone
    (``call_memo``). Without grad mode (inference, evaluation under ``torch.no_grad``) no
    backward rebuilds the input: a call with running or exchanged statistics keeps nothing
    aside and checks no parameters."""
    if not can_overwrite(x, warned, config.layer) or not by_key:
        return CallPlan(config.out_of_place())
    if own_batch:
        return CallPlan(config, check=channels_aside.check(weight, bias, recomputing))
    if not torch.is_grad_enabled():
        return CallPlan(config)
    return CallPlan(config, kept=channels_aside.index(weight, bias, recomputing, None,
                                                      running))


def for_count(config: ActConfig, count: int, dtype: torch.dtype) -> ActConfig:
    """``config`` for a training call on inputs of ``dtype`` whose statistics are taken over
    ``count`` values a channel: out of place where that is too few to rebuild the input from
    the output (``rebuilds_from_count``)."""
    if config.inplace and not rebuilds_from_count(count, dtype):
        return config.out_of_place()
    return config
