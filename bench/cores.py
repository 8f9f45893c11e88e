"""Pinning a running server to cores, for benchmarks that charge it one core's worth of work.

``sched_setaffinity`` on a process id moves only that one thread: a server started before it is
pinned (gRPC's pollers and executor, its fronts' threads) keeps every other thread free to run on
any core, and a "one core" figure quietly measures several. Threads inherit their creator's
affinity, so pinning every thread that exists now also pins the ones created later."""

from __future__ import annotations

import os

import psutil


def pin(pid: int, cores: list[int]) -> None:
    """Pin every thread of process ``pid`` and of its descendants to ``cores``."""
    for process in (psutil.Process(pid), *psutil.Process(pid).children(recursive=True)):
        try:
            threads = process.threads()
        except psutil.NoSuchProcess:
            continue
        for thread in threads:
            try:
                os.sched_setaffinity(thread.id, cores)
            except ProcessLookupError:  # a thread that ended meanwhile
                continue


def pinned_cores(pid: int) -> set[int]:
    """Every core some thread of ``pid`` or of its descendants may run on: what a benchmark
    reports as the server's cores, read back rather than assumed."""
    cores: set[int] = set()
    for process in (psutil.Process(pid), *psutil.Process(pid).children(recursive=True)):
        for thread in process.threads():
            try:
                cores |= os.sched_getaffinity(thread.id)
            except ProcessLookupError:
                continue
    return cores
