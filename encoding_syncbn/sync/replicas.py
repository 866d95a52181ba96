"""How the replicas of one ``nn.DataParallel`` call find each other.

``torch.nn.parallel.replicate`` calls ``SyncBatchNorm._replicate_for_data_parallel`` once per
replica, in rank order, before any replica runs: the first call after a forward opens a new
``ReplicaGroup`` and each call adds a member (rank 0, the replica on ``device_ids[0]``, is the
master). A group's size is therefore the number of replicas of this call. The original layer
holds its open group weakly (``weakref.ref``), so that pickling and copying never meet it.

A DataParallel call nested in another (a wrapper inside a wrapper) replicates the outer
call's replicas: their group's master merges its replicas' statistics and takes part in the
outer call's group as the replica it was replicated from (``ReplicaSlot.parent``), so that
every replica normalises with the statistics of the whole outer batch.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Iterator
from typing import Any, NamedTuple

import torch

from .group import ReplicaGroup, ReplicaSession, replication_session


class ReplicaSlot(NamedTuple):
    """A replica's place in its DataParallel call: its group and its rank there (0: master),
    and, in a call nested in another, the place there of the replica it was made from."""

    group: ReplicaGroup
    rank: int
    parent: ReplicaSlot | None = None

    @property
    def synced(self) -> bool:
        """Whether other replicas share this one's statistics (a nested call's group may be
        of one: DataParallel replicates a batch smaller than its devices onto fewer)."""
        return self.parent is not None or self.group.size > 1


def group_taking_members(open_group: weakref.ref[ReplicaGroup] | None) -> ReplicaGroup | None:
    """The group of the ``replicate()`` call under way: ``open_group`` while it still takes
    members (no replica has run yet), else None."""
    group = open_group() if open_group is not None else None
    return group if group is not None and group.accepts_members() else None


def new_group(label: str, parent: ReplicaSlot | None) -> ReplicaGroup:
    """A group for a new ``replicate()`` call, its errors naming the layer by ``label``.

    ``parent``: the slot of the layer being replicated, where it is itself a replica (the
    call is nested in another). That replica is running now: its group takes no more
    members, and the calling thread (the outer call's, which runs the nested one) is the
    one whose exit its peers watch for.
    """
    if parent is not None:
        parent.group.close()
        parent.group.session.register(parent.rank)
    return ReplicaGroup(replication_session(_end_at_next_step), label)


@contextlib.contextmanager
def reading_parameters(group: ReplicaGroup) -> Iterator[None]:
    """While ``replicate()`` runs, read a layer's parameters without ending ``group``'s session:
    a parametrized weight (``torch.nn.utils.parametrize``) is computed by a module call, which
    would otherwise count as the next step's (see ``_end_at_next_step``) and give the layer's
    next replica a group of its own, unsynchronised."""
    session = group.session
    session.reading_parameters += 1
    try:
        yield
    finally:
        session.reading_parameters -= 1


def _end_at_next_step(session: ReplicaSession) -> None:
    """Close ``session`` at the next module call of the thread that replicated (the next
    step's ``DataParallel.forward``), so that a group belongs to one ``replicate()`` call even
    when no replica reached a sync layer and something (a notebook's ``sys.last_value``) keeps
    that step's replicas alive. Until then a global forward pre-hook looks at each module call;
    it removes itself once the session is closed (usually by the first sync layer's forward)."""

    def end(module: torch.nn.Module, args: Any) -> None:
        if session.closed or (threading.get_ident() == session.owner
                              and not session.reading_parameters):
            session.closed = True
            with removing:  # replica threads may get here at once: remove() checks, then deletes
                handle.remove()

    removing = threading.Lock()
    handle = torch.nn.modules.module.register_module_forward_pre_hook(end)
