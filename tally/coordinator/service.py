"""``CoordinatorService``: the coordinator as one object a process (or a test) starts and stops.

It wires the store, the aggregator pool, the active jobs and the two gRPC services (device-facing
``Coordinator`` and operator-facing ``Admin``) onto one server, with health checking,
reflection, explicit message limits and its own metrics port.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from tally import logs
from tally.coordinator.active_jobs import ActiveJobs
from tally.coordinator.admin_api import AdminService, load_or_create_admin_token
from tally.coordinator.aggregators import AggregatorPool
from tally.coordinator.device_api import DeviceService
from tally.coordinator.metrics import CoordinatorMetrics
from tally.coordinator.pacing import CheckinPacer
from tally.coordinator.ratelimit import (
    DEFAULT_CHECKIN_LIMIT,
    DEFAULT_MAX_REQUEST_BYTES,
    DEFAULT_REGISTER_LIMIT,
    RateLimit,
    SourceRateLimiter,
)
from tally.coordinator.store import Store
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
from tally.security.enrolment import EnrolmentVerifier, SharedKeyEnrolment, load_or_create_enrolment_key
from tally.security.tls import server_options
from tally.wire.undecodable import RefuseUndecodable
from tally.wire.v1 import admin_pb2, admin_pb2_grpc, coordinator_pb2, coordinator_pb2_grpc

log = logging.getLogger("tally.coordinator")

SERVICE_NAMES = (
    coordinator_pb2.DESCRIPTOR.services_by_name["Coordinator"].full_name,
    admin_pb2.DESCRIPTOR.services_by_name["Admin"].full_name,
)
DEFAULT_TOKEN_TTL_S = 24 * 3600.0
HEALTH_INTERVAL_S = 15.0


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
    ) -> None:
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
        self.pacer = CheckinPacer(checkin_rate)
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
        self._watchdog: asyncio.Task[None] | None = None

    @property
    def store(self) -> Store:
        assert self._store is not None, "service not started"
        return self._store

    async def start(self) -> int:
        """Resume unfinished jobs and start serving; returns the bound port."""
        self._store = Store(self.state_dir)
        self.admin_token = load_or_create_admin_token(self.state_dir)
        token_secret = load_or_create_token_secret(self.secrets_dir)
        issuer = TokenIssuer(token_secret)
        signer = TicketSigner(load_or_create_ticket_key(self.secrets_dir))
        metrics = CoordinatorMetrics()
        watch_certificate(metrics.registry, self.tls.cert, "coordinator")
        self._metrics_server = MetricsServer(metrics.registry, ready=lambda: self._ready)
        self.metrics_port = self._metrics_server.start(self.metrics_port, self.metrics_addr)
        self._pool = AggregatorPool(
            self.aggregators, self.aggregator_tls, self.max_message_bytes,
            OwnerTokens(token_secret), metrics.aggregators_up.set,
        )
        self.jobs = jobs = ActiveJobs(
            self._store, self._pool, signer, metrics, self.clock, checkin_hold_s=self.checkin_hold_s,
            checkin_rate=self.pacer.rate_per_s,
        )
        metrics.watch(self._store.job_counts,
                      lambda: sum(len(runner.sessions.opened) for runner in list(jobs.runners.values())))

        server = grpc.aio.server(
            options=server_options(self.max_message_bytes, self.max_request_bytes),
            interceptors=(RefuseUndecodable(),))
        if self.enrolment is None:
            self.enrolment_key = load_or_create_enrolment_key(self.secrets_dir)
        enrolment = self.enrolment or SharedKeyEnrolment(self.enrolment_key)
        coordinator_pb2_grpc.add_CoordinatorServicer_to_server(
            DeviceService(
                self.jobs, self._store, issuer, metrics, self.clock, self.token_ttl_s,
                enrolment=enrolment, coordinator_key=signer.public_key.public_bytes_raw(),
                register_limit=SourceRateLimiter(self.register_limit, self.clock),
                checkin_limit=SourceRateLimiter(self.checkin_limit, self.clock),
                pacer=self.pacer,
            ),
            server,
        )
        admin_pb2_grpc.add_AdminServicer_to_server(
            AdminService(self.jobs, self._store, self.admin_token), server
        )
        self._health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        reflection.enable_server_reflection(
            (*SERVICE_NAMES, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
             reflection.SERVICE_NAME),
            server,
        )
        self.port = bind(server, self.listen, self.tls)
        await server.start()
        self._server = server
        for name in ("", *SERVICE_NAMES):
            await self._health.set(name, health_pb2.HealthCheckResponse.SERVING)
        await self.jobs.start()
        self._ready = True  # /readyz: serving, with the store open and unfinished jobs resumed
        self._watchdog = asyncio.get_running_loop().create_task(self._watch_aggregators())
        logs.event(log, "coordinator serving", port=self.port, metrics_port=self.metrics_port,
                   state_dir=str(self.state_dir), aggregators=[a for a, _ in self.aggregators])
        return self.port

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
        if self._health is not None:
            await self._health.enter_graceful_shutdown()
        if self.jobs is not None:
            await self.jobs.stop()
        if self._server is not None:
            await self._server.stop(grace)
        if self._pool is not None:
            await self._pool.close()
        if self._metrics_server is not None:
            self._metrics_server.stop()
        if self._store is not None:
            self._store.close()
        self._server = self._pool = self._store = self.jobs = self._metrics_server = self._watchdog = None
        logs.event(log, "coordinator stopped", port=self.port)
