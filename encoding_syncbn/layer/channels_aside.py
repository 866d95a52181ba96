"""The channels whose gamma is too small for an in-place layer to rebuild their input from its
output: which channels, and how the host learns them without waiting for the device.

In place, backward rebuilds the input from the output, dividing by gamma; the channels whose
gamma is too small for that keep their input (it is saved for backward, "kept aside") and get
their gradients from it. ``ChannelsAside`` is the layer's one handle on them.
"""

from __future__ import annotations

import torch

from ..kernels import GammaCheck, torch_ops
from ..sync.streams import stream_event
from ..tensor_cache import tensor_cache

# Rebuilding a channel's input from its output y divides by gamma: xhat = (z - b) / w, with z
# the activation's inverse of y. That multiplies y's rounding by |z| / |w| <= |xhat| + |b| / |w|;
# which amplification a channel affords depends on y's dtype.
#
# float32 and float64 outputs: rebuilt where |w| > MIN_INVERTIBLE_GAMMA * max(1, |b|), an
# amplification of up to 1e3 (y's rounding: 6e-8 in float32).
MIN_INVERTIBLE_GAMMA = 1e-3
# float16 and bfloat16 outputs: rebuilt where |w| > HALF_PRECISION_LIMIT * |b| (and |w| is above
# torch_ops.SMALL_GAMMA_FLOOR). y's rounding there (5e-4, 4e-3) is the size of the error
# nn.BatchNorm's own gradients have in that dtype, so the rebuild may add about as much again,
# not amplify it: at |b| <= |w| the gradients stay within 3x nn.BatchNorm2d's error in the same
# dtype (tests/test_half_precision.py).
HALF_PRECISION_LIMIT = 1.0

# ChannelsAside keeps aside channels up to this many times the limits where its answer may
# be a few calls old. Gamma rarely shrinks 16-fold in a few optimiser steps; |b| / |w| rarely
# grows by a quarter.
MARGIN = 16.0
HALF_PRECISION_MARGIN = 1.25

# By the output's dtype: the limit, and the limit with its margin.
_LIMITS = {dtype: (HALF_PRECISION_LIMIT, HALF_PRECISION_LIMIT * HALF_PRECISION_MARGIN)
           if dtype in torch_ops.HALF_DTYPES
           else (MIN_INVERTIBLE_GAMMA, MIN_INVERTIBLE_GAMMA * MARGIN)
           for dtype in torch_ops.INPUT_DTYPES}


def gamma_limit(dtype: torch.dtype, with_margin: bool = False) -> float:
    """The ``limit`` of ``torch_ops.small_gamma`` for an in-place layer whose output has
    ``dtype`` (its input's); ``with_margin``: times ``MARGIN`` (``HALF_PRECISION_MARGIN``), for
    an answer that may be a few calls old."""
    return _LIMITS[dtype][with_margin]


def small_gamma_mask(weight: torch.Tensor, bias: torch.Tensor | None, limit: float
                     ) -> torch.Tensor:
    """Per channel: ``torch_ops.small_gamma(weight, bias, limit)``: gamma too small for the
    output's dtype to rebuild the input, or w or b NaN or inf (no host sync; no bias:
    ``b = 0``)."""
    bias = torch.zeros_like(weight) if bias is None else bias
    return torch_ops.small_gamma(weight, bias, limit)


def small_gamma_index(weight: torch.Tensor, bias: torch.Tensor | None, limit: float
                      ) -> torch.Tensor:
    """The channels' indices whose output cannot be inverted: ``(k,)``, sized by the data."""
    return small_gamma_mask(weight, bias, limit).nonzero().view(-1)


# What ChannelsAside holds for flags without values (the meta device, fake tensors): a
# pass that computes no values keeps nothing aside, and leaves no answer for the calls after it.
_NO_VALUES = object()


class ChannelsAside:
    """The channels an in-place layer keeps aside (its small-gamma channels), known on the
    host: one per layer and replica.

    ``index`` gives the layer's autograd Function their indices, chosen by the parameters of
    the call. They are known in advance where ``replicate()`` read them for the replicas
    (``found``, for outputs up to the limit ``found_limit``). Else reading them from the
    current parameters would cost a device sync per call (``nonzero``); instead each call
    checks the parameters on the device (single replica: in the launch that finishes the batch
    statistics, see ``check``) and copies the flags to (pinned) host memory without waiting;
    a call uses the newest answer whose copy is done (on the CPU: its own), and only a layer's
    first call on a GPU waits for one. That check keeps aside every channel up to ``MARGIN``
    (half precision: ``HALF_PRECISION_MARGIN``) times the limits, so an answer a few calls old
    still covers a channel whose gamma shrank below the limit since, unless it shrank more
    than that many times over. Answers hold for the dtype they were made for: a call in
    another dtype (autocast switched on or off) starts afresh, as a first call.

    ``recomputing`` (a checkpoint's recomputation of a call): the call keeps the answer the
    original call used.
    """

    __slots__ = ("found", "found_limit", "known", "_limit", "_host", "_ready", "_pinned")

    def __init__(self, found: tuple[int, ...] | None = None, found_limit: float = 0.0) -> None:
        self.found = found
        self.found_limit = found_limit
        # The newest answer that arrived, and the limit it and the answer on its way were
        # checked with.
        self.known: tuple[int, ...] | None = None
        self._limit: float | None = None
        # An answer on its way, as flags in host memory (_NO_VALUES: this call's, from a pass
        # without values).
        self._host: torch.Tensor | object | None = None
        self._ready: torch.cuda.Event | None = None
        # Reused from call to call (one answer is on its way at a time).
        self._pinned: torch.Tensor | None = None

    @classmethod
    def read_now(cls, weight: torch.Tensor | None, bias: torch.Tensor | None,
                 dtype: torch.dtype) -> ChannelsAside:
        """Channels found now, for outputs of ``dtype``: ``replicate()`` reads them once (on a
        GPU one device-to-host copy) for all the replicas of a step; each replica is handed
        its own ``copy()``."""
        return cls(small_gamma_channels(weight, bias, dtype), gamma_limit(dtype))

    def copy(self) -> ChannelsAside:
        """The channels found in advance, without the answers learnt since."""
        return ChannelsAside(self.found, self.found_limit)

    def check(self, weight: torch.Tensor, bias: torch.Tensor, dtype: torch.dtype,
              recomputing: bool = False) -> GammaCheck | None:
        """The check for the backend to run in this call on an input of ``dtype`` (in the
        launch that finishes the batch statistics; its flags then go to ``index``), or None
        where no new answer is wanted: the channels are found in advance, one is on its way,
        or the call keeps its answer (never asked while compiling, as ``index``)."""
        if self._found_for(dtype):
            return None
        limit = self._limit_for(dtype, weight, recomputing)
        if self._host is not None or self._frozen(weight, recomputing):
            return None
        return GammaCheck(weight, bias, limit)

    def index(self, weight: torch.Tensor, bias: torch.Tensor, dtype: torch.dtype,
              recomputing: bool = False, flags: torch.Tensor | None = None
              ) -> torch.Tensor | None:
        """The indices of the channels to keep aside in a call on an input of ``dtype``, or
        None where there are none (the usual answer, which costs the layer's Function no
        index); ``flags``: the result of this call's ``check``.

        Never asked while compiling: a compiled layer keeps its input instead (see
        ``functional._as_computed``).
        """
        channels = (self.found if self._found_for(dtype)
                    else self._channels(weight, bias, dtype, recomputing, flags))
        return channel_index(channels, weight.device) if channels else None

    def _found_for(self, dtype: torch.dtype) -> bool:
        """Whether the channels found in advance hold for outputs of ``dtype`` (not for a
        dtype whose limit is stricter than theirs)."""
        return self.found is not None and self.found_limit >= gamma_limit(dtype)

    def _frozen(self, weight: torch.Tensor, recomputing: bool) -> bool:
        """Whether the call must keep the answer it has: a checkpoint's recompute (the
        original call's), or a CUDA graph capture (the warm-up calls': querying an event is
        not allowed there)."""
        if self.known is None:
            return False
        return recomputing or (weight.is_cuda and torch.cuda.is_current_stream_capturing())

    def _limit_for(self, dtype: torch.dtype, weight: torch.Tensor, recomputing: bool) -> float:
        """The limit a call on ``dtype`` checks; answers made with another are dropped
        (unless the call must keep its answer)."""
        limit = gamma_limit(dtype, with_margin=True)
        if limit != self._limit and not self._frozen(weight, recomputing):
            self.known = self._host = self._ready = None
            self._limit = limit
        return limit

    def _channels(self, weight: torch.Tensor, bias: torch.Tensor, dtype: torch.dtype,
                  recomputing: bool, flags: torch.Tensor | None) -> tuple[int, ...]:
        """The newest answer, ``flags`` (this call's check) offered first. Without a check
        offered, the parameters are checked here, in ATen calls."""
        if flags is not None:
            self._offer(flags)
        elif self._frozen(weight, recomputing):
            return self.known
        elif self._host is None or self._limit != gamma_limit(dtype, with_margin=True):
            self._offer(small_gamma_mask(weight, bias, self._limit_for(dtype, weight,
                                                                        recomputing)))
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
        self._host, self._ready = pinned, stream_event(small)

    @staticmethod
    def _read(flags: torch.Tensor) -> tuple[int, ...]:
        """The indices of the nonzero flags of ``flags``, a (C,) tensor in host memory, of
        any dtype and strides.

        Through numpy, not torch: ``nonzero`` or ``tolist`` here would be host reads that a
        training step must not dispatch (on a GPU they sync with the device; this tensor is
        already on the host, but the step's no-sync test cannot tell them apart)."""
        return tuple(flags.numpy().nonzero()[0].tolist())


def small_gamma_channels(weight: torch.Tensor | None, bias: torch.Tensor | None,
                         dtype: torch.dtype) -> tuple[int, ...]:
    """The channels an in-place layer with these parameters keeps aside on inputs of
    ``dtype``, as host ints.

    On a GPU this reads the parameters back (one device-to-host copy): ``SyncBatchNorm`` does
    it once per ``replicate()`` on the original parameters, so that its replicas need none.
    """
    if weight is None:  # affine=False: gamma is 1 everywhere
        return ()
    return tuple(small_gamma_index(weight, bias, gamma_limit(dtype)).tolist())


@tensor_cache(maxsize=256)
def channel_index(channels: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """``channels`` as an index tensor on ``device``, built once (shared: read only)."""
    return torch.tensor(channels, dtype=torch.long, device=device)
