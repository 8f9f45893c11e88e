"""``CoordinatorService``: the coordinator as one object a process (or a test) starts and stops.

It wires the store, the aggregator pool, the active jobs and the two gRPC services (device-facing
``Coordinator`` and operator-facing ``Admin``) onto one server, with health checking,
reflection, explicit message limits and its own metrics port.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from tally import logs
from tally.coordinator.faces.admin_api import AdminService, load_or_create_admin_token
from tally.coordinator.faces.admin_token import share_admin_token
from tally.coordinator.faces.device_api import DeviceService
from tally.coordinator.faces.device_entry import DeviceEntry
from tally.coordinator.faces.device_front import (
    FrontConfig,
    FrontKeyRequired,
    FrontProcess,
    front_key,
    refuse_port_in_use,
    shares,
)
from tally.coordinator.faces.ratelimit import (
    DEFAULT_CHECKIN_LIMIT,
    DEFAULT_MAX_REQUEST_BYTES,
    DEFAULT_REGISTER_LIMIT,
    RateLimit,
    SourceRateLimiter,
)
from tally.coordinator.metrics import CoordinatorMetrics
from tally.coordinator.rounds.active_jobs import ActiveJobs
from tally.coordinator.rounds.aggregators import AggregatorPool
from tally.coordinator.rounds.experiment_tracking import MlflowTracker
from tally.coordinator.rounds.pacing import CheckinPacer
from tally.coordinator.rounds.quality_gauges import QualityGauges
from tally.coordinator.state.store import Store
from tally.metrics import MetricsServer, watch_certificate
from tally.security import (
    OwnerTokens,
    TicketSigner,
    TLSConfig,
    TokenIssuer,
    bind,
    load_or_create_ticket_key,
    load_or_create_token_secret,
)
from tally.security.connections import DEFAULT_LIMITS, ConnectionLimits, guard
from tally.security.enrolment import EnrolmentVerifier, SharedKeyEnrolment, load_or_create_enrolment_key
from tally.security.tls import server_options
from tally.wire.undecodable import RefuseUndecodable
from tally.wire.v1 import admin_pb2, admin_pb2_grpc, coordinator_pb2, coordinator_pb2_grpc

log = logging.getLogger(__name__)

SERVICE_NAMES = (
    coordinator_pb2.DESCRIPTOR.services_by_name["Coordinator"].full_name,
    admin_pb2.DESCRIPTOR.services_by_name["Admin"].full_name,
)
DEFAULT_TOKEN_TTL_S = 24 * 3600.0
HEALTH_INTERVAL_S = 15.0
FRONT_CHECK_S = 1.0  # how often the coordinator looks whether its device fronts still run


class CoordinatorService:
    """Serves devices and operators on ``listen``; talks to ``aggregators`` ((id, host:port)).

    ``secrets_dir`` holds ``token.secret`` (device tokens), ``ticket.key``/``ticket.pub``
    (session tickets; aggregators need ``ticket.pub``) and ``enrolment.key`` (device credentials,
    ``tally enrol``); it defaults to ``state_dir``, and a ``tally certs`` directory works too.
    ``enrolment`` replaces the enrolment-key check (an attestation service, say).
    ``aggregator_tls`` defaults to plaintext when ``tls`` is plaintext, else to verifying
    aggregators with ``tls``'s CA while presenting the coordinator's own certificate (``tally
    certs`` makes it valid for serving and for mutual TLS toward aggregators, whose control API
    admits that identity only).

    As the leader of replicas over PostgreSQL (``tally.coordinator.replica``): ``database_url``
    is the shared store, ``epoch`` the leadership its writes and session tickets are fenced on, and
    ``internal_listen`` where the other replicas' fronts forward to (with ``tls``, and the same
    front key as a host's own fronts).
    """

    def __init__(
        self,
        listen: str,
        tls: TLSConfig,
        state_dir: Path,
        aggregators: Sequence[tuple[str, str]],
        *,
        aggregator_tls: TLSConfig | None = None,
        metrics_port: int = 0,
        metrics_addr: str = "127.0.0.1",
        max_message_bytes: int = 64 << 20,
        clock: Callable[[], float] = time.time,
        secrets_dir: Path | None = None,
        checkin_hold_s: float = 20.0,
        token_ttl_s: float = DEFAULT_TOKEN_TTL_S,
        enrolment: EnrolmentVerifier | None = None,
        max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
        register_limit: RateLimit = DEFAULT_REGISTER_LIMIT,
        checkin_limit: RateLimit = DEFAULT_CHECKIN_LIMIT,
        checkin_rate: float | None = None,
        device_processes: int = 1,
        front_metrics_port: int = 0,
        log_level: str = "info",
        database_url: str | None = None,
        epoch: int | None = None,
        internal_listen: str | None = None,
        tracking_uri: str | None = None,
        connection_limits: ConnectionLimits = DEFAULT_LIMITS,
    ) -> None:
        """``connection_limits``: of the device port (this process's and its fronts'),
        ``tally.security.connections``."""
        if device_processes < 1:
            raise ValueError(f"device_processes must be >= 1, got {device_processes}")
        self.listen, self.tls, self.state_dir = listen, tls, Path(state_dir)
        self.aggregators = list(aggregators)
        self.aggregator_tls = aggregator_tls or (
            tls if tls.insecure else TLSConfig(ca=tls.ca, cert=tls.cert, key=tls.key)
        )
        self.metrics_port, self.metrics_addr = metrics_port, metrics_addr
        self.max_message_bytes, self.clock = max_message_bytes, clock
        self.secrets_dir = Path(secrets_dir) if secrets_dir is not None else self.state_dir
        self.checkin_hold_s, self.token_ttl_s = checkin_hold_s, token_ttl_s
        self.enrolment, self.max_request_bytes = enrolment, max_request_bytes
        self.register_limit, self.checkin_limit = register_limit, checkin_limit
        self.checkin_rate, self.device_processes, self.log_level = checkin_rate, device_processes, log_level
        self.front_metrics_port = front_metrics_port  # front i on this + i - 1; 0: ephemeral ports
        self.database_url, self.epoch, self.internal_listen = database_url, epoch, internal_listen
        self.internal_port: int | None = None  # bound on internal_listen
        # An MLflow run per job (tally/coordinator/rounds/experiment_tracking.py); None: no tracking.
        self.tracking_uri = tracking_uri
        self._tracker: MlflowTracker | None = None
        self.connection_limits = connection_limits.resolved(device_processes)
        self._source_cap: asyncio.Task[None] | None = None
        # Set when a write of its store was refused: another replica took the lead (its replica stops it).
        self.lost_lead = asyncio.Event()
        # Each process serving devices paces the devices connected to it: 1/N of them. The
        # check-ins fronts forward (their devices' of populations with a job) are paced here at
        # the fronts' share, so a population with a job arrives at the whole rate. A leading
        # replica adds each other live replica's rate (the rate is per replica; ``pace_replicas``),
        # one until it has counted them: paced too slowly beats told to come back all at once.
        n = device_processes
        rate = checkin_rate or 0.0
        self.pacer = CheckinPacer(rate / n or None)
        self.forwarded_pacer = CheckinPacer(self._forwarded_rate(1 if internal_listen else 0) or None)
        self.port: int | None = None
        self.admin_token: str | None = None
        # The key `tally enrol` derives device credentials from (None with a custom verifier).
        self.enrolment_key: bytes | None = None
        self.jobs: ActiveJobs | None = None
        self._server: grpc.aio.Server | None = None
        self._metrics_server: MetricsServer | None = None
        self._ready = False
        self._health: health.aio.HealthServicer | None = None
        self._pool: AggregatorPool | None = None
        self._store: Store | None = None
        self._metrics: CoordinatorMetrics | None = None
        self._watchdog: asyncio.Task[None] | None = None
        # With device_processes > 1: the fronts, and the loopback port only they may call.
        self.fronts: list[FrontProcess] = []
        self.internal_target: str | None = None
        self._internal: grpc.aio.Server | None = None
        self._supervisor: asyncio.Task[None] | None = None

    def _forwarded_rate(self, other_replicas: int) -> float:
        rate, n = self.checkin_rate or 0.0, self.device_processes
        return rate * (n - 1) / n + rate * other_replicas

    def pace_replicas(self, other_replicas: int) -> None:
        """A leading replica: the check-ins forwarded by ``other_replicas`` live replicas (and
        its own fronts) come back at their combined rate."""
        if self.checkin_rate:
            self.forwarded_pacer.rate_per_s = self._forwarded_rate(other_replicas) or None
        if self._metrics is not None:
            self._metrics.replicas.set(other_replicas + 1)

    @property
    def store(self) -> Store:
        assert self._store is not None, "service not started"
        return self._store

    async def start(self) -> int:
        """Resume unfinished jobs and start serving; returns the bound port."""
        loop = asyncio.get_running_loop()
        self._store = Store(self.state_dir, self.database_url, self.epoch,
                            on_leadership_lost=lambda: loop.call_soon_threadsafe(self.lost_lead.set))
        if self.database_url:  # replicas: one token, whichever leads
            self.admin_token = share_admin_token(self._store, self.state_dir)
        else:
            self.admin_token = load_or_create_admin_token(self.state_dir)
        token_secret = load_or_create_token_secret(self.secrets_dir)
        issuer = TokenIssuer(token_secret)
        signer = TicketSigner(load_or_create_ticket_key(self.secrets_dir))
        self._metrics = metrics = CoordinatorMetrics()
        metrics.leader.set(1)
        watch_certificate(metrics.registry, self.tls.cert, "coordinator")
        self._metrics_server = MetricsServer(metrics.registry, ready=lambda: self._ready)
        self.metrics_port = self._metrics_server.start(self.metrics_port, self.metrics_addr)
        self._pool = AggregatorPool(
            self.aggregators, self.aggregator_tls, self.max_message_bytes,
            OwnerTokens(token_secret), metrics.aggregators_up.set,
            lambda aggregator_id, up: metrics.aggregator_up.labels(aggregator=aggregator_id).set(int(up)),
            fence=None if self.epoch is None else (self.epoch, signer.sign_epoch(self.epoch)),
            on_superseded=lambda epoch: self.lost_lead.set(),
        )
        self.jobs = jobs = ActiveJobs(
            self._store, self._pool, signer, metrics, self.clock, checkin_hold_s=self.checkin_hold_s,
            checkin_rate=self.checkin_rate,
        )
        jobs.events.listen(QualityGauges(metrics.model_quality))
        if self.tracking_uri is not None:
            self._tracker = MlflowTracker(self._store, self.tracking_uri)
            jobs.events.listen(self._tracker)
        metrics.watch(self._store.job_counts,
                      lambda: sum(len(runner.sessions.opened) for runner in list(jobs.runners.values())))

        shared = self.device_processes > 1
        server = grpc.aio.server(
            options=[*server_options(self.max_message_bytes, self.max_request_bytes, share_port=shared),
                     *self.connection_limits.server_options()],
            interceptors=(RefuseUndecodable(),))
        if self.enrolment is None:
            self.enrolment_key = load_or_create_enrolment_key(self.secrets_dir)
        enrolment = self.enrolment or SharedKeyEnrolment(self.enrolment_key)

        def devices(limited: bool) -> DeviceService:
            """The device API; ``limited``: rate limited per source and paced here (not: what the
            fronts forward, which they limited and this paces at their share)."""
            n = self.device_processes
            limits = {rpc: SourceRateLimiter(shares(limit, n), self.clock) if limited else None
                      for rpc, limit in (("Register", self.register_limit), ("CheckIn", self.checkin_limit))}
            entry = DeviceEntry(self._store.devices, issuer, metrics, self.clock, self.token_ttl_s,
                                enrolment=enrolment, coordinator_key=signer.public_key.public_bytes_raw(),
                                limits=limits)
            return DeviceService(jobs, self._store, entry, metrics, self.clock,
                                 self.pacer if limited else self.forwarded_pacer)

        coordinator_pb2_grpc.add_CoordinatorServicer_to_server(devices(limited=True), server)
        admin = AdminService(self.jobs, self._store, self.admin_token)
        admin_pb2_grpc.add_AdminServicer_to_server(admin, server)
        self._health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        reflection.enable_server_reflection(
            (*SERVICE_NAMES, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
             reflection.SERVICE_NAME),
            server,
        )
        if shared:
            await refuse_port_in_use(self.listen)
        self.port = bind(server, self.listen, self.tls)
        await server.start()
        self._server = server
        self._source_cap = guard(self.port, self.connection_limits, metrics.registry, "coordinator")
        if shared or self.internal_listen:
            await self._start_internal(devices(limited=False), admin, front_key(token_secret))
        if shared:
            await self._start_fronts(metrics)
        for name in ("", *SERVICE_NAMES):
            await self._health.set(name, health_pb2.HealthCheckResponse.SERVING)
        if self.epoch is not None:  # the aggregators refuse the old leader's sessions before any job resumes
            await self._pool.healthy()
        await self.jobs.start()
        self._ready = True  # /readyz: serving, with the store open and unfinished jobs resumed
        self._watchdog = asyncio.get_running_loop().create_task(self._watch_aggregators())
        logs.event(log, "coordinator serving", port=self.port, metrics_port=self.metrics_port,
                   state_dir=str(self.state_dir), aggregators=[a for a, _ in self.aggregators])
        return self.port

    def front_config(self, index: int, listen: str, coordinator: str | None = None) -> FrontConfig:
        """What device front ``index`` needs to serve ``listen`` beside this coordinator, forwarding
        to its internal port, or (``coordinator=""``, a replica following another) to the leader's."""
        coordinator = self.internal_target if coordinator is None else coordinator
        assert coordinator is not None, "no internal port: device_processes is 1"
        n = self.device_processes
        return FrontConfig(
            index=index, listen=listen, tls=self.tls, state_dir=self.state_dir, secrets_dir=self.secrets_dir,
            coordinator=coordinator, token_ttl_s=self.token_ttl_s, database_url=self.database_url,
            register_limit=shares(self.register_limit, n), checkin_limit=shares(self.checkin_limit, n),
            checkin_rate=self.pacer.rate_per_s, max_message_bytes=self.max_message_bytes,
            max_request_bytes=self.max_request_bytes,
            metrics_port=self.front_metrics_port + index - 1 if self.front_metrics_port else 0,
            metrics_addr=self.metrics_addr, log_level=self.log_level, coordinator_pid=os.getpid(),
            enrolment=self.enrolment, connection_limits=self.connection_limits,
        )

    async def _start_internal(self, forwarded: DeviceService, admin: AdminService, key: str) -> None:
        """The port fronts forward to: on loopback for this host's own, on ``internal_listen``
        (TLS) for the other replicas'."""
        internal = grpc.aio.server(options=server_options(self.max_message_bytes, self.max_request_bytes),
                                   interceptors=(FrontKeyRequired(key), RefuseUndecodable()))
        coordinator_pb2_grpc.add_CoordinatorServicer_to_server(forwarded, internal)
        admin_pb2_grpc.add_AdminServicer_to_server(admin, internal)
        if self.device_processes > 1:
            self.internal_target = f"127.0.0.1:{internal.add_insecure_port('127.0.0.1:0')}"
        if self.internal_listen:
            self.internal_port = bind(internal, self.internal_listen, self.tls)
        await internal.start()
        self._internal = internal

    async def _start_fronts(self, metrics: CoordinatorMetrics) -> None:
        """This host's fronts on the device port."""
        host = self.listen.rpartition(":")[0]
        self.fronts = [FrontProcess(self.front_config(i, f"{host}:{self.port}"))
                       for i in range(1, self.device_processes)]
        started = await asyncio.gather(*(front.start() for front in self.fronts), return_exceptions=True)
        failed = [outcome for outcome in started if isinstance(outcome, BaseException)]
        if failed:  # none is left running: the caller sees why, with nothing to clean up but this
            await asyncio.gather(*(front.stop(0.0) for front in self.fronts))
            raise RuntimeError(f"device fronts did not start: {failed[0]}") from failed[0]
        self._supervisor = asyncio.get_running_loop().create_task(self._supervise_fronts(metrics))

    async def _supervise_fronts(self, metrics: CoordinatorMetrics) -> None:
        """Start a front again when it exits: until then its share of devices reconnects to the
        processes still serving (the kernel sends new connections only to listening sockets)."""
        while True:
            await asyncio.sleep(FRONT_CHECK_S)
            for front in self.fronts:
                if front.alive():
                    continue
                exitcode = front.process.exitcode if front.process is not None else None
                logs.event(log, "device front exited; starting it again", level=logging.WARNING,
                           front=front.config.index, exitcode=exitcode)
                metrics.front_restarts.inc()
                try:
                    await front.start()
                except Exception as exc:  # noqa: BLE001 - logged, and tried again next time
                    logs.event(log, "device front did not start", level=logging.ERROR,
                               front=front.config.index, error=str(exc))

    async def _watch_aggregators(self) -> None:
        """Keep the aggregators-up gauge current between rounds (rounds check on their own)."""
        assert self._pool is not None
        while True:
            await self._pool.healthy()
            await asyncio.sleep(HEALTH_INTERVAL_S)

    async def stop(self, grace: float | None = None) -> None:
        """Stop serving; running jobs stay RUNNING in the store and resume on the next start."""
        self._ready = False
        if self._watchdog is not None:
            self._watchdog.cancel()
            await asyncio.gather(self._watchdog, return_exceptions=True)
        if self._supervisor is not None:
            self._supervisor.cancel()
            await asyncio.gather(self._supervisor, return_exceptions=True)
        # Fronts first: what they forward needs this process until they have finished.
        await asyncio.gather(*(front.stop(grace or 0.0) for front in self.fronts))
        if self._internal is not None:
            await self._internal.stop(grace)
        if self._health is not None:
            await self._health.enter_graceful_shutdown()
        if self.jobs is not None:
            await self.jobs.stop()
        if self._tracker is not None:  # its last events, before the store they read closes
            await asyncio.to_thread(self._tracker.close)
            self._tracker = None
        if self._source_cap is not None:
            self._source_cap.cancel()
            await asyncio.gather(self._source_cap, return_exceptions=True)
        if self._server is not None:
            await self._server.stop(grace)
        if self._pool is not None:
            await self._pool.close()
        if self._metrics_server is not None:
            self._metrics_server.stop()
        if self._store is not None:
            self._store.close()
        self._server = self._pool = self._store = self.jobs = self._metrics_server = self._watchdog = None
        self._internal = self._supervisor = self.internal_target = self.internal_port = self._source_cap = None
        self.fronts = []
        logs.event(log, "coordinator stopped", port=self.port)
