"""The sessions an aggregator holds, by id, and how long it holds them.

A session lives from OpenSession until the coordinator closes it, or until ``result_ttl_s`` after
it finished when the coordinator never does (it crashed, or lost interest): an aggregator keeps
nothing between sessions, and nothing forever.
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

    def __len__(self) -> int:
        return len(self._sessions)

    def add(self, session: Session) -> None:
        if session.session_id in self._sessions:
            raise Rejected("ALREADY_EXISTS", f"session {session.session_id!r} already exists",
                           "duplicate_session")
        self._sessions[session.session_id] = session

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
