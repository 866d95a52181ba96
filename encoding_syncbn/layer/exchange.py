"""One synchronised call's exchange of statistics between the replicas of a DataParallel call.

Every replica sends its ``(mean, M2, count)`` to the master (rank 0), which merges them (and,
under ``torch.distributed``, those of every process) and answers each replica with the global
``(mean, invstd)`` on its device. In a DataParallel call nested in another, the master of
each nested call merges its replicas' statistics and sends them on, as one ``SubBatch``, to
the outer call's master in its replica's place. The tensors handed over keep their autograd
history: backward needs no exchange. ``sync.ReplicaGroup`` carries the payloads; this module
says what they are and makes them safe to read on another thread's streams.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from ..kernels import RunningStats
from ..sync import distributed, stats
from ..sync.replicas import ReplicaSlot
from ..sync.streams import stream_event, wait_for
from .functional import (
    Exchanged,
    ReplicaStats,
    _Link,
    far_from_zero,
    merge_parts,
    merge_replicas,
    on_device,
    replica_stats,
    track_batch,
)
from .whole_batch import WholeBatch


class Exchange:
    """``exchange`` for ``functional.synced_batch_norm_act``: ``(x) -> Exchanged``, the global
    statistics on the replica's device and the global count.

    The master folds the global ``(mean, M2, count)`` into ``running`` (the layer's running
    statistics; None: not tracked) before it answers: once the replicas run again, every ATen
    call of the master waits for the GIL in turn with theirs, so an update after the answers
    would hold up the synchronised forward.
    What the layer needs afterwards is left on the object: ``own`` / ``mean`` / ``invstd`` /
    ``total`` (for the recompute cache).
    """

    __slots__ = ("slot", "eps", "process_group", "across_processes", "running", "label",
                 "own", "mean", "invstd", "total", "offset")

    def __init__(self, slot: ReplicaSlot | None, eps: float, process_group: Any,
                 across_processes: bool, running: RunningStats | None, label: str) -> None:
        self.slot = slot
        self.label = label  # how errors name the layer
        self.eps = eps
        self.process_group = process_group
        self.across_processes = across_processes
        self.running = running

    def __call__(self, x: torch.Tensor) -> Exchanged:
        """Send the statistics of ``x`` (``replica_stats``) to the master, get the global
        ``(mean, invstd, count)`` back."""
        own = replica_stats(x)
        mean, invstd, total, offset = self._share(self.slot, own)
        self.own, self.mean, self.invstd, self.total = own, mean, invstd, total
        self.offset = offset
        return Exchanged(mean, invstd, total, own.link, offset)

    def _share(self, slot: ReplicaSlot | None, contribution: ReplicaStats | SubBatch
               ) -> tuple[torch.Tensor, torch.Tensor, int, torch.Tensor | None]:
        """The global ``(mean, invstd, count, offset)`` (``offset``: the mean's error in units
        of xhat, ``functional._mean_offset``; None: not known), ``contribution`` (this
        replica's statistics, or those of the replicas of a call nested in this one) met with
        the others of ``slot``'s group."""
        if slot is None or not slot.synced:
            mean, m2, invstd, total, offset = self._merge([contribution])
            track_batch(self.running, mean, m2, total)
            return mean, invstd, total, offset
        group, rank = slot.group, slot.rank
        call = group.begin_call(rank)
        handed = _handed(contribution, contribution.mean)
        if rank > 0:
            return _received(group.exchange(rank, call, handed))
        contributions = [_received(c) for c in group.gather(call, handed)]
        if slot.parent is None:
            mean, m2, invstd, total, offset = self._merge(contributions)
            track_batch(self.running, mean, m2, total)
        else:  # a nested call: its replicas' statistics go on as its replica's in the outer one
            try:
                mean, m2, _, total, error = _merged(contributions, self.eps)
                mean, invstd, total, offset = self._share(
                    slot.parent, SubBatch(mean, m2, total, _links(contributions), error))
            except BaseException as error:  # the outer call's replicas stop waiting for it
                slot.parent.group.fail(slot.parent.rank, error)
                raise
        answers = []
        for c in contributions:
            answer = (on_device(mean, c.mean.device), on_device(invstd, c.mean.device), total,
                      None if offset is None else on_device(offset, c.mean.device))
            answers.append(_handed(answer, answer[0]))
        group.scatter(call, answers)
        return mean, invstd, total, offset

    def _merge(self, contributions: list[ReplicaStats | SubBatch]):
        """Master: merge every replica's (and process's) statistics.

        Returns the global ``(mean, M2, invstd, count, offset)`` (``_share``).
        """
        mean, m2, invstd, total, error = _merged(contributions, self.eps)
        batch = WholeBatch.of(_links(contributions), total, self.eps, mean.device,
                              self.across_processes)
        if self.across_processes:
            mean, m2, invstd, total, error = distributed.merge_across_processes(
                mean, m2, total, self.eps, self.process_group, batch, error
            )
        if total == 1:
            raise ValueError(
                f"{self.label}: expected more than 1 value per channel when training, got 1 "
                "over the whole synchronised batch"
            )
        # The mean's error in units of xhat, as ``functional._mean_offset`` takes it (float32:
        # only far from 0, as there): no function of x autograd should see (nor a checkpoint
        # count among its saved tensors).
        offset = None
        if error is not None and (mean.dtype == torch.float64
                                  or far_from_zero(mean.detach(), invstd.detach())):
            offset = error * invstd.detach()
        return mean, m2, invstd, total, offset


class SubBatch(NamedTuple):
    """The statistics of a nested call's replicas, merged by its master: what it brings to
    the outer call's merge in its replica's place (differentiable: their graph leads to the
    replicas' inputs), its replicas' links (for ``WholeBatch``) and its mean's error (the
    exact mean less it, not differentiable; None: not known, ``functional.merge_replicas``)."""

    mean: torch.Tensor
    m2: torch.Tensor
    count: int
    links: tuple[_Link, ...] = ()
    error: torch.Tensor | None = None


def _links(contributions: list[ReplicaStats | SubBatch]) -> tuple[_Link, ...]:
    """The links of every replica behind ``contributions``, nested calls' included."""
    return tuple(link for c in contributions
                 for link in ((c.link,) if isinstance(c, ReplicaStats) else c.links))


def _merged(contributions: list[ReplicaStats | SubBatch], eps: float
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, torch.Tensor | None]:
    """``(mean, M2, invstd, count, error)`` of the contributions, on the first one's device
    (``error``: the merged mean's, where every contribution brings its own, as float64
    statistics do: ``functional.merge_replicas``, ``SubBatch.error``; else None).

    The replicas' by ``merge_replicas`` (whose backward writes their input gradients); nested
    calls' merged statistics, if any, then join them in ``merge_parts``, under saved-tensor
    hooks of their own: a checkpoint around the master's call must not take those tensors for
    its region's, as its recomputation replays the layer without a merge.
    """
    replicas = [c for c in contributions if isinstance(c, ReplicaStats)]
    parts = [c for c in contributions if isinstance(c, SubBatch)]
    total = sum(c.count for c in contributions)
    if replicas:
        mean, m2, invstd, error = merge_replicas(replicas, eps)
        if not parts:
            return mean, m2, invstd, total, error
        parts.append(SubBatch(mean, m2, sum(c.count for c in replicas),
                              tuple(r.link for r in replicas), error))
    device, dtype, wide = contributions[0].mean.device, contributions[0].mean.dtype, torch.float64
    errors = (None if any(p.error is None for p in parts)
              else [on_device(p.error, device).to(wide) for p in parts])
    with torch.autograd.graph.saved_tensors_hooks(_kept, _kept):
        mean, m2, invstd, error = merge_parts(
            [on_device(p.mean, device).to(wide) for p in parts],
            [on_device(p.m2, device).to(wide) for p in parts],
            [p.count for p in parts], [p.links for p in parts], eps, errors)
        rounded = mean.to(dtype)
        return (rounded, m2.to(dtype), invstd.to(dtype), total,
                stats.rounded_error(mean, error, rounded))


def _kept(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


class _OnStream(NamedTuple):
    """A payload handed to another replica's thread, with the CUDA event after which it is
    ready: DataParallel runs each replica on its device's current stream, and another
    thread's ops on that device go to its own current stream."""

    payload: Any
    ready: torch.cuda.Event


def _handed(payload: Any, like: torch.Tensor) -> Any:
    """``payload`` as handed to another thread: on CUDA, with an event recorded on the current
    stream of ``like``'s device after everything that wrote it (on the CPU, as it is)."""
    ready = stream_event(like)
    return payload if ready is None else _OnStream(payload, ready)


def _received(handed: Any) -> Any:
    """The payload of ``_handed``, safe to read on this thread's current streams: they wait
    for its event, and the allocator learns that its tensors are used there (so that their
    memory is not reused before those streams are done with them)."""
    if not isinstance(handed, _OnStream):
        return handed
    wait_for(handed.ready, _tensors_of(handed.payload))
    return handed.payload


def _tensors_of(payload: Any) -> list[torch.Tensor]:
    if isinstance(payload, ReplicaStats):
        return [payload.mean, payload.m2]
    return [t for t in payload if isinstance(t, torch.Tensor)]
