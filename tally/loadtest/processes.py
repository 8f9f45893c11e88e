"""``tally fleet --processes P``: one fleet spread over P processes of one machine.

A single Python process plays at most one core's worth of devices (the event loop, protobuf and the
mask generation all hold the GIL), so a load tester with more cores than that gets more devices
per machine only from more processes. Process p of shard I/N plays shard I*P+p of N*P: the blocks
of the P processes tile shard I exactly, so device ids, data and seeds are those a single process
would use, and the P processes are the same fleet.

The children report their statistics to this process over a queue (a live, fleet-wide progress
line); at the end each writes its statistics and input fingerprints to a file here, and this
process merges them, so ``--json``, ``--audit-out`` and ``--audit-token-file`` mean what they mean
for one process. SIGINT and SIGTERM are passed on, so the devices leave cleanly.
"""

from __future__ import annotations

import argparse
import functools
import json
import multiprocessing
import os
import queue
import signal
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console

from tally.loadtest.fleet import FleetStats, progress_display
from tally.loadtest.sum_audit import SumAudit
from tally.loadtest.timeline import FleetTimeline

# Below this many devices one process keeps up: more would only pay for their start-up.
DEVICES_PER_EXTRA_PROCESS = 200


def available_cores() -> int:
    """Cores this process may use: its CPU affinity, capped by a cgroup v2 CPU quota (a
    Kubernetes CPU limit), which ``os.cpu_count`` does not see."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()
        if quota != "max":
            cores = min(cores, max(1, int(int(quota) // int(period))))
    except (OSError, ValueError):
        pass
    return cores


def default_processes(devices: int) -> int:
    """One per core, but one for every ``DEVICES_PER_EXTRA_PROCESS`` devices at most."""
    return max(1, min(available_cores(), devices // DEVICES_PER_EXTRA_PROCESS))


@dataclass
class Played:
    """What playing (part of) a fleet gave: its exit code; statistics (None when it could not
    start); the fingerprints of its devices' inputs when auditing; its report's timeline."""

    code: int
    stats: FleetStats | None = None
    audit: SumAudit | None = None
    timeline: FleetTimeline | None = None


Play = Callable[[argparse.Namespace, Callable[[FleetStats], None] | None], Played]


def run_processes(args: argparse.Namespace, processes: int, play: Play, console: Console) -> Played:
    """Play ``args``' shard in ``processes`` child processes, each calling ``play`` on its part;
    returns what ``play`` would for one process, merged."""
    context = multiprocessing.get_context("spawn")  # never fork a process that may hold threads
    reports: Any = context.Queue()
    with tempfile.TemporaryDirectory(prefix="tally-fleet-") as tmp:
        parts = [_part(args, processes, p, Path(tmp)) for p in range(processes)]
        children = [context.Process(target=_child, args=(play, part, p, reports), name=f"tally-fleet-{p}")
                    for p, part in enumerate(parts)]
        for child in children:
            child.start()
        latest: dict[int, FleetStats] = {}
        previous = {sig: signal.signal(sig, _forward(children)) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            with progress_display(args.progress, console, None) as show:
                while any(child.is_alive() for child in children) or not reports.empty():
                    try:
                        p, stats = reports.get(timeout=0.5)
                    except queue.Empty:
                        continue
                    latest[p] = stats
                    show(FleetStats.combine(list(latest.values())))
            for child in children:
                child.join()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        failed = [(p, c.exitcode) for p, c in enumerate(children) if c.exitcode != 0]
        for p, code in failed:
            console.print(f"tally fleet: process {p} of {processes} exited with status {code}")
        stats = [FleetStats(**json.loads(part.json.read_text())) for part in parts if part.json.exists()]
        audits = [SumAudit.from_json(json.loads(part.audit_out.read_text()))
                  for part in parts if part.audit_out is not None and part.audit_out.exists()]
        timelines = [FleetTimeline.from_json(json.loads(part.report.read_text()))
                     for part in parts if part.report is not None and part.report.exists()]
    code = max((code if code and code > 0 else 1 for _, code in failed), default=0)
    return Played(code, FleetStats.combine(stats) if stats else None,
                  functools.reduce(SumAudit.merge, audits) if audits else None,
                  functools.reduce(FleetTimeline.merge, timelines) if timelines else None)


def _part(args: argparse.Namespace, processes: int, p: int, tmp: Path) -> argparse.Namespace:
    """Process p's arguments: its sub-shard, its own files, its own metrics port (port + p, or
    an ephemeral one), no display, audit or report of its own (the parent's are whole); its
    ``report`` is where it leaves its timeline."""
    shard, shards = args.shard
    auditing = args.audit_out is not None or args.audit_token_file is not None or args.synthetic
    metrics_port = args.metrics_port + p if args.metrics_port else args.metrics_port
    return argparse.Namespace(**{
        **vars(args), "shard": (shard * processes + p, shards * processes), "processes": 1,
        "progress": False, "json": tmp / f"stats-{p}.json", "audit_token_file": None,
        "audit_out": tmp / f"audit-{p}.json" if auditing else None, "metrics_port": metrics_port,
        "report": tmp / f"timeline-{p}.json" if args.report is not None else None,
    })


def _child(play: Play, args: argparse.Namespace, p: int, reports: Any) -> None:
    last = [0.0]

    def report(stats: FleetStats) -> None:
        if time.monotonic() - last[0] >= 0.5:
            last[0] = time.monotonic()
            reports.put((p, stats))

    played = play(args, report)
    if played.stats is not None:
        reports.put((p, played.stats))
        args.json.write_text(json.dumps(played.stats.to_dict()))
    if played.audit is not None and args.audit_out is not None:
        args.audit_out.write_text(json.dumps(played.audit.to_json()))
    if played.timeline is not None and args.report is not None:
        args.report.write_text(json.dumps(played.timeline.to_json()))
    raise SystemExit(played.code)


def _forward(children: list) -> Callable[[int, object], None]:
    def handler(signum: int, frame: object) -> None:
        for child in children:
            if child.is_alive() and child.pid is not None:
                os.kill(child.pid, signal.SIGTERM)

    return handler
