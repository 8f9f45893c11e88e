"""Pinning a running server to cores, for benchmarks that charge it one core's worth of work.

``sched_setaffinity`` on a process id moves only that one thread: a server started before it is
pinned (gRPC's pollers and executor, its fronts' threads) keeps every other thread free to run on
any core, and a "one core" figure quietly measures several. Threads inherit their creator's
affinity, so pinning every thread that exists now also pins the ones created later."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import psutil


def _thread_ids(pid: int) -> Iterator[int]:
    """Every thread of process ``pid`` and of its descendants (ones that ended meanwhile skipped)."""
    for process in (psutil.Process(pid), *psutil.Process(pid).children(recursive=True)):
        try:
            yield from (thread.id for thread in process.threads())
        except psutil.NoSuchProcess:
            continue


def pin(pid: int, cores: list[int], passes: int = 5) -> bool:
    """Pin every thread of process ``pid`` and of its descendants to ``cores``; whether every
    thread read back is. A thread started while the others are pinned takes its creator's cores,
    which may not be pinned yet (a gRPC server starts threads as calls come): each pass pins those
    too, until a read-back finds none left or ``passes`` run out."""
    want = set(cores)
    for _ in range(passes):
        for tid in _thread_ids(pid):
            with contextlib.suppress(ProcessLookupError):  # a thread that ended meanwhile
                os.sched_setaffinity(tid, cores)
        if pinned_cores(pid) == want:
            return True
    return False


def pinned_cores(pid: int) -> set[int]:
    """Every core some thread of ``pid`` or of its descendants may run on: what a benchmark
    reports as the server's cores, read back rather than assumed."""
    cores: set[int] = set()
    for tid in _thread_ids(pid):
        with contextlib.suppress(ProcessLookupError):
            cores |= os.sched_getaffinity(tid)
    return cores
