"""Checkpoint recomputation of a synchronised call: the global statistics it used, found again.

Under ``torch.utils.checkpoint`` a layer's forward runs again inside backward, on one replica's
thread, with no other replica there to meet: it must reuse the global ``(mean, invstd)`` of the
original call. Each replica remembers its recent synchronised calls, keyed by their input's
statistics.
"""

from __future__ import annotations

from collections import deque
from typing import Any, NamedTuple

import torch

from .. import compat
from ..kernels import ops_for
from .functional import Exchanged, ReplicaStats, local_channel_stats

# How many recent synchronised calls a replica remembers for checkpoint recomputation.
CACHE_SIZE = 64


class SyncedCall(NamedTuple):
    """A synchronised call's local and global statistics, global count and mean offset
    (``Exchanged.offset``), for recomputation, and the ops that computed the local ones (a
    recompute must compare statistics of the same backend)."""

    ops: Any
    local_mean: torch.Tensor
    local_m2: torch.Tensor
    mean: torch.Tensor
    invstd: torch.Tensor
    total: int
    grad_enabled: bool
    offset: torch.Tensor | None


class RecomputeCache:
    """One replica's recent synchronised calls (the last ``CACHE_SIZE``)."""

    __slots__ = ("_calls",)

    def __init__(self) -> None:
        self._calls: deque[SyncedCall] = deque(maxlen=CACHE_SIZE)

    def remember(self, own: ReplicaStats, mean: torch.Tensor, invstd: torch.Tensor,
                 total: int, offset: torch.Tensor | None) -> None:
        """Keep a synchronised call that may be recomputed (``may_be_recomputed``)."""
        if may_be_recomputed():
            self._calls.append(
                SyncedCall(
                    ops_for(own.x), own.mean, own.m2, mean.detach(), invstd.detach(), total,
                    torch.is_grad_enabled(), offset,
                )
            )

    def replay(self, x: torch.Tensor) -> Exchanged:
        """The ``exchange`` of a checkpoint's recomputation (``functional.synced_batch_norm_act``):
        the global statistics of the original call on ``x``, met with no other replica (no
        merge to link to).

        The call is found by its input's statistics, recomputed by the backend that computed
        them then (another backend's differ in the last bits: Triton's against ATen's).
        """
        local: dict[Any, tuple[torch.Tensor, torch.Tensor]] = {}
        for call in self._calls:
            if call.ops not in local:
                with torch.no_grad():
                    local[call.ops] = local_channel_stats(x, call.ops)[:2]
            local_mean, local_m2 = local[call.ops]
            if torch.equal(call.local_mean, local_mean) and torch.equal(call.local_m2, local_m2):
                if not call.grad_enabled:
                    raise RuntimeError(
                        "SyncBatchNorm under torch.utils.checkpoint(use_reentrant=True): the "
                        "reentrant mode rebuilds each replica's graph apart, so gradients "
                        "cannot flow between replicas; use use_reentrant=False"
                    )
                return Exchanged(call.mean, call.invstd, call.total, None, call.offset)
        raise RuntimeError(
            "SyncBatchNorm: a recomputation (checkpoint) found no synchronised call with the "
            "same input statistics; the checkpointed function must be deterministic"
        )


def may_be_recomputed() -> bool:
    """Whether this forward may run again inside backward: under ``torch.utils.checkpoint``,
    whose non-reentrant mode packs saved tensors with hooks and whose reentrant mode runs the
    forward without grad (where the recompute must fail with a clear message)."""
    return not torch.is_grad_enabled() or compat.saved_tensor_hooks_may_be_active()


def inside_backward() -> bool:
    """A checkpoint recomputation runs the forward again inside backward (graph task >= 0).

    A compiled graph is traced once, not re-run eagerly by a recomputation.
    """
    return not torch.compiler.is_compiling() and compat.inside_backward()
