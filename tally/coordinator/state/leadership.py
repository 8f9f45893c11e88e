"""Which of several coordinator replicas over one PostgreSQL store plans rounds.

One leader, not a store-level protocol between equals: selection, seating, the sessions and the
commit of a round are a sequence of decisions that each read what the previous one wrote, and
keeping that in one process is what makes a round's state need no agreement between processes
(the same reason a host's device fronts forward to one coordinator process). The other replicas
serve devices as fronts (``tally.coordinator.faces.device_front``): registrations and idle check-ins
themselves, everything else forwarded to the leader's address, which they read from the store.

The leader is whoever holds a session-level advisory lock (``pg_try_advisory_lock``): the server
releases it the moment the holder's connection ends (a killed pod, a crashed process), and a
replica that finds it free takes over at once. A leader whose process stops without its
connection ending (SIGSTOP, a frozen VM, a stalled event loop) would hold the lock for ever, the
kernel answering the server's keepalives for it: so the lead is also a lease, renewed each
``LEAD_POLL_S`` by the database server's clock and never after it ran out. A follower that finds
the lock held under an expired lease ends the holder's session (``pg_terminate_backend``, allowed
between sessions of one role) and takes the lock.

Taking the lead increments the ``leader`` row's epoch, the fencing token: every write of the
leader's store checks, in its own transaction, that its epoch is still the newest
(``tally.coordinator.state.store.LeadershipLost`` otherwise), and every session ticket carries it,
so aggregators refuse a session from an older epoch once a newer one has fenced them
(``tally.aggregator.held_sessions``). A leader paused past its lease and resumed after another took
over therefore commits, seats and opens nothing, and steps down.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable

from tally import logs
from tally.coordinator.state.database import Database, PostgresDatabase
from tally.coordinator.state.store import create_schema

log = logging.getLogger(__name__)

# The advisory lock's key: any constant unlikely to collide with an operator's own locks.
LEADER_LOCK_KEY = 0x7A11_1EAD
# How long a lead lasts unrenewed. The leader renews it each second (``tally.coordinator.replica``):
# long enough that a busy host's event loop does not lose it, short enough that a stopped leader's
# devices wait no longer than this for another.
DEFAULT_LEASE_S = 10.0
# How long taking over waits for an expired leader's session to end.
TERMINATE_WAIT_MS = 5000
# The database server's clock, in seconds: the replicas' own clocks need not agree.
DB_NOW = "EXTRACT(EPOCH FROM clock_timestamp())"


class Leadership:
    """A replica's claim: one PostgreSQL session, kept open while it leads, and a lease of
    ``lease_s`` seconds it renews."""

    def __init__(self, database_url: str, clock: Callable[[], float] = time.time,
                 lease_s: float = DEFAULT_LEASE_S) -> None:
        if not lease_s > 0:
            raise ValueError(f"lease_s must be > 0, got {lease_s}")
        self._db = PostgresDatabase(database_url)
        self.errors = self._db.errors  # what a lost or refused connection raises
        self.clock, self.lease_s = clock, lease_s
        create_schema(self._db)
        self.epoch: int | None = None

    def try_lead(self) -> int | None:
        """Take the lead if no replica holds it, or its holder let its lease run out: the new
        epoch; None while another replica leads. Followers keep forwarding to the old address
        until ``announce``: to a leader that is gone, so their devices are told to retry, not misled."""
        if self.epoch is not None:
            return self.epoch
        if not self._take_lock() and not (self._end_expired_lead() and self._take_lock()):
            return None
        with self._db.transaction():
            (epoch,) = self._db.execute(
                "INSERT INTO leader (id, epoch, address, since, pid, lease_until) "
                f"VALUES (1, 1, '', ?, pg_backend_pid(), {DB_NOW} + ?) "
                "ON CONFLICT (id) DO UPDATE SET epoch = leader.epoch + 1, since = excluded.since, "
                "pid = excluded.pid, lease_until = excluded.lease_until RETURNING epoch",
                (self.clock(), self.lease_s),
            ).fetchone()
        self.epoch = int(epoch)
        return self.epoch

    def _take_lock(self) -> bool:
        with self._db.lock:
            (taken,) = self._db.execute("SELECT pg_try_advisory_lock(?)", (LEADER_LOCK_KEY,)).fetchone()
        return bool(taken)

    def _end_expired_lead(self) -> bool:
        """End the session of a leader whose lease ran out (whether it ended). Only the session
        that holds the lock and is the one the ``leader`` row names: a replica that has just
        taken a free lock has not written its row yet, and its predecessor's pid may be reused."""
        with self._db.lock:
            row = self._db.execute(
                "SELECT leader.epoch, leader.pid, pg_terminate_backend(leader.pid::integer, ?::bigint) FROM leader "
                "JOIN pg_locks ON pg_locks.pid = leader.pid AND pg_locks.locktype = 'advisory' "
                "AND pg_locks.granted AND pg_locks.classid::bigint = ? AND pg_locks.objid::bigint = ? "
                f"AND pg_locks.objsubid = 1 WHERE leader.id = 1 AND leader.lease_until < {DB_NOW}",
                (TERMINATE_WAIT_MS, LEADER_LOCK_KEY >> 32, LEADER_LOCK_KEY & 0xFFFF_FFFF),
            ).fetchone()
        if row is None:
            return False
        logs.event(log, "the leader's lease ran out; its session ended", logging.WARNING, epoch=row[0],
                   backend_pid=row[1], ended=bool(row[2]))
        return bool(row[2])

    def announce(self, address: str) -> None:
        """Where the leader's internal port is, once it serves: the followers' fronts forward there."""
        with self._db.lock:
            self._db.execute("UPDATE leader SET address = ? WHERE id = 1 AND epoch = ?", (address, self.epoch))

    def renew(self) -> bool:
        """Whether this replica still leads, its lease extended by ``lease_s``: not once its
        session ended, a later epoch exists, or its lease ran out (a follower may be taking over
        that very moment, so an expired lease is never renewed: the replica steps down)."""
        if self.epoch is None:
            return False
        try:
            with self._db.lock:
                row = self._db.execute(
                    f"UPDATE leader SET lease_until = {DB_NOW} + ? WHERE id = 1 AND epoch = ? "
                    f"AND lease_until >= {DB_NOW} RETURNING epoch", (self.lease_s, self.epoch),
                ).fetchone()
        except self.errors:
            return False
        return row is not None

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
