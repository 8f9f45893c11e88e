"""``tally client`` (one device on a dataset shard) and ``tally fleet`` (N simulated devices in
one or several processes), both against a running coordinator."""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
from dataclasses import asdict
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TypeVar

from rich.console import Console

from client_sdk.behaviour import BehaviourProfile
from client_sdk.device import Device, DeviceStats
from client_sdk.device_progress import DeviceProgress, summary
from client_sdk.dropout import DEFAULT_PHASES, DropoutPlan
from client_sdk.enrolment import load_or_create_identity
from client_sdk.fleet import CoordinatorUnreachable, Fleet, FleetStats, device_ids
from client_sdk.fleet_processes import DEVICES_PER_EXTRA_PROCESS, Played, default_processes, run_processes
from client_sdk.fleet_report import write_report
from client_sdk.metrics import ClientMetrics
from client_sdk.sum_audit import MISMATCH, SumAudit, SumCheck, check_committed, outcome_counts
from client_sdk.synthetic import SyntheticUpdates
from client_sdk.timeline import FleetTimeline
from tally import argtypes, logs
from tally.algorithms.base import LocalTrainer
from tally.metrics import MetricsServer, add_metrics_arguments
from tally.secagg import DevicePolicy, ThreatModel
from tally.security import bearer_metadata, load_ticket_public_key
from tally.security.enrolment import read_enrolment_key
from tally.security.tls import add_tls_arguments, open_aio_channel, tls_config_from_args
from tally.wire.v1 import admin_pb2_grpc

DATASETS = ("digits",)

T = TypeVar("T")


def register(sub: argparse._SubParsersAction) -> None:
    c = sub.add_parser(
        "client",
        help="run one device on a shard of a dataset against a coordinator",
        description="Register, check in, train on the shard and take part in secure aggregation.",
    )
    _add_common(c)
    c.add_argument("--device-id", required=True, help="stable id of this device")
    c.add_argument("--shard", type=int, required=True, help="which shard of the split this device holds (0-based)")
    c.add_argument("--shards", type=int, required=True, help="number of shards the dataset is split into")
    c.add_argument("--cache-dir", type=Path, help="keep downloaded models here, by digest")
    c.add_argument("--state-dir", type=Path,
                   help="keep the device's per-job local state (personal layers) here, across restarts")
    c.add_argument("--max-tasks", type=int, help="exit after this many tasks (default: run until interrupted)")
    c.add_argument(
        "--identity", type=Path,
        help="the device's identity key file, created 0600 on first use and kept across restarts "
        "(default: <state-dir>/identity.key with --state-dir, else ~/.tally/<device-id>.identity)",
    )
    c.add_argument("--credential", type=_hex, default=b"", help="enrolment credential from `tally enrol` (hex)")
    c.add_argument(
        "--coordinator-key", type=Path,
        help="pin the coordinator's ticket.pub instead of learning it at registration",
    )
    _add_connect_timeout(c, "the device")
    c.add_argument("--progress", action=argparse.BooleanOptionalAction, default=True,
                   help="a line on stderr when the device connects, ends a task or meets a new error, and a "
                   "summary at the end (the JSON statistics go to stdout either way)")
    c.set_defaults(run=run_client)

    f = sub.add_parser(
        "fleet",
        help="run N simulated devices (load tests, demos)",
        description="Many virtual devices, each a real client with its own stream, in one or several "
        "processes (--processes) of this machine and several machines (--shard).",
    )
    _add_common(f)
    f.add_argument("--devices", type=int, required=True, help="number of simulated devices")
    f.add_argument("--dropout", type=argtypes.FRACTION, default=0.0,
                   help="probability that a device drops in a session, in [0, 1)")
    f.add_argument(
        "--dropout-phases", default=",".join(DEFAULT_PHASES),
        help="comma-separated phases a dropping device leaves in (chosen at random)",
    )
    f.add_argument("--id-prefix", default="sim", help="device ids are <prefix>-<index>")
    f.add_argument("--cache-dir", type=Path, help="model cache shared by the simulated devices")
    f.add_argument("--state-dir", type=Path,
                   help="keep each device's per-job local state in <dir>/<device id>, across restarts")
    until = f.add_mutually_exclusive_group()
    until.add_argument("--max-tasks-per-device", type=int, help="each device stops after this many tasks")
    until.add_argument("--until-job-done", metavar="JOB_ID", help="stop when the coordinator reports the job finished")
    f.add_argument(
        "--shard", type=_shard, default=(0, 1), metavar="I/N",
        help="play only shard I (0-based) of N of the --devices devices, e.g. a Kubernetes indexed "
        "Job's $(JOB_COMPLETION_INDEX)/<completions>; ids, data and seeds follow the device's index in "
        "the whole fleet, so N shards are the same fleet as one process (default: 0/1, all)",
    )
    until.add_argument(
        "--stay", action="store_true",
        help="keep running after the jobs the fleet worked on end (default: exit when every job it "
        "was given tasks of has finished)",
    )
    _add_connect_timeout(f, "no device")
    f.add_argument("--json", type=Path, help="write the fleet's statistics here as JSON")
    f.add_argument(
        "--allow-plain", action="store_true",
        help="let the devices join benchmark-only plain (unmasked) sessions; without it they refuse",
    )
    f.add_argument(
        "--enrolment-key", type=Path,
        help="the coordinator's enrolment.key: the fleet provisions its simulated devices with it",
    )
    f.add_argument(
        "--synthetic", action="store_true",
        help="devices send synthetic updates (deterministic per device, job, round and step; no data, "
        "no training, no torch) instead of training on --dataset: a load test whose every committed "
        "sum can be checked exactly (--audit-token-file)",
    )
    f.add_argument(
        "--audit-token-file", type=Path, metavar="FILE",
        help="with the coordinator's admin token: at the end, check every committed sum the fleet's "
        "devices were in against the inputs they sent; exit 3 on any mismatch",
    )
    f.add_argument(
        "--audit-out", type=Path, metavar="FILE",
        help="write the fingerprints of every input the fleet's devices computed here (JSON), so that the "
        "shards of one fleet can be merged and checked together (bench/fleet.py does)",
    )
    f.add_argument(
        "--report", type=Path, metavar="DIR",
        help="at the end, write DIR/report.json (latency percentiles of every coordinator call and phase as "
        "the devices saw them, check-ins per second, each round's phases, early session ends) and "
        "DIR/report.png",
    )
    f.add_argument(
        "--profile", type=Path, metavar="YAML",
        help="how the devices behave: availability (or a diurnal curve), check-in period and jitter, "
        "compute speed, uplink/downlink bandwidth and latency, dropouts per phase, churn, misbehaviour "
        "(late, duplicated, replayed messages); each device draws its own from (--seed, its id). "
        "See client_sdk/behaviour.py and examples/fleet/profile.yaml",
    )
    f.add_argument(
        "--processes", type=argtypes.integer(1), metavar="P",
        help="play this shard's devices in P processes (process p plays sub-shard I*P+p of N*P; each "
        "serves its own metrics on --metrics-port + p); default: one per core this process may use "
        f"(affinity and cgroup CPU limit), at most one per {DEVICES_PER_EXTRA_PROCESS} devices",
    )
    f.add_argument("--progress", action=argparse.BooleanOptionalAction, default=True, help="live progress display")
    f.set_defaults(run=run_fleet)


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--coordinator", required=True, metavar="ADDR", help="coordinator host:port")
    p.add_argument("--population", default="default", help="population (fleet) the devices belong to")
    p.add_argument("--dataset", choices=DATASETS, default="digits", help="bundled dataset to train on")
    p.add_argument("--alpha", type=float, default=0.5, help="Dirichlet label skew of the split (smaller: more skew)")
    p.add_argument("--seed", type=int, default=0, help="seed of the split, the training order and the encoding")
    p.add_argument("--model", default="mlp", metavar="KIND",
                   help="model kind the devices train (must match the job's model.kind): mlp, cnn, or "
                   "one of a --model-plugin's (default: %(default)s)")
    p.add_argument("--model-plugin", action="append", default=[], metavar="MODULE",
                   help="import this module's TALLY_MODELS, as the coordinator does (repeatable)")
    p.add_argument("--hidden", type=int, default=64,
                   help="hidden units of the mlp, channels of the cnn (must match the job's model)")
    p.add_argument(
        "--min-noise-multiplier", type=_non_negative, default=0.0, metavar="Z",
        help="refuse any sum whose differential-privacy noise is below multiplier Z: it must be "
        "distributed noise that the device adds its own share of (default: 0, no floor)")
    p.add_argument(
        "--semi-honest-server", action="store_true",
        help="trust the aggregator not to lie about who survived: also join sessions without the "
        "consistency check (benchmarks, trusted deployments; a lying aggregator could then read one "
        "device's input). Without it the devices refuse such sessions")
    add_metrics_arguments(p, "client", optional=True)
    p.add_argument("--log-level", default="warning", help="structured JSON logs on stderr at this level")
    add_tls_arguments(p, identity=None)  # the CA only: a device presents no certificate


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


def _non_negative(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def _hex(text: str) -> bytes:
    try:
        return bytes.fromhex(text)
    except ValueError:
        raise argparse.ArgumentTypeError("not hexadecimal") from None


def _shard(text: str) -> tuple[int, int]:
    index, sep, count = text.partition("/")
    try:
        i, n = int(index), int(count)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected I/N, e.g. 0/4") from None
    if not sep or n < 1 or not 0 <= i < n:
        raise argparse.ArgumentTypeError(f"{text!r}: expected I/N with 0 <= I < N")
    return i, n


def _trainers(args: argparse.Namespace, shards: int) -> list[LocalTrainer]:
    """Raises ValueError naming --model or --model-plugin when the model cannot be built.
    Torch is imported here, not at start: a synthetic fleet never loads it."""
    from tally import data, models
    from tally.training import TorchTrainer, single_threaded

    single_threaded()  # many small models: one torch thread each beats thread handoffs
    models.load_plugins(args.model_plugin)
    if args.model not in models.kinds():
        raise ValueError(f"--model: {args.model!r} is not one of {list(models.kinds())}")
    fed = data.digits(shards, alpha=args.alpha, seed=args.seed)
    factory = lambda: models.build(args.model, fed.num_features, fed.num_classes, args.hidden, args.seed)  # noqa: E731
    return [TorchTrainer(factory, X, y, seed=args.seed + i) for i, (X, y) in enumerate(fed.clients)]


def _add_connect_timeout(parser: argparse.ArgumentParser, who: str) -> None:
    parser.add_argument(
        "--connect-timeout", type=float, default=30.0, metavar="SECONDS",
        help=f"exit with an error if {who} reaches the coordinator within this time "
        "(default: %(default)s; 0: wait forever)",
    )


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
        trainer = _trainers(args, args.shards)[args.shard]
    except ValueError as exc:
        print(exc, file=sys.stderr)
        return 2
    logs.configure(args.log_level)
    metrics = ClientMetrics()
    device = Device(
        args.coordinator,
        tls_config_from_args(args),
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
        audit_token = _load("--audit-token-file", _read_token, args.audit_token_file) if args.audit_token_file else None
        if args.enrolment_key:
            _load("--enrolment-key", read_enrolment_key, args.enrolment_key)
        if args.profile:
            _load("--profile", BehaviourProfile.load, args.profile)
    except ValueError as exc:
        print(exc, file=sys.stderr)
        return 2
    console = Console(stderr=True)
    first, end = _block(args.devices, shard, shards)
    processes = args.processes or default_processes(end - first)
    played = run_processes(args, processes, _play, console) if processes > 1 else _play(args, None)
    code, stats, audit = played.code, played.stats, played.audit
    if stats is None:
        return code
    console.print(f"fleet of {stats.devices}: {stats.summary()} in {stats.elapsed_seconds:.1f} s")
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
    phases = tuple(p.strip() for p in args.dropout_phases.split(",") if p.strip())
    plan = DropoutPlan(args.dropout, phases, seed=args.seed) if args.dropout > 0 else None
    console = Console(stderr=True)
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
        metrics=ClientMetrics(FleetTimeline(args.seed) if args.report is not None else None),
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
    return Played(0, stats, SumAudit.of(fleet.inputs) if fleet.inputs is not None else None,
                  fleet.metrics.timeline)


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
