"""The sessions an aggregator holds, by id, and how long it holds them.

A session lives from OpenSession until the coordinator closes it, or until ``result_ttl_s`` after
it finished when the coordinator never does (it crashed, or lost interest): an aggregator keeps
nothing between sessions, and nothing forever.

Nothing but the newest coordinator leader epoch it has seen (``fence``): coordinator replicas over
PostgreSQL sign each session ticket with the epoch of the leader that opened it, and a new leader
says its epoch to every aggregator (``AggregatorControl.Fence``) before it runs any round. From
then on a ticket of an older epoch is refused and the sessions opened under one are closed: a
leader that lost the lead without noticing (paused past its lease) runs no session beside its
successor's. A restarted aggregator knows no epoch until the leader's next Fence (its pool sends
one whenever an aggregator comes back up) or its next ticket.
"""

from __future__ import annotations

import asyncio

from tally.aggregator.errors import Rejected
from tally.aggregator.session import Session


class HeldSessions:
    def __init__(self, result_ttl_s: float) -> None:
        if not result_ttl_s > 0:
            raise ValueError(f"result_ttl_s must be > 0, got {result_ttl_s}")
        self._ttl = result_ttl_s
        self._sessions: dict[str, Session] = {}
        self._expiry: dict[str, asyncio.TimerHandle] = {}
        self.leader_epoch = 0  # the newest coordinator leader epoch seen (0: none, or one coordinator)

    def __len__(self) -> int:
        return len(self._sessions)

    def add(self, session: Session) -> None:
        epoch = session.plan.leader_epoch
        if epoch < self.leader_epoch:
            raise Rejected("FAILED_PRECONDITION",
                           f"session ticket of coordinator leader epoch {epoch}: a newer leader (epoch "
                           f"{self.leader_epoch}) has taken over, so the old one may open no session",
                           "stale_leader")
        if session.session_id in self._sessions:
            raise Rejected("ALREADY_EXISTS", f"session {session.session_id!r} already exists",
                           "duplicate_session")
        self.fence(epoch)
        self._sessions[session.session_id] = session

    def fence(self, epoch: int) -> list[str]:
        """A coordinator leader of ``epoch`` exists: close the sessions of older epochs (aborted
        for their devices) and refuse their tickets from now on. The ids of those closed."""
        if epoch <= self.leader_epoch:
            return []
        self.leader_epoch = epoch
        stale = [sid for sid, session in self._sessions.items() if session.plan.leader_epoch < epoch]
        for session_id in stale:
            self.close(session_id, f"a newer coordinator leader (epoch {epoch}) took over")
        return stale

    def find(self, session_id: str) -> Session | None:
        return self._sessions.get(session_id)

    def get(self, session_id: str) -> Session:
        session = self.find(session_id)
        if session is None:
            raise Rejected("NOT_FOUND", f"no session {session_id!r} on this aggregator",
                           "unknown_session")
        return session

    def finished(self, session: Session) -> None:
        """Start the clock on a finished session's results (a closed one is already gone)."""
        if self._sessions.get(session.session_id) is not session:
            return
        loop = asyncio.get_running_loop()
        self._expiry[session.session_id] = loop.call_later(
            self._ttl, self._expire, session.session_id, session
        )

    def close(self, session_id: str, reason: str) -> None:
        """Drop the session and everything about it; a running session is aborted. Closing an
        unknown (or already expired) session is a no-op, so the coordinator may retry it."""
        session = self._sessions.pop(session_id, None)
        handle = self._expiry.pop(session_id, None)
        if handle is not None:
            handle.cancel()
        if session is not None:
            session.close(reason)

    def close_all(self, reason: str) -> None:
        for session_id in list(self._sessions):
            self.close(session_id, reason)

    def _expire(self, session_id: str, session: Session) -> None:
        if self._sessions.get(session_id) is session:
            del self._sessions[session_id]
            self._expiry.pop(session_id, None)
