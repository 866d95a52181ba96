"""What a test reads instead of the clock to tell whether a replica waited on its peers: every
wait (``ReplicaGroup._wait``) of the test, as it ended (the ``replica_waits`` fixture of
conftest.py)."""

from __future__ import annotations

from typing import NamedTuple

from encoding_syncbn.sync import group as sync


class Wait(NamedTuple):
    """One wait of a replica on its peers: its group, rank and call, and how it ended (None:
    its gate opened; else the message of the ``SyncError`` or other error it raised)."""

    group: sync.ReplicaGroup
    rank: int
    call: int
    error: str | None


def record_waits(monkeypatch) -> list[Wait]:
    """From now until the test ends, append each replica's wait to the returned list as it
    ends."""
    waits: list[Wait] = []
    wait = sync.ReplicaGroup._wait

    def recorded(self, rank, call, peers):
        try:
            wait(self, rank, call, peers)
        except BaseException as error:
            waits.append(Wait(self, rank, call, str(error)))
            raise
        waits.append(Wait(self, rank, call, None))

    monkeypatch.setattr(sync.ReplicaGroup, "_wait", recorded)
    return waits


def gave_up_at_the_deadline(waits: list[Wait]) -> list[Wait]:
    """The waits that ended because the timeout passed (not because a peer failed)."""
    return [w for w in waits if w.error is not None and "did not arrive within" in w.error]


def ended_by_an_error(waits: list[Wait]) -> list[Wait]:
    return [w for w in waits if w.error is not None]


def assert_waited_only_on_this_step(waits: list[Wait], earlier_groups: list[sync.ReplicaGroup],
                                    replicas: int) -> None:
    """A step's waits each ended with its gate open, in a group of this step's ``replicas``
    replicas, none of ``earlier_groups`` (an earlier step's, whose replicas may be dead)."""
    assert waits, "no replica waited: the step was not synchronised"
    assert ended_by_an_error(waits) == []
    for w in waits:
        assert w.group.size == replicas, w
        assert all(w.group is not group for group in earlier_groups), w
