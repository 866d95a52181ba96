"""How the replicas of one ``nn.DataParallel`` call meet: threads, queues and bounded waits.

No torch here: payloads are opaque. Vocabulary:

- A *session* is one ``replicate()`` call: k replicas of the whole model, replica j run by
  thread j. It records each replica's thread and the first failure among them.
- A *group* is one layer inside a session: its k replicas, rank j = the replica on
  ``device_ids[j]``; rank 0 is the master. Every call of the layer is one exchange:

      rank r > 0:  Contribution(rank, call, payload) ──inbox──▶ master
      master:      gathers all k contributions, merges, and answers each rank
      master:      Reply(call, payload_r) ──outbox[r]──▶ rank r

Groups are new at every ``replicate()``, so no message of a failed step can reach a later
one. Every wait polls in short slices and gives up with ``SyncError`` when the deadline
(``ENCODING_SYNCBN_TIMEOUT`` seconds, read at each call, default 60) passes, when a peer has
failed, when a peer's thread has exited without delivering, or when a peer waits in another
layer for this replica (the replicas called the layers in different orders).
"""

from __future__ import annotations

import os
import queue
import threading
import time
from typing import Any, NamedTuple

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


class Contribution(NamedTuple):
    """What rank ``rank`` sends the master for call number ``call`` of a layer."""

    rank: int
    call: int
    payload: Any


class Reply(NamedTuple):
    """What the master sends one rank back for call number ``call`` of a layer."""

    call: int
    payload: Any


class _Waiting(NamedTuple):
    group: ReplicaGroup
    call: int


class ReplicaSession:
    """The replicas of one ``replicate()`` call, shared by all the layers they contain."""

    def __init__(self) -> None:
        self.closed = False
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


def replication_session() -> ReplicaSession:
    """The session the calling thread is replicating into: open until a replica runs."""
    session = getattr(_replicating, "session", None)
    if session is None or session.closed:
        session = ReplicaSession()
        _replicating.session = session
    return session


class ReplicaGroup:
    """One layer's replicas within a session; see the module docstring for the protocol."""

    def __init__(self, session: ReplicaSession, label: str) -> None:
        self.session = session
        self.label = label
        self.closed = False
        self._inbox: queue.Queue[Contribution] = queue.Queue()
        self._outboxes: list[queue.Queue[Reply]] = []
        self._calls_begun: list[int] = []

    @property
    def size(self) -> int:
        return len(self._outboxes)

    def add_member(self) -> int:
        """Append one replica (called by ``replicate()``, in rank order); returns its rank."""
        if self.closed:
            raise RuntimeError(f"{self.label}: cannot add a replica after the group has run")
        self._outboxes.append(queue.Queue())
        self._calls_begun.append(0)
        self.session.last_grown = self
        return self.size - 1

    def accepts_members(self) -> bool:
        """Whether this layer's next replica joins this group rather than a new one.

        Not once any replica of the session has run a sync layer (even one whose own layer
        never ran: an unused branch, or a failed step), nor when other layers were replicated
        after this one's members: that is a new ``replicate()`` call after a step in which no
        replica reached a sync layer. Then the stale session is closed too, so that the new
        call gets a new session.
        """
        if self.closed or self.session.closed:
            return False
        if self.size and self.session.last_grown is not self:
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

    def gather(self, call: int, own: Any) -> list[Any]:
        """Master: every rank's payload for ``call``, in rank order (its own first)."""
        payloads: list[Any] = [own] + [None] * (self.size - 1)
        missing = set(range(1, self.size))
        while missing:
            message = self._wait(self._inbox, 0, sorted(missing), call)
            if message.call != call:
                raise self._error(
                    f"rank {message.rank} is at call {message.call} while the master is at call "
                    f"{call}: the replicas called this layer a different number of times",
                    0,
                )
            payloads[message.rank] = message.payload
            missing.discard(message.rank)
        return payloads

    def scatter(self, call: int, payloads: list[Any]) -> None:
        """Master: answer every other rank's ``call`` with its own payload."""
        for rank in range(1, self.size):
            self._outboxes[rank].put(Reply(call, payloads[rank]))
        # Hand the GIL over now: the woken replicas can start their next ATen calls (which run
        # without the GIL) instead of waiting for the interpreter's 5 ms switch interval.
        time.sleep(0)

    def exchange(self, rank: int, call: int, payload: Any) -> Any:
        """Rank > 0: send the master this call's payload and wait for the answer."""
        self._inbox.put(Contribution(rank, call, payload))
        reply = self._wait(self._outboxes[rank], rank, [0], call)
        if reply.call != call:
            raise self._error(f"got the master's answer to call {reply.call}, not {call}", rank)
        return reply.payload

    def _wait(self, source: queue.Queue, rank: int, peers: list[int], call: int) -> Any:
        """Take the next message from ``source``, or raise ``SyncError`` (see module doc)."""
        deadline = time.monotonic() + timeout_seconds()
        session = self.session
        session._waiting[rank] = _Waiting(self, call)
        try:
            while True:
                remaining = deadline - time.monotonic()
                try:
                    return source.get(timeout=max(0.0, min(_POLL_SECONDS, remaining)))
                except queue.Empty:
                    pass
                if session.failure is not None:
                    raise self._error(f"{session.failure}; waiting for ranks {peers}", rank)
                if any(session.exited(peer) for peer in peers):
                    try:  # a peer may have delivered just before it exited
                        return source.get_nowait()
                    except queue.Empty:
                        gone = [peer for peer in peers if session.exited(peer)]
                        raise self._error(
                            f"ranks {gone} exited without reaching call {call} of this layer "
                            f"(they failed, or called it fewer times)",
                            rank,
                        ) from None
                disorder = self._check_order(rank, peers)
                if disorder is None and time.monotonic() < deadline:
                    continue
                try:  # what we wait for may have come while we looked at the peers
                    return source.get_nowait()
                except queue.Empty:
                    pass
                if disorder is not None:
                    raise self._error(disorder, rank)
                raise self._error(
                    f"ranks {peers} did not arrive within {timeout_seconds():g} s "
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
