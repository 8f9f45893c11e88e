"""What ``tally client`` and ``tally fleet`` do (their flags are in ``tally.cli.client``)."""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
from collections.abc import Awaitable, Callable
from dataclasses import asdict
from pathlib import Path
from typing import TypeVar

import grpc

from tally import logs
from tally.algorithms.base import LocalTrainer
from tally.cli.console import console as cli_console
from tally.loadtest.behaviour import BehaviourProfile
from tally.client.device import Device, DeviceStats
from tally.client.device_progress import DeviceProgress, summary
from tally.loadtest.dropout import DEFAULT_PHASES, DropoutPlan
from tally.client.enrolment import load_or_create_identity
from tally.loadtest.fleet import CoordinatorUnreachable, Fleet, FleetStats, device_ids
from tally.loadtest.processes import Played, default_processes, run_processes
from tally.loadtest.report import write_report
from tally.client.metrics import ClientMetrics
from tally.loadtest.sum_audit import MISMATCH, SumAudit, SumCheck, check_committed, outcome_counts
from tally.loadtest.synthetic import SyntheticUpdates
from tally.loadtest.timeline import FleetTimeline, TimelineMetrics
from tally.metrics import MetricsServer
from tally.secagg import DevicePolicy, ThreatModel
from tally.security import bearer_metadata, load_ticket_public_key
from tally.security.enrolment import read_enrolment_key
from tally.security.tls import open_aio_channel, tls_config_from_args
from tally.wire.v1 import admin_pb2_grpc

T = TypeVar("T")


def _identity_path(args: argparse.Namespace) -> Path:
    """Where the device's identity key lives: given, else beside the rest of its state (a device
    given a state directory writes nothing outside it), else in the user's ~/.tally."""
    if args.identity is not None:
        return args.identity
    if args.state_dir is not None:
        return args.state_dir / "identity.key"
    return Path.home() / ".tally" / f"{args.device_id}.identity"


def _policy(args: argparse.Namespace, allow_plain: bool = False) -> DevicePolicy:
    """What the devices accept, from their flags: by default a malicious server (the consistency
    check required), ``--semi-honest-server`` a trusted one."""
    threat = ThreatModel(dropout_rate=0.0, malicious_server=not args.semi_honest_server)
    return DevicePolicy(threat=threat, allow_plain=allow_plain, min_noise_multiplier=args.min_noise_multiplier)


def _load(flag: str, load: Callable[[Path], T], path: Path) -> T:
    """``load(path)``, with a failure turned into a ValueError naming the flag."""
    try:
        return load(path)
    except (OSError, ValueError) as exc:
        raise ValueError(f"{flag} {path}: {getattr(exc, 'strerror', None) or exc}") from None


def _trainers(args: argparse.Namespace, shards: int) -> list[LocalTrainer]:
    """Raises ValueError naming --model or --model-plugin when the model cannot be built.
    Torch is imported here, not at start: a synthetic fleet never loads it."""
    from tally import models
    from tally.datasets.digits import digits
    from tally.training import TorchTrainer, single_threaded

    single_threaded()  # many small models: one torch thread each beats thread handoffs
    models.load_plugins(args.model_plugin)
    if args.model not in models.kinds():
        raise ValueError(f"--model: {args.model!r} is not one of {list(models.kinds())}")
    fed = digits(shards, alpha=args.alpha, seed=args.seed)
    factory = lambda: models.build(args.model, fed.num_features, fed.num_classes, args.hidden, args.seed)  # noqa: E731
    return [TorchTrainer(factory, X, y, seed=args.seed + i) for i, (X, y) in enumerate(fed.clients)]


async def _run_device(device: Device, stop: asyncio.Event, max_tasks: int | None, connect_timeout: float) -> DeviceStats:
    """``device.run``, given up with ``CoordinatorUnreachable`` when it has not checked in once
    within ``connect_timeout`` seconds (0: never given up), rather than retrying in silence."""
    running = asyncio.ensure_future(device.run(stop, max_tasks))
    if connect_timeout > 0:
        done, _ = await asyncio.wait({running}, timeout=connect_timeout)
        if not done and device.stats.checkins == 0:
            stop.set()
            await running
            raise CoordinatorUnreachable.after("the device did not reach", device.coordinator, connect_timeout,
                                               device.stats.last_error)
    return await running


def run_client(args: argparse.Namespace) -> int:
    if not 0 <= args.shard < args.shards:
        print(f"--shard must be in 0..{args.shards - 1}", file=sys.stderr)
        return 2
    try:
        identity = _load("--identity", load_or_create_identity, _identity_path(args))
        coordinator_key = (
            _load("--coordinator-key", load_ticket_public_key, args.coordinator_key).public_bytes_raw()
            if args.coordinator_key else None
        )
        tls = tls_config_from_args(args)
        trainer = _trainers(args, args.shards)[args.shard]
    except ValueError as exc:
        print(exc, file=sys.stderr)
        return 2
    logs.configure(args.log_level)
    metrics = ClientMetrics()
    device = Device(
        args.coordinator,
        tls,
        args.device_id,
        trainer,
        population=args.population,
        cache_dir=args.cache_dir,
        state_dir=args.state_dir,
        rng_seed=args.seed,
        metrics=metrics,
        identity=identity,
        enrolment_credential=args.credential,
        coordinator_key=coordinator_key,
        policy=_policy(args),
        on_update=DeviceProgress(args.device_id, args.coordinator) if args.progress else None,
    )
    try:
        with _metrics_server(args, metrics):
            stats = _run_until_signal(lambda stop: _run_device(device, stop, args.max_tasks, args.connect_timeout))
    except CoordinatorUnreachable as exc:
        print(f"tally client: {exc}", file=sys.stderr)
        return 1
    except grpc.aio.AioRpcError as exc:
        print(f"tally client: the coordinator refused the device ({exc.code().name}: {exc.details()}); "
              "retrying cannot fix that", file=sys.stderr)
        return 1
    except PermissionError as exc:
        print(f"tally client: {exc}", file=sys.stderr)
        return 1
    if args.progress:
        print(f"tally client: {summary(stats)}", file=sys.stderr)
    print(json.dumps(asdict(stats)))
    return 0


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
    return code


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
    )
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
                    connect_timeout=args.connect_timeout or None, on_stats=on_stats,
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


class _metrics_server:
    """Serve ``metrics`` while the block runs, when ``--metrics-port`` was given."""

    def __init__(self, args: argparse.Namespace, metrics: ClientMetrics) -> None:
        self.server = MetricsServer(metrics.registry) if args.metrics_port is not None else None
        self.port, self.addr = args.metrics_port, args.metrics_addr

    def __enter__(self) -> _metrics_server:
        if self.server is not None:
            try:
                bound = self.server.start(self.port, self.addr)
            except OSError as exc:  # the port is taken, or the address is not this host's
                raise SystemExit(f"--metrics-port: {exc}") from None
            print(f"metrics on http://{self.addr}:{bound}/metrics", file=sys.stderr)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.server is not None:
            self.server.stop()


def _run_until_signal(main: Callable[[asyncio.Event], Awaitable[T]]) -> T:
    """Run ``main(stop)``; SIGINT/SIGTERM set ``stop`` so devices leave cleanly."""

    async def runner() -> T:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        return await main(stop)

    return asyncio.run(runner())
