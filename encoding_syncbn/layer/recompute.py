"""Checkpoint recomputation of a synchronised call: the global statistics it used, found again.

Under ``torch.utils.checkpoint`` a layer's forward runs again inside backward, on one replica's
thread, with no other replica there to meet: it must reuse the global ``(mean, invstd)`` of the
original call. Each replica remembers its synchronised calls (its last ones, and any whose
graph is alive), found again by their input's statistics.
"""

from __future__ import annotations

import weakref
from collections import deque
from typing import Any, NamedTuple

import torch

from .. import compat
from ..kernels import ops_for
from .functional import Exchanged, ReplicaStats, local_channel_stats

# How many of its last synchronised calls a replica remembers whatever their graph (a call
# whose output's node is gone may still be recomputed: its output fed no differentiable op).
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

    def same_statistics(self, other: SyncedCall) -> bool:
        """Whether a recomputation of either call would compute what it computed."""
        return (self.total == other.total and torch.equal(self.mean, other.mean)
                and torch.equal(self.invstd, other.invstd)
                and (self.offset is None) == (other.offset is None)
                and (self.offset is None or torch.equal(self.offset, other.offset)))


class RecomputeCache:
    """One replica's synchronised calls that a checkpoint may recompute: the last
    ``CACHE_SIZE``, and beyond those each call with a graph as long as its output's node
    lives (a backward that recomputes it runs before the graph is freed, however many calls
    a step makes)."""

    __slots__ = ("_recent", "_in_graphs")

    def __init__(self) -> None:
        self._recent: deque[SyncedCall] = deque(maxlen=CACHE_SIZE)
        self._in_graphs: list[tuple[weakref.ref, SyncedCall]] = []

    def remember(self, own: ReplicaStats, mean: torch.Tensor, invstd: torch.Tensor,
                 total: int, offset: torch.Tensor | None, node: Any) -> None:
        """Keep a synchronised call that may be recomputed (``may_be_recomputed``), among the
        last ones and for as long as ``node``, its output's ``grad_fn``, lives."""
        if not may_be_recomputed():
            return
        call = SyncedCall(ops_for(own.x), own.mean, own.m2, mean.detach(), invstd.detach(),
                          total, torch.is_grad_enabled(), offset)
        self._recent.append(call)
        try:
            anchor = weakref.ref(node)
        except TypeError:  # None (no graph), or a node that cannot be referenced weakly
            return
        self._in_graphs = [kept for kept in self._in_graphs if kept[0]() is not None]
        self._in_graphs.append((anchor, call))

    def _calls(self) -> list[SyncedCall]:
        """The calls remembered, the last ones first in the order they ran."""
        recent = {id(call) for call in self._recent}
        return [*self._recent, *(call for anchor, call in self._in_graphs
                                 if id(call) not in recent and anchor() is not None)]

    def replay(self, x: torch.Tensor, layer: str) -> Exchanged:
        """The ``exchange`` of a checkpoint's recomputation (``functional.synced_batch_norm_act``):
        the global statistics of the original call on ``x``, met with no other replica (no
        merge to link to); ``layer`` names the layer in errors.

        The call is found by its input's statistics, recomputed by the backend that computed
        them then (another backend's differ in the last bits: Triton's against ATen's). Two
        calls recorded by autograd whose inputs on this replica were equal but whose global
        statistics differ (a layer called on equal chunks, as a siamese network's two views
        may give a replica) cannot be told apart: refused, where the first would give wrong
        gradients. Only calls made without grad match: a reentrant checkpoint's, refused.
        """
        local: dict[Any, tuple[torch.Tensor, torch.Tensor]] = {}
        matches = []
        for call in self._calls():
            if call.ops not in local:
                with torch.no_grad():
                    local[call.ops] = local_channel_stats(x, call.ops)[:2]
            local_mean, local_m2 = local[call.ops]
            if torch.equal(call.local_mean, local_mean) and torch.equal(call.local_m2, local_m2):
                matches.append(call)
        recorded = [call for call in matches if call.grad_enabled]
        if matches and not recorded:
            raise RuntimeError(
                f"{layer} under torch.utils.checkpoint(use_reentrant=True): the reentrant "
                "mode rebuilds each replica's graph apart, so gradients cannot flow between "
                "replicas; use use_reentrant=False"
            )
        if not recorded:
            raise RuntimeError(
                f"{layer}: a recomputation (checkpoint) found no synchronised call with the "
                "same input statistics; the checkpointed function must be deterministic"
            )
        found = recorded[0]
        if not all(found.same_statistics(call) for call in recorded[1:]):
            raise RuntimeError(
                f"{layer}: a checkpoint's recomputation cannot tell which of this layer's "
                "calls it recomputes: two calls had equal inputs on this replica but "
                "different statistics over the whole batch (the layer called on equal "
                "chunks, as two views of the same images); call the layer outside the "
                "checkpoint there, or give each call a layer of its own"
            )
        return Exchanged(found.mean, found.invstd, found.total, None, found.offset)


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
