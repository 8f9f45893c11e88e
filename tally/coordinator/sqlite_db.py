"""One SQLite connection behind a lock, as the coordinator and its device fronts open
``coordinator.db``: in WAL mode, so several processes read while one writes, and with a busy
timeout, so a writer waits for another process's transaction rather than failing at once."""

from __future__ import annotations

import contextlib
import os
import sqlite3
import threading
from collections.abc import Iterator
from pathlib import Path

# How long a write waits for another process's transaction before SQLite gives up: far longer
# than any of the coordinator's transactions, which are a few rows each.
BUSY_TIMEOUT_S = 10.0


class Database:
    """``conn`` may be used under ``lock`` from any thread (blob writes run in worker threads)."""

    def __init__(self, path: Path) -> None:
        # Created 0600 before SQLite opens it: SQLite gives its -wal and -shm files the
        # database's mode, and the database names devices and their keys.
        os.close(os.open(path, os.O_RDWR | os.O_CREAT, 0o600))
        self.lock = threading.Lock()
        self.conn = sqlite3.connect(path, check_same_thread=False, isolation_level=None,
                                    timeout=BUSY_TIMEOUT_S)
        self.conn.execute("PRAGMA journal_mode=WAL")
        self.conn.execute("PRAGMA synchronous=FULL")

    def close(self) -> None:
        with self.lock:
            self.conn.close()

    @contextlib.contextmanager
    def transaction(self, durable: bool = True) -> Iterator[None]:
        """One write transaction under the lock: all of the block's statements or none.

        A durable one is on disk when it returns (synchronous=FULL fsyncs the WAL, and with it
        every transaction before it). A per-device record written at fleet rates (a
        registration, a task report) is not: it survives the coordinator's own crash, as every
        WAL commit does, but an OS crash or power cut may lose it, and losing one is safe (the
        device registers again with the same credential and key; a count is short by one; a
        seat stays taken). An fsync costs ~5 ms on a cloud disk, in the event loop: one per
        registration held a coordinator enrolling 10,000 devices for ~55 s."""
        with self.lock:
            if not durable:
                self.conn.execute("PRAGMA synchronous=NORMAL")
            try:
                self.conn.execute("BEGIN IMMEDIATE")
                try:
                    yield
                    self.conn.execute("COMMIT")
                except BaseException:
                    self.conn.execute("ROLLBACK")
                    raise
            finally:
                if not durable:
                    self.conn.execute("PRAGMA synchronous=FULL")
