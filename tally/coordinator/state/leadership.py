"""Which of several coordinator replicas over one PostgreSQL store plans rounds.

One leader, not a store-level protocol between equals: selection, seating, the sessions and the
commit of a round are a sequence of decisions that each read what the previous one wrote, and
keeping that in one process is what makes a round's state need no agreement between processes
(the same reason a host's device fronts forward to one coordinator process). The other replicas
serve devices as fronts (``tally.coordinator.faces.device_front``): registrations and idle check-ins
themselves, everything else forwarded to the leader's address, which they read from the store.

The leader is whoever holds a session-level advisory lock (``pg_try_advisory_lock``), not a
lease row: the server releases it the moment the holder's connection ends (a killed pod, a
crashed process), with no expiry or clock to tune, and a replica that finds it free takes over
at once. A leader that lost its connection without noticing (a partition) is fenced: each new
leader increments the ``leader`` row's epoch, and every durable write of a store opened under
an older epoch fails (``tally.coordinator.state.store.LeadershipLost``), so it cannot commit a round
its successor is running. It finds out at its next check (``holds``) and stops.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable

from tally.coordinator.state.database import Database, PostgresDatabase
from tally.coordinator.state.store import create_schema

# The advisory lock's key: any constant unlikely to collide with an operator's own locks.
LEADER_LOCK_KEY = 0x7A11_1EAD


class Leadership:
    """A replica's claim: one PostgreSQL session, kept open while it leads."""

    def __init__(self, database_url: str, clock: Callable[[], float] = time.time) -> None:
        self._db = PostgresDatabase(database_url)
        self.errors = self._db.errors  # what a lost or refused connection raises
        self.clock = clock
        create_schema(self._db)
        self.epoch: int | None = None

    def try_lead(self) -> int | None:
        """Take the lead if no replica holds it: the new epoch; None while another replica leads.
        Followers keep forwarding to the old address until ``announce``: to a leader that is
        gone, so their devices are told to retry, not misled."""
        if self.epoch is not None:
            return self.epoch
        with self._db.lock:
            (taken,) = self._db.execute("SELECT pg_try_advisory_lock(?)", (LEADER_LOCK_KEY,)).fetchone()
        if not taken:
            return None
        with self._db.transaction():
            (epoch,) = self._db.execute(
                "INSERT INTO leader (id, epoch, address, since) VALUES (1, 1, '', ?) "
                "ON CONFLICT (id) DO UPDATE SET epoch = leader.epoch + 1, since = excluded.since "
                "RETURNING epoch", (self.clock(),),
            ).fetchone()
        self.epoch = int(epoch)
        return self.epoch

    def announce(self, address: str) -> None:
        """Where the leader's internal port is, once it serves: the followers' fronts forward there."""
        with self._db.lock:
            self._db.execute("UPDATE leader SET address = ? WHERE id = 1 AND epoch = ?", (address, self.epoch))

    def holds(self) -> bool:
        """Whether this replica still leads: its session is alive and no later epoch exists."""
        if self.epoch is None:
            return False
        try:
            with self._db.lock:
                row = self._db.execute("SELECT epoch FROM leader WHERE id = 1").fetchone()
        except self.errors:
            return False
        return row is not None and row[0] == self.epoch

    def heartbeat(self, address: str) -> None:
        """This replica (serving devices at ``address``) is alive, by the database server's clock:
        the replicas' own clocks need not agree."""
        with self._db.lock:
            self._db.execute(
                "INSERT INTO replicas (address, seen_at) VALUES (?, EXTRACT(EPOCH FROM clock_timestamp())) "
                "ON CONFLICT (address) DO UPDATE SET seen_at = excluded.seen_at", (address,))

    def replicas_alive(self, within_s: float) -> set[str]:
        """The addresses of the replicas that sent a heartbeat in the last ``within_s`` seconds."""
        with self._db.lock:
            rows = self._db.execute(
                "SELECT address FROM replicas WHERE seen_at > EXTRACT(EPOCH FROM clock_timestamp()) - ?",
                (within_s,)).fetchall()
        return {address for (address,) in rows}

    def close(self) -> None:
        """Let go: another replica may lead at once. Unlocked before the session ends, since a
        session's locks outlive its closed connection until the server has cleaned up after it."""
        if self.epoch is not None:
            with contextlib.suppress(*self.errors), self._db.lock:
                self._db.execute("SELECT pg_advisory_unlock(?)", (LEADER_LOCK_KEY,))
        self._db.close()
        self.epoch = None


def leader_address(database: Database) -> str | None:
    """Where the leader's internal port is, for a follower's fronts; None before any leader."""
    with database.lock:
        row = database.execute("SELECT address FROM leader WHERE id = 1").fetchone()
    return row[0] if row and row[0] else None
