"""A layer call's checks and decisions, kept for the calls after it with the same key.

A call of one replica that is not synchronised (its own batch's statistics, or the running
ones) checks its input (rank, channels, dtype, values a channel) and decides, before any
launch, how it runs: in training or with the running statistics, over how many values a
channel, in which dtype, and whether its key lets it run in place
(``inplace_policy.in_place_by_key``). All of that follows from the input's shape, dtype and
device and from the layer's own attributes, as long as the call runs eagerly with nothing
around it that changes its path (a quiet call, ``CallMemo.fits``). So ``SyncBatchNorm`` keeps
what its last such call decided (``CallMemo``), and a quiet call of the same key goes straight
to what each call must still do (``SyncBatchNorm._repeat_call``): read the parameters and
running statistics (a parametrization computes them, ``functional_call`` swaps them), ask
whether this tensor may be overwritten and which channels keep their input aside, and launch.
A key whose values a channel are too few for the input's own precision
(``functional.computes_in``) keeps no memo.

The memo holds no tensor: nothing it holds goes stale when a tensor's values, or which tensor
the layer holds, change. The layer drops it whenever one of its attributes is assigned or
deleted (``train()``/``eval()``, ``activation``, ``inplace``, ``replicate()``'s replica slot, a
pruning hook's weight, a parametrization's class), its tensors are converted (``_apply``:
``to()``, ``half()``) and when it is unpickled or copied; a call of a new key is checked in
full, and leaves the memo as it was where it fails.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .. import compat
from ..kernels import Backend
from . import inplace_policy


class CallMemo(NamedTuple):
    """What a call of one key decided: the key (the input's ``shape``, ``dtype``, ``device``),
    its mode (``evaluating``: with the running statistics), its values a channel (``count``;
    None: evaluating), whether the key lets it run in place (``in_place``), where the
    layer's tensors are read (``plain_state``) and the ops a training call runs
    (``key_ops``)."""

    shape: torch.Size
    dtype: torch.dtype
    device: torch.device
    evaluating: bool
    count: int | None
    in_place: bool
    # Whether the layer's parameters and running statistics lie plainly in its
    # ``_parameters`` and ``_buffers``, for a repeat call to read them there
    # (``SyncBatchNorm._plain_state``).
    plain_state: bool
    # The ops a training call of the key runs while the backend chosen when the memo was
    # made (``backend``, ``kernels.get_backend``) is still chosen and no dispatch mode is
    # active: ``kernels.key_ops`` of ``kernels.ops_for``'s answer (the Triton kernels keep
    # their launches for the key's calls), which follows from those alone for an input of the
    # key outside ``torch.compile``; None: evaluating, or made under a dispatch mode.
    backend: str
    key_ops: Backend | None

    def fits(self, x: object) -> bool:
        """Whether a call on ``x`` now, outside ``torch.compile`` (the caller asks first), may
        take these decisions: a plain tensor of the key, in a quiet call: nothing around it
        that changes its path (not captured or transformed, ``tracing.in_aten_ops``; not a
        checkpoint's recomputation inside backward; without the in-place misuse checks)."""
        return (type(x) is torch.Tensor and x.shape == self.shape and x.dtype == self.dtype
                and x.device == self.device and compat.eager_untraced()
                and not inplace_policy.checking())
