"""How the replicas of one ``nn.DataParallel`` call meet: threads, locks and bounded waits.

No torch here: payloads are opaque. Vocabulary:

- A *session* is one ``replicate()`` call: k replicas of the whole model, replica j run by
  thread j. It records each replica's thread and the first failure among them.
- A *group* is one layer inside a session: its k replicas, rank j = the replica on
  ``device_ids[j]``; rank 0 is the master. Every call of the layer is one *meeting*:

      rank r > 0:  leaves its payload in the meeting; the last to arrive opens gate[0]
      master:      waits at gate[0], takes every payload, merges, and for each rank r
                   leaves Reply(call, payload_r) and opens gate[r]
      rank r > 0:  waits at gate[r], takes its reply

A gate is a lock the master or the last arrival releases once per call and its owner
acquires once per call, so a call wakes each waiting thread once: the master once however
many replicas arrive (a queue would wake it per message), each other rank once for its
reply. No rank can reach call c + 1 before every rank has reached call c, so one meeting at
a time is open.

Groups are new at every ``replicate()``, so nothing of a failed step can reach a later one.
Every wait polls in short slices and gives up with ``SyncError`` when the deadline
(``ENCODING_SYNCBN_TIMEOUT`` seconds, read at each call, default 60) passes, when a peer has
failed, when a peer's thread has exited without arriving, or when a peer waits in another
layer for this replica (the replicas called the layers in different orders). A rank that
gives up before the master has taken its payload takes it back: a master arriving after that
raises ``SyncError`` too, rather than merging without it.
"""

from __future__ import annotations

import os
import threading
import time
import weakref
from typing import Any, Callable, NamedTuple

TIMEOUT_ENV = "ENCODING_SYNCBN_TIMEOUT"
DEFAULT_TIMEOUT_SECONDS = 60.0
# How often a blocked replica looks at its peers; the latency of failure detection.
_POLL_SECONDS = 0.02


class SyncError(RuntimeError):
    """Raised by a replica whose peers failed, vanished or did not arrive in time."""


def timeout_seconds() -> float:
    """The bound on every wait, from ``ENCODING_SYNCBN_TIMEOUT`` (read at call time)."""
    raw = os.environ.get(TIMEOUT_ENV)
    if raw is None or raw == "":
        return DEFAULT_TIMEOUT_SECONDS
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{TIMEOUT_ENV} must be a number of seconds, got {raw!r}") from None
    if not value > 0:
        raise ValueError(f"{TIMEOUT_ENV} must be positive, got {raw!r}")
    return value


class Reply(NamedTuple):
    """What the master leaves rank r for call number ``call`` of a layer."""

    call: int
    payload: Any


class _Meeting:
    """The payloads of one call of a layer, filled in as the ranks arrive."""

    __slots__ = ("call", "payloads", "missing", "withdrawn")

    def __init__(self, call: int, size: int) -> None:
        self.call = call
        self.payloads: list[Any] = [None] * size
        self.missing = set(range(1, size))
        # Ranks that gave up before the master took the payloads (their wait failed).
        self.withdrawn: set[int] = set()


class _Waiting(NamedTuple):
    group: ReplicaGroup
    call: int


class ReplicaSession:
    """The replicas of one ``replicate()`` call, shared by all the layers they contain."""

    def __init__(self) -> None:
        self.closed = False
        # The thread that replicates: its next module call after replicate() (the next step's
        # DataParallel.forward) ends the session, whatever keeps its replicas alive.
        self.owner = threading.get_ident()
        # Above 0 while a layer reads its own parameters during replicate(): a parametrized
        # weight is computed by a module call, which is not the next step's.
        self.reading_parameters = 0
        self._lock = threading.Lock()
        self._threads: dict[int, threading.Thread] = {}
        self._waiting: dict[int, _Waiting] = {}
        self.failure: str | None = None
        # The group that received the last replica: replicate() makes a module's replicas in
        # a row, so another layer coming back to a group it had left means a new replicate().
        self.last_grown: ReplicaGroup | None = None

    def register(self, rank: int) -> None:
        """Remember the calling thread as replica ``rank``'s, to notice when it dies."""
        self._threads.setdefault(rank, threading.current_thread())

    def fail(self, rank: int, error: BaseException) -> None:
        """Record the first failure; every replica still waiting raises at its next poll."""
        with self._lock:
            if self.failure is None:
                self.failure = f"replica {rank} raised {type(error).__name__}: {error}"

    def exited(self, rank: int) -> bool:
        thread = self._threads.get(rank)
        return thread is not None and not thread.is_alive()


_replicating = threading.local()


def replication_session(on_new: Callable[[ReplicaSession], None] | None = None
                        ) -> ReplicaSession:
    """The session the calling thread is replicating into: open until a replica runs (or the
    caller's ``on_new(session)``, called once for a new session, arranges to close it)."""
    session = getattr(_replicating, "session", None)
    if session is None or session.closed:
        session = ReplicaSession()
        _replicating.session = session
        if on_new is not None:
            on_new(session)
    return session


class ReplicaGroup:
    """One layer's replicas within a session; see the module docstring for the protocol."""

    def __init__(self, session: ReplicaSession, label: str) -> None:
        self.session = session
        self.label = label
        self.closed = False
        self._lock = threading.Lock()
        self._meeting: _Meeting | None = None
        self._members: list[weakref.ref] = []
        self._gates: list[threading.Lock] = []
        self._replies: list[Reply | None] = []
        self._calls_begun: list[int] = []
        # Unsynchronised layers: each rank's calls whose input passed the layer's checks, and
        # the condition the master waits on for them (``wait_for_checks``).
        self._checked: list[int] = []
        self._checks_reported = threading.Condition(self._lock)

    @property
    def size(self) -> int:
        return len(self._gates)

    def add_member(self, member: Any) -> int:
        """Append the replica ``member`` (called by ``replicate()``, in rank order); returns its
        rank. Only a weak reference is kept: see ``accepts_members``."""
        if self.closed:
            raise RuntimeError(f"{self.label}: cannot add a replica after the group has run")
        self._members.append(weakref.ref(member))
        gate = threading.Lock()
        gate.acquire()  # closed until the master (or, for the master, the last arrival) opens it
        self._gates.append(gate)
        self._replies.append(None)
        self._calls_begun.append(0)
        self._checked.append(0)
        self.session.last_grown = self
        return self.size - 1

    def accepts_members(self) -> bool:
        """Whether this layer's next replica joins this group rather than a new one.

        Not once any replica of the session has run a sync layer (even one whose own layer
        never ran: an unused branch, or a failed step). Nor when a step in which no replica
        reached a sync layer came before: ``replicate()`` holds every replica it makes until it
        returns, so a member that has been freed belongs to an earlier call; and other layers
        replicated after this one's members mean a new call too (that catches replicas still
        held, by an exception's traceback say, in a model with several sync layers). Then the
        stale session is closed too, so that the new call gets a new session.
        """
        if self.closed or self.session.closed:
            return False
        stale = any(member() is None for member in self._members)
        if stale or (self.size and self.session.last_grown is not self):
            self.session.closed = True
            return False
        return True

    def close(self) -> None:
        """Freeze the membership: called at the first forward of any replica."""
        self.closed = True
        self.session.closed = True

    def begin_call(self, rank: int) -> int:
        """Number this rank's next call of the layer (0, 1, ...); calls pair up by number."""
        self.session.register(rank)
        call = self._calls_begun[rank]
        self._calls_begun[rank] = call + 1
        return call

    def fail(self, rank: int, error: BaseException) -> None:
        self.session.fail(rank, error)

    def _arrive(self, rank: int, call: int, payload: Any) -> _Meeting:
        """Leave ``payload`` in the meeting of ``call``; the last peer to arrive opens gate[0]."""
        with self._lock:
            meeting = self._meeting
            if meeting is None:
                meeting = self._meeting = _Meeting(call, self.size)
            elif meeting.call != call:
                raise self._error(
                    f"arrived for call {call} while call {meeting.call} is open: the replicas "
                    f"called this layer a different number of times",
                    rank,
                )
            meeting.payloads[rank] = payload
            meeting.missing.discard(rank)
            # The master's own arrival opens its gate only in a group of one.
            everyone_in = not meeting.missing and (rank > 0 or self.size == 1)
        if everyone_in:
            self._gates[0].release()
        return meeting

    def gather(self, call: int, own: Any) -> list[Any]:
        """Master: every rank's payload for ``call``, in rank order (its own first)."""
        meeting = self._arrive(0, call, own)
        try:
            self._wait(0, call, lambda: self._still_missing(meeting))
        finally:  # a failed call keeps no payload (they hold the replicas' graphs) either
            with self._lock:
                self._meeting = None
                withdrawn = sorted(meeting.withdrawn)
        if withdrawn:
            # The master came late: those ranks arrived (opening its gate), then their wait
            # for its answer ended (the timeout, or a failure) and took their payloads back.
            raise self._error(
                f"reached call {call} of this layer after ranks {withdrawn} had stopped waiting "
                f"for it: {self.session.failure}",
                0,
            )
        return meeting.payloads

    def _still_missing(self, meeting: _Meeting) -> list[int]:
        with self._lock:
            return sorted(meeting.missing)

    def scatter(self, call: int, payloads: list[Any]) -> None:
        """Master: answer every other rank's ``call`` with its own payload."""
        for rank in range(1, self.size):
            self._replies[rank] = Reply(call, payloads[rank])
            self._gates[rank].release()

    def exchange(self, rank: int, call: int, payload: Any) -> Any:
        """Rank > 0: leave the master this call's payload and wait for the answer."""
        meeting = self._arrive(rank, call, payload)
        try:
            self._wait(rank, call, lambda: [0])
        except BaseException:
            with self._lock:
                if self._meeting is meeting:  # not taken by the master: it never will be
                    meeting.payloads[rank] = None
                    meeting.withdrawn.add(rank)
            raise
        reply, self._replies[rank] = self._replies[rank], None
        if reply is None or reply.call != call:
            raise self._error(f"expected the master's answer to call {call}, got {reply}", rank)
        return reply.payload

    def checks_passed(self, rank: int) -> None:
        """Rank > 0 of an unsynchronised layer: its input for its latest call passed the
        layer's checks. Never waits."""
        with self._checks_reported:
            self._checked[rank] += 1
            self._checks_reported.notify_all()

    def wait_for_checks(self, call: int) -> None:
        """Master of an unsynchronised layer: wait until every other rank's input for ``call``
        passed the layer's checks (``checks_passed``), or raise ``SyncError`` as ``_wait``
        does: a peer failed (its input was refused), exited, waits in another layer, or did
        not come in time."""
        session = self.session
        deadline = time.monotonic() + timeout_seconds()
        session._waiting[0] = _Waiting(self, call)
        try:
            with self._checks_reported:
                while True:
                    behind = [r for r in range(1, self.size) if self._checked[r] <= call]
                    if not behind:
                        return
                    if session.failure is not None:
                        raise self._error(f"{session.failure}; waiting for ranks {behind}", 0)
                    gone = [peer for peer in behind if session.exited(peer)]
                    if gone:
                        raise self._error(
                            f"ranks {gone} exited without reaching call {call} of this layer "
                            f"(they failed, or called it fewer times)", 0)
                    disorder = self._check_order(0, behind)
                    if disorder is not None:
                        raise self._error(disorder, 0)
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        raise self._error(
                            f"ranks {behind} did not arrive within {timeout_seconds():g} s "
                            f"(set {TIMEOUT_ENV} to change the bound)", 0)
                    self._checks_reported.wait(min(_POLL_SECONDS, remaining))
        finally:
            del session._waiting[0]

    def _wait(self, rank: int, call: int, peers: Callable[[], list[int]]) -> None:
        """Pass ``rank``'s gate for ``call``, or raise ``SyncError`` (see the module doc).

        ``peers()``: the ranks the gate still waits for.
        """
        gate = self._gates[rank]
        deadline = time.monotonic() + timeout_seconds()
        session = self.session
        session._waiting[rank] = _Waiting(self, call)
        try:
            while True:
                remaining = deadline - time.monotonic()
                if gate.acquire(timeout=max(0.0, min(_POLL_SECONDS, remaining))):
                    return
                if session.failure is not None:
                    raise self._error(f"{session.failure}; waiting for ranks {peers()}", rank)
                waited_for = peers()
                gone = [peer for peer in waited_for if session.exited(peer)]
                disorder = None if gone else self._check_order(rank, waited_for)
                if not gone and disorder is None and time.monotonic() < deadline:
                    continue
                if gate.acquire(blocking=False):  # opened while we looked at the peers
                    return
                if gone:
                    raise self._error(
                        f"ranks {gone} exited without reaching call {call} of this layer "
                        f"(they failed, or called it fewer times)",
                        rank,
                    )
                if disorder is not None:
                    raise self._error(disorder, rank)
                raise self._error(
                    f"ranks {waited_for} did not arrive within {timeout_seconds():g} s "
                    f"(set {TIMEOUT_ENV} to change the bound)",
                    rank,
                )
        finally:
            del session._waiting[rank]

    def _check_order(self, rank: int, peers: list[int]) -> str | None:
        """Why we wait in vain, if a peer we wait for is blocked in another layer on us.

        Such a peer needs this replica to reach that other layer first: the replicas run the
        layers in different orders and would wait on each other until the timeout. (Unless
        what we wait for came in meanwhile and the peer moved on: the caller looks again.)
        """
        for peer in peers:
            waiting = self.session._waiting.get(peer)
            if waiting is None or waiting.group is self:
                continue
            other = waiting.group
            if rank < other.size and other._calls_begun[rank] <= waiting.call:
                return (
                    f"rank {peer} waits in {other.label} (call {waiting.call}) for rank {rank}, "
                    f"which waits here for it: the replicas call the sync layers in different "
                    f"orders"
                )
        return None

    def _error(self, reason: str, rank: int) -> SyncError:
        error = SyncError(f"{self.label}, rank {rank}: {reason}")
        self.session.fail(rank, error)
        return error
