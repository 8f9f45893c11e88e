"""The ``devices`` table: who is enrolled under which identity key, and who is revoked.

Apart from the rest of the store because every process that serves devices needs it (the
coordinator and its device fronts, ``tally.coordinator.faces.device_front``), and nothing else of it.
"""

from __future__ import annotations

from collections.abc import Iterable

from tally.coordinator.state.database import Database

# Well below SQLite's limit on bound parameters per statement (32,766), and PostgreSQL's (65,535).
IDS_PER_QUERY = 10_000


class EnrolmentRefused(Exception):
    """A registration the table cannot take; ``reason`` labels the refusals metric."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason, self.message = reason, message


class EnrolledDevices:
    def __init__(self, database: Database) -> None:
        self._database = database
        # Every device call asks whether its device is revoked: kept in memory, not queried.
        self._revoked: set[str] = set()
        self.reload_revoked()

    def reload_revoked(self) -> None:
        """Read the revoked devices again: another process (the coordinator, for a device front)
        may have revoked some since."""
        with self._database.lock:
            self._revoked = {row[0] for row in self._database.execute(
                "SELECT device_id FROM devices WHERE revoked_at IS NOT NULL")}

    def enrol(
        self, device_id: str, population: str, identity_public: bytes, statement_at: float, now: float
    ) -> None:
        """Record a verified registration. Raises ``EnrolmentRefused`` for a revoked device, a
        taken id under another key or population, a key already naming another device, or a
        statement no later than the device's last one (a replay)."""
        with self._database.transaction(durable=False):
            self._enrol(device_id, population, identity_public, statement_at, now)

    def _enrol(
        self, device_id: str, population: str, identity_public: bytes, statement_at: float, now: float
    ) -> None:
        db = self._database
        row = db.execute(
            "SELECT population, identity_public, registered_at, revoked_at FROM devices WHERE device_id = ?",
            (device_id,),
        ).fetchone()
        if row is None:
            owner = db.execute("SELECT device_id FROM devices WHERE identity_public = ?",
                               (identity_public,)).fetchone()
            if owner is not None:
                raise EnrolmentRefused("key_taken", "this identity key is enrolled for another device id")
            db.execute(
                "INSERT INTO devices (device_id, population, identity_public, enrolled_at, "
                "registered_at) VALUES (?, ?, ?, ?, ?)",
                (device_id, population, identity_public, now, statement_at),
            )
            return
        enrolled_population, enrolled_key, registered_at, revoked_at = row
        # The row, not the set: another process may have revoked it since the set was read.
        if revoked_at is not None:
            raise EnrolmentRefused("revoked", f"device id {device_id!r} is revoked")
        if bytes(enrolled_key) != identity_public:
            raise EnrolmentRefused(
                "id_taken", f"device id {device_id!r} is enrolled with another identity key"
            )
        if enrolled_population != population:
            raise EnrolmentRefused(
                "population_mismatch",
                f"device id {device_id!r} is enrolled in population {enrolled_population!r}",
            )
        if statement_at <= registered_at:
            raise EnrolmentRefused(
                "replay", "RegisterRequest.timestamp is not later than this device's last registration"
            )
        db.execute("UPDATE devices SET registered_at = ? WHERE device_id = ?", (statement_at, device_id))

    def revoke(self, device_id: str, now: float) -> bool:
        """Revoke one enrolled device for good (False: no such device). Nothing else changes: no
        other device shares a secret with it."""
        with self._database.transaction(durable=True):
            updated = self._database.execute(
                "UPDATE devices SET revoked_at = COALESCE(revoked_at, ?) WHERE device_id = ?", (now, device_id),
            ).rowcount
        if updated:
            self._revoked.add(device_id)
        return bool(updated)

    def population_size(self, population: str) -> int:
        """How many devices enrolled in ``population`` and are not revoked."""
        with self._database.lock:
            return int(self._database.execute(
                "SELECT COUNT(*) FROM devices WHERE population = ? AND revoked_at IS NULL", (population,)
            ).fetchone()[0])

    def is_revoked(self, device_id: str) -> bool:
        return device_id in self._revoked

    def identities(self, device_ids: Iterable[str]) -> dict[str, bytes]:
        """The identity keys the given devices enrolled with (devices never enrolled are left
        out), a batch of ids per query: a cohort's roster is built per session."""
        ids, out = list(device_ids), {}
        with self._database.lock:
            for start in range(0, len(ids), IDS_PER_QUERY):
                batch = ids[start:start + IDS_PER_QUERY]
                rows = self._database.execute(
                    "SELECT device_id, identity_public FROM devices "
                    f"WHERE device_id IN ({','.join('?' * len(batch))})",
                    batch,
                ).fetchall()
                out.update((device, bytes(key)) for device, key in rows)
        return out
