"""What ``tally client`` does (its flags are in ``tally.cli.client``), and what ``tally fleet``
(``tally.cli.fleet_run``) shares with it: a device's trainers, policy, metrics and signals."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

import grpc

from tally import logs
from tally.cli import exit_codes
from tally.client.device import Device, DeviceStats
from tally.client.device_progress import DeviceProgress, summary
from tally.client.enrolment import load_or_create_identity
from tally.client.metrics import ClientMetrics
from tally.client.privacy_ledger import PrivacyBudget, PrivacyLedgerError
from tally.client.retry import CoordinatorUnreachable
from tally.metrics import MetricsServer
from tally.secagg import DevicePolicy, ThreatModel
from tally.security import load_ticket_public_key
from tally.security.tls import tls_config_from_args
from tally.shutdown import stop_on_signals

if TYPE_CHECKING:  # torch: imported when the devices are built
    from tally.training.bundled import BundledDevice

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


def privacy_budget(args: argparse.Namespace) -> PrivacyBudget | None:
    """The budget of --max-epsilon and --delta (None without one); ValueError naming the flag."""
    if args.max_epsilon is None:
        return None
    try:
        return PrivacyBudget(args.max_epsilon, args.delta, args.budget_scope, args.budget_accountant)
    except ValueError as exc:
        raise ValueError(f"--max-epsilon/--delta: {exc}") from None


def _load(flag: str, load: Callable[[Path], T], path: Path) -> T:
    """``load(path)``, with a failure turned into a ValueError naming the flag."""
    try:
        return load(path)
    except (OSError, ValueError) as exc:
        raise ValueError(f"{flag} {path}: {getattr(exc, 'strerror', None) or exc}") from None


def _trainers(args: argparse.Namespace, shards: int) -> list[BundledDevice]:
    """Each shard's device; each builds the trainer a job needs from the job (its model and
    algorithm), ``--model``/``--hidden`` overriding the model read. Raises ValueError naming
    --model or --model-plugin when they name no model. Torch is imported here, not at start: a
    synthetic fleet never loads it."""
    from tally import models
    from tally.datasets.digits import digits
    from tally.training import single_threaded
    from tally.training.bundled import BundledDevice

    single_threaded()  # many small models: one torch thread each beats thread handoffs
    models.load_plugins(args.model_plugin)
    if args.model is not None and args.model not in models.kinds():
        raise ValueError(f"--model: {args.model!r} is not one of {list(models.kinds())}")
    fed = digits(shards, alpha=args.alpha, seed=args.seed)
    return [BundledDevice(X, y, i, args.seed + i, classes=fed.num_classes, kind=args.model, hidden=args.hidden)
            for i, (X, y) in enumerate(fed.clients)]


async def _run_device(
    device: Device, stop: asyncio.Event, max_tasks: int | None, connect_timeout: float, task_timeout: float = 0.0
) -> tuple[DeviceStats, dict[str, str]]:
    """``device.run``, given up with ``CoordinatorUnreachable`` when it has not checked in once
    within ``connect_timeout`` seconds (0: never given up), rather than retrying in silence, and
    stopped when no task has come within ``task_timeout`` seconds (0: no limit); then the states
    of the jobs it served."""
    started = time.monotonic()
    running = asyncio.ensure_future(device.run(stop, max_tasks))
    if connect_timeout > 0:
        done, _ = await asyncio.wait({running}, timeout=connect_timeout)
        if not done and device.stats.checkins == 0:
            stop.set()
            await running
            raise CoordinatorUnreachable.after("the device did not reach", device.coordinator, connect_timeout,
                                               device.stats.last_error)
    if task_timeout > 0:
        await asyncio.wait({running}, timeout=max(task_timeout - (time.monotonic() - started), 0.0))
        if not running.done() and not device.stats.jobs:
            stop.set()
    stats = await running
    stop.set()  # asking after the jobs: a call that fails is not retried
    return stats, await device.job_states(stats.jobs)


def verdict(command: str, job_states: dict[str, str], failures: dict[str, dict[str, int]], no_task: str) -> int:
    """Print why the command fails, if it does, and return its exit status: a job it served
    FAILED (``exit_codes.JOB_FAILED``), or ``no_task`` ("within 60 s") says no task ever came
    (``exit_codes.NO_TASK``); else 0."""
    failed = exit_codes.failed_jobs(job_states, failures)
    if failed:
        for line in failed.splitlines():
            print(f"tally {command}: {line}", file=sys.stderr)
        return exit_codes.JOB_FAILED
    if no_task:
        print(f"tally {command}: no task came {no_task}: is a job of the population running, and does it have "
              "enough devices for its min_cohort? (`tally job status`)", file=sys.stderr)
        return exit_codes.NO_TASK
    return exit_codes.OK


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
        budget = privacy_budget(args)
    except ValueError as exc:
        print(exc, file=sys.stderr)
        return 2
    logs.configure(args.log_level)
    metrics = ClientMetrics()
    try:
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
            privacy_budget=budget,
        )
    except PrivacyLedgerError as exc:  # never reset: the operator decides
        print(f"tally client: {exc}", file=sys.stderr)
        return 2
    try:
        with _metrics_server(args, metrics):
            stats, job_states = _run_until_signal(
                lambda stop: _run_device(device, stop, args.max_tasks, args.connect_timeout, args.task_timeout))
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
    gave_up = args.task_timeout > 0 and not stats.jobs
    return verdict("client", job_states, stats.failures, f"within {args.task_timeout:g} s" if gave_up else "")


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
        return await main(stop_on_signals())

    return asyncio.run(runner())
