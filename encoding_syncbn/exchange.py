"""One synchronised call's exchange of statistics between the replicas of a DataParallel call.

Every replica sends its ``(mean, M2, count)`` to the master (rank 0), which merges them (and,
under ``torch.distributed``, those of every process) and answers each replica with the global
``(mean, invstd)`` on its device. The tensors handed over keep their autograd history: backward
needs no exchange. ``sync.ReplicaGroup`` carries the payloads; this module says what they are
and makes them safe to read on another thread's streams.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from . import distributed
from .functional import ReplicaStats, merge_replicas, on_device
from .replicas import ReplicaSlot
from .streams import stream_event, wait_for


class Exchange:
    """``exchange`` for ``functional.synced_batch_norm_act``: ``(ReplicaStats) -> (mean,
    invstd)``, the global statistics on the replica's device.

    The master hands the global ``(mean, M2, count)`` to ``track`` (the layer's running
    statistics) before it answers: once the replicas run again, every ATen call of the master
    waits for the GIL in turn with theirs (measured on 2 cores, 4 simulated replicas: the
    synchronised forward is slower when the update comes after the answers). What the layer
    needs afterwards is left on the object: ``own`` / ``mean`` / ``invstd`` (for the recompute
    cache).
    """

    __slots__ = ("slot", "eps", "process_group", "across_processes", "track", "label", "own",
                 "mean", "invstd")

    def __init__(self, slot: ReplicaSlot | None, eps: float, process_group: Any,
                 across_processes: bool,
                 track: Callable[[torch.Tensor, torch.Tensor, int], None], label: str) -> None:
        self.slot = slot
        self.label = label  # how errors name the layer
        self.eps = eps
        self.process_group = process_group
        self.across_processes = across_processes
        self.track = track

    def __call__(self, own: ReplicaStats) -> tuple[torch.Tensor, torch.Tensor]:
        """Send local statistics to the master, get the global ``(mean, invstd)`` back."""
        slot = self.slot
        if slot is None or slot.group.size == 1:
            mean, m2, invstd, total = self._merge([own])
            self.track(mean, m2, total)
        elif slot.rank == 0:
            group = slot.group
            call = group.begin_call(0)
            contributions = [_received(c) for c in group.gather(call, _handed(own, own.mean))]
            mean, m2, invstd, total = self._merge(contributions)
            self.track(mean, m2, total)
            answers = []
            for c in contributions:
                answer = (on_device(mean, c.mean.device), on_device(invstd, c.mean.device))
                answers.append(_handed(answer, answer[0]))
            group.scatter(call, answers)
        else:
            group = slot.group
            mean, invstd = _received(
                group.exchange(slot.rank, group.begin_call(slot.rank), _handed(own, own.mean))
            )
        self.own, self.mean, self.invstd = own, mean, invstd
        return mean, invstd

    def _merge(self, contributions: list[ReplicaStats]):
        """Master: merge every replica's (and process's) statistics.

        Returns the global ``(mean, M2, invstd, count)``.
        """
        mean, m2, invstd = merge_replicas(contributions, self.eps)
        total = sum(c.count for c in contributions)
        if self.across_processes:
            mean, m2, invstd, total = distributed.merge_across_processes(
                mean, m2, total, self.eps, self.process_group
            )
        if total == 1:
            raise ValueError(
                f"{self.label}: expected more than 1 value per channel when training, got 1 "
                "over the whole synchronised batch"
            )
        return mean, m2, invstd, total


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
