"""What ``tally fleet`` does (its flags are in ``tally.cli.client``): the load tester's command,
apart from ``tally client`` (``tally.cli.client_run``) so that one device needs none of it."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import Callable
from pathlib import Path

from tally import logs
from tally.cli.client_run import _load, _metrics_server, _policy, _run_until_signal, _trainers, privacy_budget, verdict
from tally.cli.console import console as cli_console
from tally.client.privacy_ledger import PrivacyLedgerError
from tally.client.retry import CoordinatorUnreachable
from tally.loadtest.behaviour import BehaviourProfile
from tally.loadtest.dropout import DEFAULT_PHASES, DropoutPlan
from tally.loadtest.fleet import Fleet, FleetStats, device_ids
from tally.loadtest.processes import Played, default_processes, run_processes
from tally.loadtest.report import write_report
from tally.loadtest.sum_audit import MISMATCH, SumAudit, SumCheck, check_committed, outcome_counts
from tally.loadtest.synthetic import SyntheticUpdates
from tally.loadtest.timeline import FleetTimeline, TimelineMetrics
from tally.security import bearer_metadata
from tally.security.enrolment import read_enrolment_key
from tally.security.tls import open_aio_channel, tls_config_from_args
from tally.wire.v1 import admin_pb2_grpc


def run_fleet(args: argparse.Namespace) -> int:
    shard, shards = args.shard
    if args.devices < shards:
        print(f"--devices must be at least the number of shards ({shards})", file=sys.stderr)
        return 2
    try:
        # Read before any process starts: a bad file is one message, not one per process.
        tls_config_from_args(args)
        audit_token = _load("--audit-token-file", _read_token, args.audit_token_file) if args.audit_token_file else None
        if args.enrolment_key:
            _load("--enrolment-key", read_enrolment_key, args.enrolment_key)
        if args.profile:
            _load("--profile", BehaviourProfile.load, args.profile)
    except ValueError as exc:
        print(exc, file=sys.stderr)
        return 2
    console = cli_console(stderr=True)
    first, end = _block(args.devices, shard, shards)
    processes = args.processes or default_processes(end - first)
    played = run_processes(args, processes, _play, console) if processes > 1 else _play(args, None)
    code, stats, audit = played.code, played.stats, played.audit
    if stats is None:
        return code
    console.print(f"fleet of {stats.devices}: {stats.summary()} in {stats.elapsed_seconds:.1f} s")
    if stats.refused:
        console.print(f"tally fleet: {stats.refusal_message()}")
        code = code or 1
    result = stats.to_dict()
    if args.audit_out is not None and audit is not None:
        args.audit_out.parent.mkdir(parents=True, exist_ok=True)
        args.audit_out.write_text(json.dumps(audit.to_json()))
    if audit_token is not None and audit is not None:
        checks = asyncio.run(_audit(args, audit_token, audit))
        result["audit"] = outcome_counts(checks)
        console.print("sum audit: " + ", ".join(f"{k} {v}" for k, v in result["audit"].items())
                      + " cohort sums (foreign: holds devices of another shard)")
        code = code or (3 if result["audit"][MISMATCH] else 0)
    if args.report is not None and played.timeline is not None:
        written = write_report(played.timeline, stats, args.report)
        console.print("report: " + ", ".join(str(p) for p in written))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2))
        console.print(f"statistics written to {args.json}")
    return code or verdict("fleet", stats.job_states, stats.failures, _no_task(stats, args.population, shards))


def _no_task(stats: FleetStats, population: str, shards: int) -> str:
    """When no device was ever given a task: how long the fleet waited ("within 60 s"), or that
    its population's jobs ended first; "" otherwise. One shard of several may go unselected by
    design, so only a whole fleet counts an ended population against itself."""
    if stats.jobs:
        return ""
    if stats.no_task_within_s:
        return f"within {stats.no_task_within_s:g} s"
    return f"before the jobs of population {population!r} ended" if stats.jobs_over and shards == 1 else ""


def _block(devices: int, shard: int, shards: int) -> tuple[int, int]:
    """Shard I of N plays a contiguous block of the one split of ``devices``, so N processes
    together are the same fleet as one."""
    return shard * devices // shards, (shard + 1) * devices // shards


def _play(args: argparse.Namespace, on_stats: Callable[[FleetStats], None] | None) -> Played:
    """Run this process's block of the fleet."""
    first, end = _block(args.devices, *args.shard)
    try:
        enrolment_key = _load("--enrolment-key", read_enrolment_key, args.enrolment_key) if args.enrolment_key else None
        profile = _load("--profile", BehaviourProfile.load, args.profile) if args.profile else None
        budget = privacy_budget(args)
        trainers = (
            [SyntheticUpdates(i, args.seed) for i in device_ids(args.id_prefix, end - first, first)]
            if args.synthetic else _trainers(args, args.devices)[first:end]
        )
    except ValueError as exc:
        print(exc, file=sys.stderr)
        return Played(2)
    logs.configure(args.log_level)
    phases = (tuple(p.strip() for p in args.dropout_phases.split(",") if p.strip()) if args.dropout_phases
              else DEFAULT_PHASES)
    plan = DropoutPlan(args.dropout, phases, seed=args.seed) if args.dropout > 0 else None
    console = cli_console(stderr=True)
    timeline = FleetTimeline(args.seed) if args.report is not None else None
    try:
        fleet = Fleet(
            args.coordinator,
            tls_config_from_args(args),
            trainers,
            dropout=plan,
            population=args.population,
            seed=args.seed,
            cache_dir=args.cache_dir,
            state_dir=args.state_dir,
            id_prefix=args.id_prefix,
            first_index=first,
            audit=args.synthetic or args.audit_token_file is not None or args.audit_out is not None,
            device_policy=_policy(args, allow_plain=args.allow_plain),
            enrolment_key=enrolment_key,
            profile=profile,
            ramp_s=args.ramp,
            metrics=TimelineMetrics(timeline) if timeline is not None else None,
            privacy_budget=budget,
        )
    except PrivacyLedgerError as exc:  # a device's ledger that does not parse: never reset, the operator decides
        print(f"tally fleet: {exc}", file=sys.stderr)
        return Played(2)
    if args.until_job_done:
        until = fleet.until_job_done(args.until_job_done)
    else:
        until = None if args.stay or args.max_tasks_per_device else fleet.until_jobs_done()
    try:
        with _metrics_server(args, fleet.metrics):
            stats = _run_until_signal(
                lambda stop: fleet.run(
                    stop, until, max_tasks_per_device=args.max_tasks_per_device,
                    progress=args.progress, console=console,
                    connect_timeout=args.connect_timeout or None, task_timeout=args.task_timeout or None,
                    on_stats=on_stats,
                )
            )
    except CoordinatorUnreachable as exc:
        console.print(f"tally fleet: {exc}")
        return Played(1)
    finally:
        fleet.close()
    return Played(0, stats, SumAudit.of(fleet.inputs) if fleet.inputs is not None else None, timeline)


def _read_token(path: Path) -> str:
    token = path.read_text().strip()
    if not token:
        raise ValueError("the file is empty")
    return token


async def _audit(args: argparse.Namespace, token: str, audit: SumAudit) -> list[SumCheck]:
    channel = open_aio_channel(args.coordinator, tls_config_from_args(args))
    try:
        return await check_committed(admin_pb2_grpc.AdminStub(channel), bearer_metadata(token), audit)
    finally:
        await channel.close()
