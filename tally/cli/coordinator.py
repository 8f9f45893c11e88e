"""``tally coordinator``: run the service (``tally job``, which operates it, is ``tally.cli.job``)."""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import logging
import os
import shutil
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from tally import logs
from tally.cli import argtypes, job
from tally.cli.argtypes import add_metrics_arguments
from tally.cli.job import DEFAULT_ADDRESS
from tally.coordinator.faces.admin_token import ADMIN_TOKEN_FILE
from tally.coordinator.faces.ratelimit import (
    DEFAULT_CHECKIN_LIMIT,
    DEFAULT_MAX_REQUEST_BYTES,
    DEFAULT_REGISTER_LIMIT,
    RateLimit,
)
from tally.coordinator.rounds.aggregators import parse_aggregator
from tally.coordinator.rounds.experiment_tracking import default_uri
from tally.coordinator.state.database import is_postgres_url
from tally.coordinator.state.leadership import DEFAULT_LEASE_S
from tally.security.tls import add_tls_arguments, tls_config_from_args
from tally.shutdown import stop_on_signals

if TYPE_CHECKING:  # the service and job specs import torch: `--help` must not wait for it
    from tally.coordinator.replica import Replica
    from tally.coordinator.service import CoordinatorService
    from tally.coordinator.spec.jobspec import JobSpec

log = logging.getLogger(__name__)

DATABASE_ENV = "TALLY_DATABASE_URL"
DEFAULT_INTERNAL_LISTEN = "0.0.0.0:7010"


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "coordinator", help="run the coordinator service",
        description="Owns jobs and rounds: check-in, selection, cohorts across the aggregators, the "
        "algorithm's server half on cohort sums, checkpoints; resumes unfinished jobs on start.",
    )
    p.add_argument(
        "--listen", default=DEFAULT_ADDRESS, help="HOST:PORT to serve devices and operators on (default: %(default)s)"
    )
    p.add_argument(
        "--state-dir", type=Path, required=True, help="SQLite database, checkpoints and admin.token"
    )
    p.add_argument(
        "--aggregator", action="append", default=[], type=_aggregator, metavar="ID=HOST:PORT",
        help="an aggregator's control endpoint (repeatable)",
    )
    p.add_argument(
        "--aggregator-template", type=_aggregator_template, metavar="ID=HOST:PORT",
        help="aggregators 0 .. --aggregator-count - 1, '{i}' standing for the number, e.g. a "
        "StatefulSet behind a headless Service: 'tally-aggregator-{i}=tally-aggregator-{i}."
        "tally-aggregator.NAMESPACE.svc:7002'; those not running are skipped until they answer "
        "health checks, so the count may be an autoscaler's maximum",
    )
    p.add_argument(
        "--aggregator-count", type=int, default=1, metavar="N",
        help="how many aggregators --aggregator-template names (default: %(default)s)",
    )
    p.add_argument(
        "--jobs-dir", type=Path, metavar="DIR",
        help="submit each *.yaml job spec in DIR (e.g. a mounted ConfigMap) whose job name has no "
        "job yet, at every start; every spec is checked before the service starts",
    )
    p.add_argument(
        "--secrets-dir", type=Path,
        help="where token.secret, ticket.key and enrolment.key live (default: --tls-dir, else --state-dir)",
    )
    add_metrics_arguments(p, "coordinator")
    p.add_argument("--max-message-bytes", type=int, default=64 << 20, help="largest gRPC message sent")
    p.add_argument(
        "--max-request-bytes", type=int, default=DEFAULT_MAX_REQUEST_BYTES,
        help="largest request accepted, from devices and operators alike (default: %(default)s)",
    )
    for flag, rpc, default in (("register", "Register", DEFAULT_REGISTER_LIMIT),
                               ("checkin", "CheckIn", DEFAULT_CHECKIN_LIMIT)):
        p.add_argument(
            f"--{flag}-limit", type=_rate_limit, default=default, metavar="RATE/BURST",
            help=f"per-source rate limit of {rpc} calls, per second and burst "
            f"(default: {default.rate_per_s:g}/{default.burst:g})",
        )
    argtypes.add_connection_arguments(p)
    p.add_argument(
        "--checkin-rate", type=argtypes.POSITIVE, metavar="PER_SECOND",
        help="pace steering: check-ins per second the whole fleet should make; devices turned away "
        "are given come-back times spaced so arrivals stay at this rate however large the "
        "population (default: no pacing, come back when the next round is likely to start)",
    )
    p.add_argument(
        "--checkin-hold", type=float, default=20.0,
        help="longest a check-in is held while a selection fills, or while a round aggregates for "
        "the next round's selection (s)",
    )
    p.add_argument(
        "--device-processes", type=argtypes.integer(1, 256), default=1, metavar="N",
        help="serve devices from N processes on the one port (SO_REUSEPORT): N - 1 device fronts "
        "answer registrations and idle check-ins themselves and pass every other call to this "
        "process, which alone plans rounds; give it as many as the cores the coordinator may use "
        "(default: %(default)s)",
    )
    p.add_argument(
        "--front-metrics-port", type=argtypes.integer(0, 65535), default=0, metavar="PORT",
        help="device front i (1 .. N - 1) serves /metrics on PORT + i - 1, on --metrics-addr "
        "(default: 0, an ephemeral port each, logged when the front starts)",
    )
    p.add_argument(
        "--database", default=os.environ.get(DATABASE_ENV), metavar="URL",
        help="run as one of several replicas over this PostgreSQL database (postgresql://USER@HOST/DB; "
        f"give the password in ${DATABASE_ENV} or a .pgpass file, not on the command line, which "
        "other local users can read): the replica holding the lead plans rounds, the others serve "
        "registrations and idle check-ins and forward the rest to it, taking over when it goes "
        f"(default: ${DATABASE_ENV}, else none: SQLite in --state-dir, one coordinator)",
    )
    p.add_argument(
        "--database-file", type=Path, metavar="PATH",
        help="read --database's URL from this file (a mounted Secret: a password in a file, not in the "
        "environment of every process the container starts)",
    )
    p.add_argument(
        "--internal-listen", default=DEFAULT_INTERNAL_LISTEN, metavar="HOST:PORT",
        help="with --database: where the other replicas' device fronts reach this one while it "
        "leads (TLS, and only callers with the fronts' key) (default: %(default)s)",
    )
    p.add_argument(
        "--leader-lease", type=argtypes.number(2.0), default=DEFAULT_LEASE_S, metavar="SECONDS",
        help="with --database: how long the lead lasts unrenewed (at least 2: the leader renews it each second); a "
        "leader stopped without its connection ending (SIGSTOP, a frozen VM) is replaced after this, and "
        "its writes are refused once another leads (default: %(default)s)",
    )
    p.add_argument(
        "--advertise", metavar="HOST",
        help="with --database: the host the other replicas reach --internal-listen at, e.g. the pod's "
        "name under a headless Service, tally-coordinator-0.tally-coordinator (default: "
        "--internal-listen's host, which must then not be a wildcard)",
    )
    p.add_argument(
        "--model-plugin", action="append", default=[], metavar="MODULE",
        help="import this Python module's TALLY_MODELS so jobs may name its model kinds "
        "(repeatable; only the operator can add code to the coordinator, never a job spec)",
    )
    p.add_argument(
        "--tracking-uri", default="auto", metavar="URI",
        help="MLflow tracking URI: one run per job with its spec, every round's figures and the final ONNX "
        "model (needs tally[tracking]); 'auto': a file store in --state-dir/mlruns when MLflow is "
        "installed, else none; 'none': no tracking (default: %(default)s)",
    )
    p.add_argument("--log-level", default="info", help="debug, info, warning or error")
    add_tls_arguments(p, "coordinator", server=True)
    p.set_defaults(run=run_coordinator)

    if "job" not in sub.choices:  # `tally` may have registered it alone (it needs none of the service)
        job.register(sub)


def _aggregator_template(text: str) -> tuple[str, str]:
    ident, address = _aggregator(text)
    try:
        if ident.format(i=0) == ident.format(i=1):
            raise ValueError
        address.format(i=0)
    except (ValueError, KeyError, IndexError):
        raise argparse.ArgumentTypeError(
            f"{text!r}: the ID must contain {{i}} and nothing else in braces"
        ) from None
    return ident, address


def _aggregators(args: argparse.Namespace) -> list[tuple[str, str]]:
    listed = list(args.aggregator)
    if args.aggregator_template is not None:
        ident, address = args.aggregator_template
        listed += [(ident.format(i=i), address.format(i=i)) for i in range(args.aggregator_count)]
    return listed


def _job_specs(directory: Path) -> list[tuple[Path, JobSpec]]:
    """Every ``*.yaml`` spec in ``directory``, all checked (``ValueError`` naming the file); a key
    under its deprecated name is printed as a warning naming the file."""
    from tally.coordinator.spec.jobspec import JobSpecError
    from tally.coordinator.spec.jobspec import parse as parse_job_spec

    if not directory.is_dir():
        raise ValueError(f"--jobs-dir {directory}: no such directory")
    specs = []
    for path in sorted(directory.glob("*.yaml")):
        renamed: list[str] = []
        try:
            specs.append((path, parse_job_spec(path.read_text(), renamed)))
        except (OSError, JobSpecError) as exc:
            raise ValueError(f"--jobs-dir {path}: {exc}") from None
        for note in renamed:
            print(f"warning: --jobs-dir {path}: {note}", file=sys.stderr, flush=True)
    return specs


def _submit_new(service: CoordinatorService, specs: list[tuple[Path, JobSpec]]) -> None:
    """Submit the specs whose name no job has: a restart does not submit a job twice."""
    known = {record.name for record in service.jobs.store.jobs()}
    for path, spec in specs:
        if spec.name not in known:
            print(f"submitted {path.name} as job {service.jobs.submit(spec)}", flush=True)


def _aggregator(text: str) -> tuple[str, str]:
    try:
        return parse_aggregator(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


# -- the service ---------------------------------------------------------------------------------


def _rate_limit(text: str) -> RateLimit:
    rate, _, burst = text.partition("/")
    try:
        return RateLimit(float(rate), float(burst))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected RATE/BURST, rate > 0 and burst >= 1") from None


def run_coordinator(args: argparse.Namespace) -> int:
    from tally import models
    from tally.coordinator.replica import Replica
    from tally.coordinator.service import CoordinatorService

    logs.configure(args.log_level)
    for flag, path in (("--tls-dir", args.tls_dir), ("--secrets-dir", args.secrets_dir)):
        # Never create a mistyped directory and write fresh secrets into it.
        if path is not None and not path.is_dir():
            print(f"tally coordinator: {flag} {path}: no such directory", file=sys.stderr)
            return 2
    try:
        tls = tls_config_from_args(args)
        plugged = models.load_plugins(args.model_plugin)
        specs = _job_specs(args.jobs_dir) if args.jobs_dir is not None else []
    except ValueError as exc:  # PluginError is a ValueError
        print(f"tally coordinator: {exc}", file=sys.stderr)
        return 2
    if plugged:
        logs.event(log, "model plug-ins loaded", modules=args.model_plugin, kinds=plugged)
    try:
        advertise = _replication(args)
    except ValueError as exc:
        print(f"tally coordinator: {exc}", file=sys.stderr)
        return 2

    def make_service(epoch: int | None) -> CoordinatorService:
        return CoordinatorService(
            args.listen, tls, args.state_dir, _aggregators(args),
            metrics_port=args.metrics_port, metrics_addr=args.metrics_addr,
            max_message_bytes=args.max_message_bytes,
            secrets_dir=args.secrets_dir or args.tls_dir or args.state_dir,
            checkin_hold_s=args.checkin_hold,
            max_request_bytes=args.max_request_bytes,
            register_limit=args.register_limit,
            checkin_limit=args.checkin_limit,
            checkin_rate=args.checkin_rate,
            device_processes=args.device_processes,
            front_metrics_port=args.front_metrics_port,
            log_level=args.log_level,
            database_url=args.database or None,
            epoch=epoch,
            internal_listen=args.internal_listen if args.database else None,
            tracking_uri=_tracking_uri(args.tracking_uri, args.state_dir),
            connection_limits=argtypes.connection_limits(args),
        )
    if advertise is not None:
        return asyncio.run(_serve_replica(Replica(make_service, advertise, lambda s: _submit_new(s, specs),
                                                  on_serving=_say_serving, lease_s=args.leader_lease)))
    return asyncio.run(_serve(make_service(None), specs))


def _tracking_uri(given: str, state_dir: Path) -> str | None:
    """The MLflow tracking URI to use (None: none): ``auto`` tracks only where MLflow is installed."""
    if given == "none":
        return None
    if given != "auto":
        return given
    if importlib.util.find_spec("mlflow") is None:
        return None
    return default_uri(state_dir)


def _replication(args: argparse.Namespace) -> str | None:
    """The host to advertise as a replica over --database (None: one coordinator on SQLite)."""
    if args.database_file is not None:
        try:
            args.database = args.database_file.read_text().strip()
        except OSError as exc:
            raise ValueError(f"--database-file {args.database_file}: {exc.strerror or exc}") from None
    if not args.database:
        return None
    if not is_postgres_url(args.database):
        raise ValueError("--database: expected a postgresql:// URL")
    try:
        import psycopg  # noqa: F401 - only its absence matters here
    except ImportError:
        raise ValueError("--database needs psycopg: pip install 'tally[coordinator]'") from None
    host = args.advertise or args.internal_listen.rpartition(":")[0].strip("[]")
    if host in ("", "0.0.0.0", "::"):
        raise ValueError("--advertise: --internal-listen listens on every interface, so name the host "
                         "the other replicas reach it at")
    return host


def _say_serving(replica: Replica) -> None:
    """The line a person (or a script waiting for "coordinator on port") reads, as without replicas."""
    print(f"coordinator on port {replica.port}, metrics on port {replica.metrics_port}, {replica.role} "
          f"(replica over PostgreSQL)", flush=True)


async def _serve_replica(replica: Replica) -> int:
    import psycopg

    stopping = stop_on_signals()
    try:
        return await replica.run(stopping)
    except psycopg.Error as exc:  # unreachable, refused, or lost: its supervisor starts it again
        print(f"tally coordinator: the database: {str(exc).strip()}", file=sys.stderr)
        return 1
    except (OSError, RuntimeError, ValueError) as exc:  # a port in use, bad TLS files
        print(f"tally coordinator: {exc}", file=sys.stderr)
        return 1


async def _serve(service: CoordinatorService, specs: list[tuple[Path, JobSpec]]) -> int:
    stopping = stop_on_signals()
    fresh = not service.state_dir.exists()
    try:
        port = await service.start()
    except (OSError, RuntimeError, ValueError) as exc:  # a port or state dir in use, bad TLS files
        await service.stop(grace=0)
        if fresh:  # nothing of a coordinator that never ran is left behind (no admin.token)
            shutil.rmtree(service.state_dir, ignore_errors=True)
        print(f"tally coordinator: {exc}", file=sys.stderr)
        return 1
    print(
        f"coordinator on port {port}, metrics on port {service.metrics_port}, admin token in "
        f"{service.state_dir / ADMIN_TOKEN_FILE}",
        flush=True,
    )
    _submit_new(service, specs)
    await stopping.wait()
    await service.stop(grace=5.0)
    return 0
