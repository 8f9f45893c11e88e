"""The coordinator's durable state: SQLite for jobs, round attempts, model versions and events,
plus a content-addressed directory of blobs (models, ONNX exports, algorithm states).

Commit protocol: a round's blobs are written first (each atomically: temp file, fsync, rename),
then one SQLite transaction records the model version, marks the attempt committed and advances
the job's ``committed_round``. A crash before the transaction leaves unreferenced blobs and an
uncommitted round, which a restarted coordinator runs again; a crash after it leaves a committed
round, which is never run again. So no committed round is lost or repeated.

All methods are thread-safe (one connection behind a lock), so large blob writes can run in a
worker thread while the event loop keeps serving. One coordinator at a time owns a state
directory (an exclusive lock on ``coordinator.lock``): two would run every job twice.

Over PostgreSQL (coordinator replicas, ``tally.coordinator.state.leadership``) the tables are the same
and the blobs are stored in the database too (``blob_data``), the state directory keeping a
cache of them: a replica that becomes the leader reads the models its predecessor committed.
Every write of a leader's store is fenced: its transaction reads the ``leader`` row's epoch
``FOR SHARE`` and goes on only while it is the epoch the store was opened under, so a leader that
lost the lead without noticing (its connection cut, its process paused past its lease) cannot
commit a round, seat a device, record a session, start or fail an attempt or change a job while
its successor runs them. The shared lock orders each such write before or after the successor's
epoch increment, never across it. Blobs are not fenced (content-addressed: one written by a stale
leader is referenced by nothing), nor are enrolments (any replica registers devices).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import secrets
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tally.coordinator.state.database import Database, SqliteDatabase, open_database, schema
from tally.coordinator.state.enrolled_devices import EnrolledDevices

BLOB_KINDS = ("model", "broadcast", "onnx", "state")
# What devices may download; algorithm states stay on the server.
SERVED_KINDS = ("model", "broadcast", "onnx")
# A task report's detail kept as its reason's example: enough for an exception's message.
MAX_EXAMPLE_CHARS = 300

_SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    job_id TEXT NOT NULL UNIQUE,
    name TEXT NOT NULL,
    algorithm TEXT NOT NULL,
    population TEXT NOT NULL,
    spec_yaml TEXT NOT NULL,
    state TEXT NOT NULL,
    message TEXT NOT NULL DEFAULT '',
    committed_round INTEGER NOT NULL DEFAULT 0,
    created_at REAL NOT NULL,
    updated_at REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS rounds (
    job_id TEXT NOT NULL,
    round INTEGER NOT NULL,
    attempt INTEGER NOT NULL,
    state TEXT NOT NULL,
    started_at REAL NOT NULL,
    finished_at REAL,
    message TEXT NOT NULL DEFAULT '',
    metrics TEXT NOT NULL DEFAULT '{}',
    sessions TEXT NOT NULL DEFAULT '[]',
    -- the leader epoch of the replica that started it (0: a coordinator that leads alone)
    epoch INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (job_id, round, attempt)
);
CREATE TABLE IF NOT EXISTS model_versions (
    job_id TEXT NOT NULL,
    round INTEGER NOT NULL,
    model_digest TEXT NOT NULL,
    state_digest TEXT,
    onnx_digest TEXT,
    created_at REAL NOT NULL,
    PRIMARY KEY (job_id, round)
);
CREATE TABLE IF NOT EXISTS events (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    job_id TEXT NOT NULL,
    time REAL NOT NULL,
    round INTEGER NOT NULL,
    phase TEXT NOT NULL,
    step TEXT NOT NULL,
    state TEXT NOT NULL,
    message TEXT NOT NULL,
    metrics TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS blobs (
    digest TEXT NOT NULL,
    kind TEXT NOT NULL,
    size INTEGER NOT NULL,
    PRIMARY KEY (digest, kind)
);
-- Stable silo ids of jobs whose algorithm addresses devices by identity (AAggFF-S's reveal path):
-- 0, 1, ... in order of a device's first check-in for the job.
CREATE TABLE IF NOT EXISTS silos (
    job_id TEXT NOT NULL,
    device_id TEXT NOT NULL,
    silo INTEGER NOT NULL,
    PRIMARY KEY (job_id, device_id),
    UNIQUE (job_id, silo)
);
-- Enrolled devices: a device id is bound for good to the identity key it first registered with,
-- and one key names one device (so one key cannot fill a cohort under many ids).
CREATE TABLE IF NOT EXISTS devices (
    device_id TEXT PRIMARY KEY,
    population TEXT NOT NULL,
    identity_public BLOB NOT NULL UNIQUE,
    enrolled_at REAL NOT NULL,
    -- the timestamp of its latest registration statement: an older or equal one is a replay
    registered_at REAL NOT NULL,
    -- set once an operator revoked the device: it may not register, check in or download again
    revoked_at REAL
);
-- Devices seated in an attempt of a round whose sessions opened: a retry of the round seats
-- none of them again (so no two sums of one round can be differenced), unless the seat is
-- released: its task was never handed out, or the device reported that it sent no input, or
-- the input ledger it stated when seated (ledger_id, '' for none) says so.
-- Rows of a committed round are deleted with the commit.
CREATE TABLE IF NOT EXISTS seated (
    job_id TEXT NOT NULL,
    round INTEGER NOT NULL,
    device_id TEXT NOT NULL,
    task_id TEXT NOT NULL DEFAULT '',
    ledger_id TEXT NOT NULL DEFAULT '',
    PRIMARY KEY (job_id, round, device_id)
);
-- What devices reported about their tasks (TaskReport), counted per round and reason.
CREATE TABLE IF NOT EXISTS task_reports (
    job_id TEXT NOT NULL,
    round INTEGER NOT NULL,
    outcome TEXT NOT NULL,
    reason TEXT NOT NULL,
    count INTEGER NOT NULL,
    -- the detail of the first such report (cut short): what an operator reads to see why
    example TEXT NOT NULL DEFAULT '',
    PRIMARY KEY (job_id, round, outcome, reason)
);
-- Each cohort's unmasked sum as a fingerprint (tally/codec/fingerprint.py) and the devices in it,
-- per attempt: what a load test or a fault campaign checks its inputs against. No values.
CREATE TABLE IF NOT EXISTS cohort_sums (
    job_id TEXT NOT NULL,
    round INTEGER NOT NULL,
    attempt INTEGER NOT NULL,
    session_id TEXT NOT NULL,
    sum_id TEXT NOT NULL,
    cohort INTEGER NOT NULL,
    bits INTEGER NOT NULL,
    contributors TEXT NOT NULL,
    fingerprint TEXT NOT NULL,
    PRIMARY KEY (job_id, round, attempt, session_id, sum_id)
);
-- Devices an aggregator proved to have dealt bad shares (SumResult.convicted): never seated in
-- the job again, whatever their ledger or reports say.
CREATE TABLE IF NOT EXISTS convicted (
    job_id TEXT NOT NULL,
    device_id TEXT NOT NULL,
    reason TEXT NOT NULL,
    PRIMARY KEY (job_id, device_id)
);
-- Devices that stated at check-in that their own privacy budget is spent for a job: never
-- selected for it again, counted, and the job fails once too few remain eligible, across restarts.
CREATE TABLE IF NOT EXISTS out_of_budget (
    job_id TEXT NOT NULL,
    device_id TEXT NOT NULL,
    PRIMARY KEY (job_id, device_id)
);
CREATE INDEX IF NOT EXISTS events_by_job ON events (job_id, id);
"""

# Every process serving devices re-reads the revoked devices (device fronts every 0.5 s): a partial
# index makes that a few rows, not a scan of a million.
_REVOKED_INDEX = "CREATE INDEX IF NOT EXISTS devices_revoked ON devices (revoked_at) WHERE revoked_at IS NOT NULL"

# Only over PostgreSQL: the blobs themselves (replicas share no disk), and who leads.
_SHARED_SCHEMA = """
CREATE TABLE IF NOT EXISTS blob_data (
    digest TEXT PRIMARY KEY,
    data BLOB NOT NULL
);
-- Secrets every replica must agree on and no operator provides (the admin token).
CREATE TABLE IF NOT EXISTS shared_settings (
    name TEXT PRIMARY KEY,
    value TEXT NOT NULL
);
-- One row: the replica planning rounds, its address for the others' device fronts, the epoch
-- every write of its store is fenced on (incremented by each new leader), the server process of
-- its session (ended by a successor once its lease ran out) and when its lease runs out (the
-- database server's clock).
CREATE TABLE IF NOT EXISTS leader (
    id INTEGER PRIMARY KEY CHECK (id = 1),
    epoch INTEGER NOT NULL,
    address TEXT NOT NULL,
    since REAL NOT NULL,
    pid INTEGER NOT NULL DEFAULT 0,
    lease_until REAL NOT NULL DEFAULT 0
);
-- Every replica, leading or not, by the address it serves devices at, and when it last said it
-- was alive (the database server's clock): the leader paces the check-ins the others forward
-- by how many are alive.
CREATE TABLE IF NOT EXISTS replicas (
    address TEXT PRIMARY KEY,
    seen_at REAL NOT NULL
);
"""
# What a database of an earlier version's replicas lacks: they led without a lease, and started
# attempts without an epoch.
_FENCING_MIGRATION = (
    "ALTER TABLE leader ADD COLUMN IF NOT EXISTS pid BIGINT NOT NULL DEFAULT 0",
    "ALTER TABLE leader ADD COLUMN IF NOT EXISTS lease_until DOUBLE PRECISION NOT NULL DEFAULT 0",
    "ALTER TABLE rounds ADD COLUMN IF NOT EXISTS epoch BIGINT NOT NULL DEFAULT 0",
)
# Serialises replicas creating the schema at once (CREATE TABLE IF NOT EXISTS is not safe
# against a concurrent one in PostgreSQL); any constant unlikely to collide with an operator's.
SCHEMA_LOCK_KEY = 0x7A11_5C4E


class LeadershipLost(RuntimeError):
    """A write of a replica that is no longer the leader: another one took over."""


@dataclass(frozen=True)
class JobRecord:
    seq: int
    job_id: str
    name: str
    algorithm: str
    population: str
    spec_yaml: str
    state: str  # a JobState name without its prefix: PENDING, RUNNING, SUCCEEDED, ...
    message: str
    committed_round: int
    created_at: float
    updated_at: float


@dataclass(frozen=True)
class RoundRecord:
    job_id: str
    round: int
    attempt: int
    state: str  # running, committed, failed
    started_at: float
    finished_at: float | None
    message: str
    metrics: dict[str, float]
    sessions: list[dict[str, str]]


@dataclass(frozen=True)
class CohortSumRecord:
    session_id: str
    sum_id: str
    cohort: int
    bits: int
    contributors: tuple[int, ...]
    fingerprint: tuple[int, ...]


@dataclass(frozen=True)
class ModelVersion:
    job_id: str
    round: int
    model_digest: str
    state_digest: str | None
    onnx_digest: str | None
    created_at: float


@dataclass(frozen=True)
class EventRecord:
    job_id: str
    time: float
    round: int
    phase: str
    step: str
    state: str
    message: str
    metrics: dict[str, float]


@dataclass(frozen=True)
class BlobInfo:
    digest: str
    size: int
    path: Path


class Store:
    """SQLite database ``coordinator.db`` and ``blobs/`` under one state directory; or, for
    replicas, a PostgreSQL database, with ``blobs/`` as this replica's cache of its blobs."""

    def __init__(self, directory: Path, database_url: str | None = None, epoch: int | None = None,
                 on_leadership_lost: Callable[[], None] = lambda: None) -> None:
        """``database_url``: PostgreSQL (``postgresql://...``) instead of ``coordinator.db``;
        ``epoch``: the leader epoch its writes are fenced on (PostgreSQL only);
        ``on_leadership_lost``: called (from whichever thread wrote) when a write is refused
        because a later epoch exists, so the replica steps down whoever found out first."""
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        self._owner = open(os.open(self.directory / "coordinator.lock", os.O_WRONLY | os.O_CREAT, 0o600), "a")
        try:
            fcntl.flock(self._owner, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._owner.close()
            raise RuntimeError(f"{self.directory} is in use by another coordinator") from None
        self._blobs = self.directory / "blobs"
        self._blobs.mkdir(exist_ok=True, mode=0o700)
        self._database = self._db = open_database(self.directory, database_url)
        self._lock, self._shared, self.epoch = self._database.lock, database_url is not None, epoch
        self._on_leadership_lost = on_leadership_lost
        create_schema(self._database)
        self.devices = EnrolledDevices(self._database)
        # Tighten what an older version (or another umask) left behind.
        for path in (self.directory, self._blobs, *self.directory.glob("coordinator.*")):
            os.chmod(path, 0o700 if path.is_dir() else 0o600)

    def close(self) -> None:
        self._database.close()
        self._owner.close()  # releases the directory

    @contextlib.contextmanager
    def _write(self, durable: bool = True) -> Iterator[None]:
        """One of the leader's write transactions, fenced on its epoch over PostgreSQL."""
        with self._database.transaction(durable):
            if self._shared:
                row = self._db.execute("SELECT epoch FROM leader WHERE id = 1 FOR SHARE").fetchone()
                if row is None or row[0] != self.epoch:
                    self._on_leadership_lost()
                    raise LeadershipLost(f"leader epoch {self.epoch} is over (now {row and row[0]}): "
                                         "another replica leads")
            yield

    def shared_setting(self, name: str, proposed: str) -> str:
        """The replicas' one value of ``name``: ``proposed`` if none was stored yet (PostgreSQL)."""
        with self._lock:
            self._db.execute("INSERT INTO shared_settings (name, value) VALUES (?, ?) ON CONFLICT DO NOTHING",
                             (name, proposed))
            return str(self._db.execute("SELECT value FROM shared_settings WHERE name = ?", (name,)).fetchone()[0])

    # -- blobs ---------------------------------------------------------------------------------

    def put_blob(self, data: bytes, kind: str) -> str:
        """Store ``data`` under its SHA-256 (written once, atomically) and return the digest."""
        if kind not in BLOB_KINDS:
            raise ValueError(f"unknown blob kind {kind!r}")
        digest = hashlib.sha256(data).hexdigest()
        self._cache_blob(digest, data)
        with self._lock:
            # A model of tens of MB is sent to the server only if it has not got it already.
            if (self._shared
                    and self._db.execute("SELECT 1 FROM blob_data WHERE digest = ?", (digest,)).fetchone() is None):
                self._db.execute("INSERT INTO blob_data (digest, data) VALUES (?, ?) ON CONFLICT DO NOTHING",
                                 (digest, data))
            self._db.execute(
                "INSERT INTO blobs (digest, kind, size) VALUES (?, ?, ?) ON CONFLICT DO NOTHING",
                (digest, kind, len(data)),
            )
        return digest

    def _cache_blob(self, digest: str, data: bytes) -> None:
        """Write a blob's file once, atomically (this replica's copy, over PostgreSQL)."""
        path = self._blob_path(digest)
        if not path.exists():
            path.parent.mkdir(exist_ok=True, mode=0o700)
            tmp = path.with_name(f".{digest}.{secrets.token_hex(4)}.tmp")
            try:
                with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb") as f:
                    f.write(data)
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, path)
            finally:
                tmp.unlink(missing_ok=True)

    def _cached(self, digest: str) -> Path | None:
        """The blob's file, fetched from the database when another replica stored it."""
        path = self._blob_path(digest)
        if path.exists():
            return path
        if not self._shared:
            return None
        with self._lock:
            row = self._db.execute("SELECT data FROM blob_data WHERE digest = ?", (digest,)).fetchone()
        if row is None:
            return None
        self._cache_blob(digest, bytes(row[0]))
        return path

    def blob(self, digest: str, kinds: Iterable[str] = BLOB_KINDS) -> BlobInfo | None:
        """The stored blob ``digest`` if it was stored as one of ``kinds``, else None."""
        kinds = tuple(kinds)
        with self._lock:
            row = self._db.execute(
                f"SELECT size FROM blobs WHERE digest = ? AND kind IN ({','.join('?' * len(kinds))})",
                (digest, *kinds),
            ).fetchone()
        path = self._cached(digest) if row is not None else None
        if path is None:
            return None
        return BlobInfo(digest, int(row[0]), path)

    def read_blob(self, digest: str) -> bytes:
        path = self._cached(digest)
        if path is None:
            raise FileNotFoundError(f"blob {digest} is not stored")
        data = path.read_bytes()
        if hashlib.sha256(data).hexdigest() != digest:
            raise ValueError(f"blob {digest} is corrupt on disk")
        return data

    def _blob_path(self, digest: str) -> Path:
        if len(digest) != 64 or not all(c in "0123456789abcdef" for c in digest):
            raise ValueError("a blob digest is 64 lowercase hex characters")
        return self._blobs / digest[:2] / digest

    # -- jobs ----------------------------------------------------------------------------------

    def create_job(
        self, job_id: str, name: str, algorithm: str, population: str, spec_yaml: str, now: float
    ) -> JobRecord:
        with self._write():
            self._db.execute(
                "INSERT INTO jobs (job_id, name, algorithm, population, spec_yaml, state, "
                "created_at, updated_at) VALUES (?, ?, ?, ?, ?, 'PENDING', ?, ?)",
                (job_id, name, algorithm, population, spec_yaml, now, now),
            )
        job = self.job(job_id)
        assert job is not None
        return job

    def silo(self, job_id: str, device_id: str, limit: int) -> int | None:
        """The device's silo id in the job, assigning the next free one on first sight; None when
        all ``limit`` ids are taken by other devices."""
        with self._write():
            row = self._db.execute(
                "SELECT silo FROM silos WHERE job_id = ? AND device_id = ?", (job_id, device_id)
            ).fetchone()
            if row:
                return int(row[0])
            (taken,) = self._db.execute("SELECT COUNT(*) FROM silos WHERE job_id = ?", (job_id,)).fetchone()
            if taken >= limit:
                return None
            self._db.execute(
                "INSERT INTO silos (job_id, device_id, silo) VALUES (?, ?, ?)", (job_id, device_id, taken)
            )
            return int(taken)

    def silos(self, job_id: str) -> dict[str, int]:
        with self._lock:
            rows = self._db.execute("SELECT device_id, silo FROM silos WHERE job_id = ?", (job_id,)).fetchall()
        return {device: int(silo) for device, silo in rows}

    def job(self, job_id: str) -> JobRecord | None:
        with self._lock:
            row = self._db.execute(f"SELECT {_JOB_COLUMNS} FROM jobs WHERE job_id = ?", (job_id,)).fetchone()
        return JobRecord(*row) if row else None

    def jobs(
        self, states: Iterable[str] = (), *, after_seq: int = 0, limit: int | None = None
    ) -> list[JobRecord]:
        """Jobs in submission order, optionally only in ``states``, after ``after_seq``."""
        states = tuple(states)
        sql = f"SELECT {_JOB_COLUMNS} FROM jobs WHERE seq > ?"
        args: list[Any] = [after_seq]
        if states:
            sql += f" AND state IN ({','.join('?' * len(states))})"
            args += states
        sql += " ORDER BY seq"
        if limit is not None:
            sql += " LIMIT ?"
            args.append(limit)
        with self._lock:
            return [JobRecord(*row) for row in self._db.execute(sql, args).fetchall()]

    def job_counts(self) -> dict[str, int]:
        """How many jobs are in each state."""
        with self._lock:
            return dict(self._db.execute("SELECT state, COUNT(*) FROM jobs GROUP BY state").fetchall())

    def set_job_state(self, job_id: str, state: str, now: float, message: str = "") -> None:
        with self._write():
            self._db.execute(
                "UPDATE jobs SET state = ?, message = ?, updated_at = ? WHERE job_id = ?",
                (state, message, now, job_id),
            )

    # -- rounds and model versions -------------------------------------------------------------

    def start_attempt(self, job_id: str, round_: int, now: float) -> int:
        """Record a new attempt of a round; its number (attempts count on across restarts)."""
        with self._write():
            (last,) = self._db.execute(
                "SELECT COALESCE(MAX(attempt), 0) FROM rounds WHERE job_id = ? AND round = ?",
                (job_id, round_),
            ).fetchone()
            self._db.execute(
                "INSERT INTO rounds (job_id, round, attempt, state, started_at, epoch) "
                "VALUES (?, ?, ?, 'running', ?, ?)",
                (job_id, round_, last + 1, now, self.epoch or 0),
            )
        return last + 1

    def set_attempt_sessions(
        self, job_id: str, round_: int, attempt: int, sessions: list[dict[str, str]]
    ) -> None:
        """The sessions an attempt opened (aggregator_id and session_id), so a restarted
        coordinator can close them (with owner tokens it derives again: nothing secret is stored)."""
        with self._write():
            self._db.execute(
                "UPDATE rounds SET sessions = ? WHERE job_id = ? AND round = ? AND attempt = ?",
                (json.dumps(sessions), job_id, round_, attempt),
            )

    def finish_attempt(self, job_id: str, round_: int, attempt: int, now: float, message: str) -> None:
        """Mark a running attempt failed (its sessions are closed; its sums are discarded)."""
        with self._write():
            self._db.execute(
                "UPDATE rounds SET state = 'failed', finished_at = ?, message = ? "
                "WHERE job_id = ? AND round = ? AND attempt = ? AND state = 'running'",
                (now, message, job_id, round_, attempt),
            )

    def running_attempts(self, job_id: str) -> list[RoundRecord]:
        return [r for r in self.rounds(job_id) if r.state == "running"]

    def rounds(self, job_id: str, round_: int | None = None) -> list[RoundRecord]:
        """Every attempt of the job's rounds, or of round ``round_`` only."""
        only = "" if round_ is None else " AND round = ?"
        with self._lock:
            rows = self._db.execute(
                "SELECT job_id, round, attempt, state, started_at, finished_at, message, metrics, "
                f"sessions FROM rounds WHERE job_id = ?{only} ORDER BY round, attempt",
                (job_id,) if round_ is None else (job_id, round_),
            ).fetchall()
        return [RoundRecord(*r[:7], json.loads(r[7]), json.loads(r[8])) for r in rows]

    def add_seated(
        self, job_id: str, round_: int, seats: Iterable[tuple[str, str]], ledger_ids: Mapping[str, str] | None = None
    ) -> None:
        """Record, before any of them gets its task, the (device id, task id) seats of an
        attempt's cohorts: a restarted coordinator must keep them out of the round's retries too.
        ``ledger_ids``: the input ledger each device stated when it was seated (none: "")."""
        ledger_ids = ledger_ids or {}
        with self._write():  # one fsync for the attempt's seats, not one per seat
            self._db.executemany(
                "INSERT INTO seated (job_id, round, device_id, task_id, ledger_id) VALUES (?, ?, ?, ?, ?) "
                "ON CONFLICT (job_id, round, device_id) DO UPDATE SET task_id = excluded.task_id, "
                "ledger_id = excluded.ledger_id",
                [(job_id, round_, device, task, ledger_ids.get(device, "")) for device, task in seats],
            )

    def release_seats(self, job_id: str, round_: int, seats: Iterable[tuple[str, str]]) -> int:
        """Let (device id, task id) seats whose device cannot have sent an input be seated again
        in the round's retries; a seat of another task (a later attempt's) stays. The count
        released."""
        with self._write(durable=False):
            return sum(
                self._db.execute(
                    "DELETE FROM seated WHERE job_id = ? AND round = ? AND device_id = ? "
                    "AND task_id = ?", (job_id, round_, device, task),
                ).rowcount
                for device, task in seats
            )

    def has_seat(self, job_id: str, round_: int, device_id: str, task_id: str) -> bool:
        with self._lock:
            return self._db.execute(
                "SELECT 1 FROM seated WHERE job_id = ? AND round = ? AND device_id = ? AND task_id = ?",
                (job_id, round_, device_id, task_id),
            ).fetchone() is not None

    def release_device(self, job_id: str, round_: int, device_id: str, ledger_id: str) -> int:
        """Let the seat of ``device_id`` in the round be given out again: its own durable ledger
        says it sent no input in the round (``CheckInRequest.input_ledger``), and it is the ledger
        the device stated when it was seated (a ledger created since knows nothing of that seat,
        and no ledger at all, "", releases nothing). The count released."""
        if not ledger_id:
            return 0
        with self._write(durable=False):
            return self._db.execute(
                "DELETE FROM seated WHERE job_id = ? AND round = ? AND device_id = ? AND ledger_id = ?",
                (job_id, round_, device_id, ledger_id),
            ).rowcount

    def count_task_report(self, job_id: str, round_: int, outcome: str, reason: str, detail: str = "") -> None:
        with self._write(durable=False):
            self._db.execute(
                "INSERT INTO task_reports (job_id, round, outcome, reason, count, example) "
                "VALUES (?, ?, ?, ?, 1, ?) ON CONFLICT (job_id, round, outcome, reason) "
                "DO UPDATE SET count = task_reports.count + 1, example = CASE WHEN task_reports.example = '' "
                "THEN excluded.example ELSE task_reports.example END",
                (job_id, round_, outcome, reason, detail[:MAX_EXAMPLE_CHARS]),
            )

    def task_report_counts(self, job_id: str, round_: int) -> dict[tuple[str, str], int]:
        """{(outcome, reason): count} of the reports on a round's tasks."""
        return {key: count for key, (count, _) in self.task_report_summary(job_id, round_).items()}

    def task_report_summary(self, job_id: str, round_: int) -> dict[tuple[str, str], tuple[int, str]]:
        """{(outcome, reason): (count, one example detail)} of the reports on a round's tasks."""
        with self._lock:
            rows = self._db.execute(
                "SELECT outcome, reason, count, example FROM task_reports WHERE job_id = ? AND round = ?",
                (job_id, round_),
            ).fetchall()
        return {(outcome, reason): (count, example) for outcome, reason, count, example in rows}

    def add_cohort_sum(self, job_id: str, round_: int, attempt: int, record: CohortSumRecord) -> None:
        with self._write():
            self._db.execute(
                "INSERT INTO cohort_sums (job_id, round, attempt, session_id, sum_id, cohort, bits, "
                "contributors, fingerprint) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?) "
                "ON CONFLICT (job_id, round, attempt, session_id, sum_id) DO UPDATE SET "
                "cohort = excluded.cohort, bits = excluded.bits, contributors = excluded.contributors, "
                "fingerprint = excluded.fingerprint",
                (job_id, round_, attempt, record.session_id, record.sum_id, record.cohort, record.bits,
                 json.dumps(list(record.contributors)), json.dumps([str(f) for f in record.fingerprint])),
            )

    def committed_cohort_sums(self, job_id: str, round_: int) -> list[CohortSumRecord] | None:
        """The cohort sums of a round's committed attempt; None while the round is not committed."""
        with self._lock:
            committed = self._db.execute(
                "SELECT attempt FROM rounds WHERE job_id = ? AND round = ? AND state = 'committed'",
                (job_id, round_),
            ).fetchone()
            if committed is None:
                return None
            rows = self._db.execute(
                "SELECT session_id, sum_id, cohort, bits, contributors, fingerprint FROM cohort_sums "
                "WHERE job_id = ? AND round = ? AND attempt = ? ORDER BY sum_id, cohort",
                (job_id, round_, committed[0]),
            ).fetchall()
        return [CohortSumRecord(session, sum_id, cohort, bits, tuple(json.loads(contributors)),
                                tuple(int(f) for f in json.loads(fingerprint)))
                for session, sum_id, cohort, bits, contributors, fingerprint in rows]

    def convict(self, job_id: str, device_id: str, reason: str) -> None:
        """Keep ``device_id`` out of every later selection of the job: its misbehaviour is proven."""
        with self._write():
            self._db.execute(
                "INSERT INTO convicted (job_id, device_id, reason) VALUES (?, ?, ?) "
                "ON CONFLICT (job_id, device_id) DO NOTHING", (job_id, device_id, reason),
            )

    def convicted(self, job_id: str) -> frozenset[str]:
        with self._lock:
            rows = self._db.execute("SELECT device_id FROM convicted WHERE job_id = ?", (job_id,)).fetchall()
        return frozenset(d for (d,) in rows)

    def add_out_of_budget(self, job_id: str, device_id: str) -> None:
        """``device_id`` stated that its own privacy budget is spent for ``job_id``: a restarted
        coordinator still skips and counts it, though the device may not say so again."""
        with self._write():
            self._db.execute(
                "INSERT INTO out_of_budget (job_id, device_id) VALUES (?, ?) "
                "ON CONFLICT (job_id, device_id) DO NOTHING", (job_id, device_id),
            )

    def out_of_budget(self, job_id: str) -> frozenset[str]:
        with self._lock:
            rows = self._db.execute("SELECT device_id FROM out_of_budget WHERE job_id = ?", (job_id,)).fetchall()
        return frozenset(d for (d,) in rows)

    def seated(self, job_id: str, round_: int) -> frozenset[str]:
        with self._lock:
            rows = self._db.execute(
                "SELECT device_id FROM seated WHERE job_id = ? AND round = ?", (job_id, round_)
            ).fetchall()
        return frozenset(d for (d,) in rows)

    def add_model_version(self, version: ModelVersion) -> None:
        """The initial model (round 0), written when a job starts."""
        with self._write():
            self._insert_version(version)

    def commit_round(
        self,
        version: ModelVersion,
        attempt: int,
        metrics: Mapping[str, float],
        *,
        final: bool,
    ) -> None:
        """In one transaction: the model version, the attempt committed, the job's committed
        round advanced (and the job SUCCEEDED when ``final``)."""
        now = version.created_at
        with self._write():
            self._insert_version(version)
            self._db.execute(
                "UPDATE rounds SET state = 'committed', finished_at = ?, metrics = ? "
                "WHERE job_id = ? AND round = ? AND attempt = ?",
                (now, json.dumps(dict(metrics)), version.job_id, version.round, attempt),
            )
            self._db.execute(
                "UPDATE jobs SET committed_round = ?, updated_at = ?, state = ? WHERE job_id = ?",
                (version.round, now, "SUCCEEDED" if final else "RUNNING", version.job_id),
            )
            self._db.execute(  # a committed round is never retried
                "DELETE FROM seated WHERE job_id = ? AND round = ?", (version.job_id, version.round)
            )

    def model_version(self, job_id: str, round_: int | None = None) -> ModelVersion | None:
        """Version ``round_`` of a job's model, or the latest when None."""
        sql = (
            "SELECT job_id, round, model_digest, state_digest, onnx_digest, created_at "
            "FROM model_versions WHERE job_id = ?"
        )
        with self._lock:
            if round_ is None:
                row = self._db.execute(sql + " ORDER BY round DESC LIMIT 1", (job_id,)).fetchone()
            else:
                row = self._db.execute(sql + " AND round = ?", (job_id, round_)).fetchone()
        return ModelVersion(*row) if row else None

    def _insert_version(self, v: ModelVersion) -> None:
        self._db.execute(
            "INSERT INTO model_versions (job_id, round, model_digest, state_digest, onnx_digest, "
            "created_at) VALUES (?, ?, ?, ?, ?, ?)",
            (v.job_id, v.round, v.model_digest, v.state_digest, v.onnx_digest, v.created_at),
        )

    # -- events --------------------------------------------------------------------------------

    def add_event(self, event: EventRecord) -> None:
        with self._write():
            self._db.execute(
                "INSERT INTO events (job_id, time, round, phase, step, state, message, metrics) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (event.job_id, event.time, event.round, event.phase, event.step, event.state,
                 event.message, json.dumps(dict(event.metrics))),
            )

    def events(self, job_id: str) -> list[EventRecord]:
        with self._lock:
            rows = self._db.execute(
                "SELECT job_id, time, round, phase, step, state, message, metrics FROM events "
                "WHERE job_id = ? ORDER BY id",
                (job_id,),
            ).fetchall()
        return [EventRecord(*r[:7], json.loads(r[7])) for r in rows]


_JOB_COLUMNS = (
    "seq, job_id, name, algorithm, population, spec_yaml, state, message, committed_round, "
    "created_at, updated_at"
)


def create_schema(database: Database) -> None:
    """The tables, and what an older SQLite state directory lacks of them."""
    if database.dialect == "postgresql":
        with database.transaction():
            database.execute("SELECT pg_advisory_xact_lock(?)", (SCHEMA_LOCK_KEY,))
            for statement in (*schema(_SCHEMA + _SHARED_SCHEMA, database.dialect), _REVOKED_INDEX,
                              *_FENCING_MIGRATION):
                database.execute(statement)
        return
    assert isinstance(database, SqliteDatabase)
    database.conn.executescript(_SCHEMA)
    # A state directory of an earlier version: its seats have no task id and so can never be
    # released, which errs on the safe side.
    for table, column in (("seated", "task_id TEXT NOT NULL DEFAULT ''"),
                          ("seated", "ledger_id TEXT NOT NULL DEFAULT ''"),
                          ("task_reports", "example TEXT NOT NULL DEFAULT ''"),
                          ("devices", "revoked_at REAL"),
                          ("rounds", "epoch INTEGER NOT NULL DEFAULT 0")):
        if column.split()[0] not in database.columns(table):
            database.execute(f"ALTER TABLE {table} ADD COLUMN {column}")
    database.execute(_REVOKED_INDEX)  # after the migration above
