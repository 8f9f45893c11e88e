"""Device fronts: processes beside the coordinator that serve devices on the same port, so that
registrations and idle check-ins use as many cores as the coordinator is given.

Why: the coordinator is one Python process, and at population scale its cost is per device (a
registration's TLS handshake, signature check and write; an idle check-in's TLS record, token
check and pacing), not per round: one process on one core answers about 1,000 idle check-ins a
second from devices on their own connections, and gRPC's own share of that is most of it
(``bench/population.py``). No deployment can buy that back with more cores unless more processes
serve devices.

How: every process binds the device port with SO_REUSEPORT (gRPC's own multiprocessing pattern),
and the kernel spreads devices' connections over them. A front answers by itself what needs nothing
of the running jobs:

- ``Register``: the enrolment checks, the devices-table write (SQLite in WAL mode: one writer at a
  time across processes, readers never blocked) and the token, from the same secrets;
- ``CheckIn`` of a device whose population has no pending or running job: the idle come-back time,
  paced at the front's share of the target rate. That includes a check-in stating an input
  ledger, as every SDK device with a state directory does at every check-in: a ledger only
  releases seats of running jobs (``JobRunner.ledger_says``), and such a population has none.

Everything else (a check-in of a population a job may select from, or carrying task reports;
``GetStep``, ``DownloadModel``, ``Reveal``, ``RoundStatus``; the Admin API) is
forwarded unchanged, as bytes, to the coordinator's internal port, which only fronts can call (a
key derived from the token secret). Round planning stays in one process, the coordinator: one
leader, so selection, seating and the round's state need no agreement between processes.

A front reads the populations with jobs and the revoked devices from the store every
``REFRESH_S``: a device of a population whose job was submitted less than that ago may still be
told it is idle, as it would have been had it checked in just before the submission; a
revocation reaches the fronts within ``REFRESH_S`` (the coordinator itself refuses at once).
"""

from __future__ import annotations

import asyncio
import errno
import hashlib
import hmac
import logging
import multiprocessing
import multiprocessing.connection
import multiprocessing.process
import os
import socket
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import Counter

from tally import logs
from tally.coordinator.faces.device_entry import DeviceEntry, turned_away
from tally.coordinator.faces.ratelimit import RateLimit, SourceRateLimiter
from tally.coordinator.metrics import DeviceMetrics
from tally.coordinator.rounds.come_back import idle_retry
from tally.coordinator.rounds.pacing import CheckinPacer
from tally.coordinator.state.database import Database, open_database
from tally.coordinator.state.enrolled_devices import EnrolledDevices
from tally.coordinator.state.leadership import leader_address
from tally.metrics import MetricsServer, RoleRegistry
from tally.security import TLSConfig, TokenIssuer, bind, load_or_create_ticket_key, load_or_create_token_secret
from tally.security.certs import COORDINATOR_CN
from tally.security.connections import DEFAULT_LIMITS, ConnectionLimits, guard
from tally.security.enrolment import EnrolmentVerifier, SharedKeyEnrolment, load_or_create_enrolment_key
from tally.security.tls import open_aio_channel, server_options
from tally.shutdown import stop_on_signals
from tally.wire.undecodable import RefuseUndecodable
from tally.wire.v1 import admin_pb2, coordinator_pb2

log = logging.getLogger(__name__)

REFRESH_S = 0.5
STALE_S = 5.0  # a front that could not read the store this long stops
START_TIMEOUT_S = 60.0  # a spawned interpreter imports gRPC and the coordinator's modules first
STOP_MARGIN_S = 5.0
# A front notices its coordinator is gone within REFRESH_S, then stops with no grace: this is ample.
ORPHAN_EXIT_S = 4 * REFRESH_S + 1.0
FRONT_KEY_METADATA = "tally-front-key"
_COORDINATOR = coordinator_pb2.DESCRIPTOR.services_by_name["Coordinator"]
# Every method a front forwards, and whether its answer streams.
_FORWARDED = {
    f"/{service.full_name}/{method.name}": method.server_streaming
    for service in (_COORDINATOR, admin_pb2.DESCRIPTOR.services_by_name["Admin"])
    for method in service.methods
}
# What a front answers health checks and reflection for: the services it serves or forwards.
_SERVED = (*dict.fromkeys(name.split("/")[1] for name in _FORWARDED), health.SERVICE_NAME)
_REGISTER, _CHECK_IN = f"/{_COORDINATOR.full_name}/Register", f"/{_COORDINATOR.full_name}/CheckIn"
# What a forwarded call does not carry over: HTTP/2 pseudo-headers and gRPC's own.
_HOP_BY_HOP = ("user-agent",)


def front_key(token_secret: bytes) -> str:
    """What a front shows the coordinator's internal port: derived from the token secret, which
    every process of one coordinator reads, and nothing else of it."""
    return hmac.new(token_secret, b"tally device front v1", hashlib.sha256).hexdigest()


class FrontKeyRequired(grpc.aio.ServerInterceptor):
    """On the coordinator's internal port: calls without the fronts' key are refused. The port is
    on loopback, but another process of the host must not skip the fronts' rate limits."""

    def __init__(self, key: str) -> None:
        self._key = key.encode()

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        shown = dict(details.invocation_metadata or ()).get(FRONT_KEY_METADATA, "")
        if hmac.compare_digest(shown.encode() if isinstance(shown, str) else shown, self._key):
            return await continuation(details)

        async def refuse(request, context: grpc.aio.ServicerContext) -> None:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "the internal port serves device fronts only")

        return grpc.unary_unary_rpc_method_handler(refuse)


@dataclass(frozen=True)
class FrontConfig:
    """What a front process needs, picklable: it is started with multiprocessing's spawn."""

    index: int
    listen: str
    tls: TLSConfig
    state_dir: Path
    secrets_dir: Path
    coordinator: str  # the coordinator's internal HOST:PORT; "": the leader's, read from the store
    token_ttl_s: float
    register_limit: RateLimit  # this process's share
    checkin_limit: RateLimit
    checkin_rate: float | None
    max_message_bytes: int
    max_request_bytes: int
    metrics_port: int
    metrics_addr: str
    log_level: str
    coordinator_pid: int  # not the front's parent as it reads it: the coordinator may die first
    enrolment: EnrolmentVerifier | None = None
    database_url: str | None = None  # PostgreSQL: the replicas' shared store, not state_dir's SQLite
    share_port: bool = True  # beside a coordinator on its port; a following replica's front is alone on its own
    # Resolved for this front's share of the port (``ConnectionLimits.resolved``).
    connection_limits: ConnectionLimits = DEFAULT_LIMITS.resolved()


def internal_tls(tls: TLSConfig) -> TLSConfig:
    """How a replica's fronts reach the leader's internal port: TLS, verifying the coordinator's
    certificate with the deployment's CA and by the coordinator's name, whatever address the
    leader advertised (a pod IP no certificate names; every replica holds that certificate).
    Plaintext only where the device port is, and then on loopback only, as every plaintext channel."""
    return TLSConfig.plaintext() if tls.insecure else TLSConfig(ca=tls.ca, server_name=COORDINATOR_CN)


class DeviceFront:
    def __init__(self, config: FrontConfig, clock: Callable[[], float] = time.time) -> None:
        self.config, self.clock = config, clock
        self.populations_with_jobs: frozenset[str] = frozenset()
        self.metrics_port: int | None = None
        self._server: grpc.aio.Server | None = None
        self._channel: grpc.aio.Channel | None = None
        self._retired: list[grpc.aio.Channel] = []
        self._database: Database | None = None
        self._metrics: MetricsServer | None = None
        self._refresher: asyncio.Task[None] | None = None
        self._source_cap: asyncio.Task[None] | None = None
        self.stale = asyncio.Event()

    async def start(self) -> int:
        c = self.config
        self._database = open_database(c.state_dir, c.database_url)
        self.devices = EnrolledDevices(self._database)
        token_secret = load_or_create_token_secret(c.secrets_dir)
        self._key = front_key(token_secret)
        self.metrics = DeviceMetrics(RoleRegistry("coordinator"))
        self.forwarded = Counter("tally_coordinator_forwarded_calls",
                                 "Calls a device front passed on to the coordinator, by method",
                                 ["method"], registry=self.metrics.registry)
        self.pacer = CheckinPacer(c.checkin_rate)
        enrolment = c.enrolment or SharedKeyEnrolment(load_or_create_enrolment_key(c.secrets_dir))
        self.entry = DeviceEntry(
            self.devices, TokenIssuer(token_secret), self.metrics, self.clock, c.token_ttl_s,
            enrolment=enrolment,
            coordinator_key=load_or_create_ticket_key(c.secrets_dir).public_key().public_bytes_raw(),
            limits={"Register": SourceRateLimiter(c.register_limit, self.clock),
                    "CheckIn": SourceRateLimiter(c.checkin_limit, self.clock)},
        )
        self.target: str | None = None
        self._refresh_once()
        self._metrics = MetricsServer(self.metrics.registry)
        self.metrics_port = self._metrics.start(c.metrics_port, c.metrics_addr)
        server = grpc.aio.server(
            options=[*server_options(c.max_message_bytes, c.max_request_bytes, share_port=c.share_port),
                     *c.connection_limits.server_options()],
            interceptors=(RefuseUndecodable(),))
        server.add_generic_rpc_handlers((_FrontHandlers(self),))
        health_servicer = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
        reflection.enable_server_reflection((*_SERVED, reflection.SERVICE_NAME), server)
        port = bind(server, c.listen, c.tls)
        await server.start()
        self._server = server
        self._source_cap = guard(port, c.connection_limits, self.metrics.registry, "coordinator")
        for name in ("", *_SERVED):
            await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
        self._refresher = asyncio.get_running_loop().create_task(self._refresh())
        logs.event(log, "device front serving", front=c.index, port=port, metrics_port=self.metrics_port)
        return port

    async def stop(self, grace: float | None = None) -> None:
        for task in (self._refresher, self._source_cap):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        if self._server is not None:
            await self._server.stop(grace)
        for channel in (*self._retired, self._channel):
            if channel is not None:
                await channel.close()
        self._retired = []
        if self._metrics is not None:
            self._metrics.stop()
        if self._database is not None:
            self._database.close()
        self._server = self._channel = self._metrics = self._database = self._refresher = self._source_cap = None

    def _refresh_once(self) -> None:
        assert self._database is not None
        with self._database.lock:
            rows = self._database.execute(
                "SELECT DISTINCT population FROM jobs WHERE state IN ('PENDING', 'RUNNING')").fetchall()
        self.populations_with_jobs = frozenset(row[0] for row in rows)
        self.devices.reload_revoked()
        self._point_at(self.config.coordinator or leader_address(self._database))

    def _point_at(self, target: str | None) -> None:
        """Forward to ``target`` from now on: a replica's leader may change (calls in flight on
        the old channel finish or fail; devices retry)."""
        if target is None or target == self.target:
            return
        c, old = self.config, self._channel
        options = [("grpc.max_receive_message_length", c.max_message_bytes),
                   ("grpc.max_send_message_length", c.max_message_bytes)]
        # A host's own fronts reach the coordinator on loopback in plaintext; a replica reaches
        # the leader across the network, verifying the coordinator's certificate.
        self._channel = (grpc.aio.insecure_channel(target, options=options) if c.coordinator
                         else open_aio_channel(target, internal_tls(c.tls), options))
        self.target = target
        logs.event(log, "device front forwarding", front=c.index, to=target)
        if old is not None:  # closed when the front stops: calls in flight on it may finish
            self._retired.append(old)

    async def _refresh(self) -> None:
        """Until what the front knows is older than ``STALE_S``, a failed read (the database busy
        past its timeout, a disk error) is retried; then the front stops (``stale``), and its
        coordinator starts it again, rather than answer from a stale list of populations and
        revocations."""
        fresh = time.monotonic()
        while True:
            await asyncio.sleep(REFRESH_S)
            try:
                self._refresh_once()
                fresh = time.monotonic()
            except self._database.errors as exc:
                logs.event(log, "device front could not read the store", level=logging.WARNING,
                           front=self.config.index, error=str(exc))
                if time.monotonic() - fresh > STALE_S:
                    self.stale.set()
                    return

    # -- the calls ---------------------------------------------------------------------------------

    async def check_in(self, request: coordinator_pb2.CheckInRequest, context: grpc.aio.ServicerContext):
        claims = await self.entry.check_in(request, context)
        if claims.population in self.populations_with_jobs or request.reports:
            reply = await self.forward(_CHECK_IN, request.SerializeToString(), context)
            return coordinator_pb2.CheckInResponse.FromString(reply)
        return turned_away(idle_retry(claims.population), self.pacer, self.metrics, self.clock())

    async def _leader_known(self, context: grpc.aio.ServicerContext) -> None:
        """A replica's front before any leader has announced its address: the device retries."""
        if self._channel is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "no coordinator replica leads yet; retry")

    def _metadata(self, context: grpc.aio.ServicerContext) -> list[tuple[str, str | bytes]]:
        carried = [(k, v) for k, v in context.invocation_metadata() or ()
                   if not k.startswith((":", "grpc-")) and k not in _HOP_BY_HOP]
        return [*carried, (FRONT_KEY_METADATA, self._key)]

    async def forward(self, method: str, request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        await self._leader_known(context)
        self.forwarded.labels(method=method.rpartition("/")[2]).inc()
        try:
            return await self._channel.unary_unary(method)(
                request, metadata=self._metadata(context), timeout=context.time_remaining())
        except grpc.aio.AioRpcError as exc:
            await context.abort(*_relayed(exc))
            raise  # unreachable: abort raises

    async def forward_stream(
        self, method: str, request: bytes, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[bytes]:
        await self._leader_known(context)
        self.forwarded.labels(method=method.rpartition("/")[2]).inc()
        call = self._channel.unary_stream(method)(
            request, metadata=self._metadata(context), timeout=context.time_remaining())
        try:
            async for chunk in call:
                yield chunk
        except grpc.aio.AioRpcError as exc:
            await context.abort(*_relayed(exc))
        finally:
            call.cancel()


def _relayed(exc: grpc.aio.AioRpcError) -> tuple[grpc.StatusCode, str]:
    """The coordinator's answer as the device should see it: its own refusals as they are; the
    coordinator out of reach as such, without the internal address gRPC's message would name."""
    if exc.code() == grpc.StatusCode.UNAVAILABLE:
        return exc.code(), "the coordinator behind this device front is not reachable; retry"
    return exc.code(), exc.details() or ""


class _FrontHandlers(grpc.GenericRpcHandler):
    """Register and CheckIn answered here (decoded, so undecodable bytes are refused as everywhere
    else); every other method of the two services forwarded as bytes."""

    def __init__(self, front: DeviceFront) -> None:
        self._front = front

    def service(self, details: grpc.HandlerCallDetails):
        front, method = self._front, details.method
        if method == _REGISTER:
            return grpc.unary_unary_rpc_method_handler(
                front.entry.register, request_deserializer=coordinator_pb2.RegisterRequest.FromString,
                response_serializer=coordinator_pb2.RegisterResponse.SerializeToString)
        if method == _CHECK_IN:
            return grpc.unary_unary_rpc_method_handler(
                front.check_in, request_deserializer=coordinator_pb2.CheckInRequest.FromString,
                response_serializer=coordinator_pb2.CheckInResponse.SerializeToString)
        if method not in _FORWARDED:
            return None
        if _FORWARDED[method]:
            async def forward_stream(request: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
                async for chunk in front.forward_stream(method, request, context):
                    yield chunk

            return grpc.unary_stream_rpc_method_handler(forward_stream)

        async def forward(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
            return await front.forward(method, request, context)

        return grpc.unary_unary_rpc_method_handler(forward)


def serve_front(config: FrontConfig, ready: multiprocessing.connection.Connection) -> None:
    """A front process's main: serve until SIGTERM, until the coordinator that started it is gone
    or until the store has been unreadable for ``STALE_S``. Says on ``ready`` "ready" once
    serving, or why it could not start."""
    logs.configure(config.log_level)
    asyncio.run(_serve(config, ready, config.coordinator_pid))


async def _serve(config: FrontConfig, ready: multiprocessing.connection.Connection, parent: int) -> None:
    stopping = stop_on_signals()
    front = DeviceFront(config)
    try:
        await front.start()
    except Exception as exc:  # noqa: BLE001 - whatever stopped it is what the coordinator reports
        await front.stop(grace=0)
        ready.send(f"device front {config.index} could not start: {exc}")
        return
    ready.send(("ready", front.metrics_port))
    while not stopping.is_set() and not front.stale.is_set() and os.getppid() == parent:
        try:
            await asyncio.wait_for(stopping.wait(), timeout=REFRESH_S)
        except TimeoutError:
            pass
    # Orphaned, there is no one left to forward to: stop at once, so a new coordinator may bind.
    await front.stop(grace=5.0 if os.getppid() == parent else 0)


def shares(limit: RateLimit, processes: int) -> RateLimit:
    """One process's share of a per-source limit: a source's connections are spread over the
    processes, so each holds it to 1/N of the rate (and of the burst, but at least one call)."""
    return RateLimit(limit.rate_per_s / processes, max(1.0, limit.burst / processes))


async def refuse_port_in_use(listen: str) -> None:
    """``RuntimeError`` when something listens on ``listen``'s port. The processes of a coordinator
    bind with SO_REUSEPORT, which would otherwise share the port silently with any service of the
    same user already on it (an ephemeral port, ``:0``, and a unix socket are never shared). The
    fronts of a killed coordinator still hold the port until they notice, so a port in use is
    retried for ``ORPHAN_EXIT_S``."""
    host, _, port = listen.rpartition(":")
    if listen.startswith("unix") or int(port) == 0:
        return
    deadline = time.monotonic() + ORPHAN_EXIT_S
    while _in_use(host.strip("[]") or None, int(port)):
        if time.monotonic() > deadline:
            raise RuntimeError(f"could not bind {listen!r}: is another service listening on it?")
        await asyncio.sleep(0.1)


def _in_use(host: str | None, port: int) -> bool:
    """Whether binding any of ``host``'s addresses on ``port`` fails with EADDRINUSE (an address
    family or address this host lacks, IPv6 in a container say, is not a listener)."""
    for family, kind, proto, _, address in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                              flags=socket.AI_PASSIVE):
        try:
            with socket.socket(family, kind, proto) as probe:
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT is no owner
                probe.bind(address)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                return True
    return False


class FrontProcess:
    """One front process as the coordinator starts, watches and stops it."""

    def __init__(self, config: FrontConfig) -> None:
        self.config = config
        self.process: multiprocessing.process.BaseProcess | None = None
        self.ready = False
        self._metrics_port: int | None = None

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None

    @property
    def metrics_port(self) -> int | None:
        return self._metrics_port if self.ready else None

    def alive(self) -> bool:
        return self.process is not None and self.process.is_alive()

    async def start(self, timeout_s: float = START_TIMEOUT_S) -> None:
        """Spawn the process and wait until it serves; ``RuntimeError`` saying why it did not."""
        self.ready = False
        context = multiprocessing.get_context("spawn")  # not fork: the parent runs gRPC threads
        receive, send = context.Pipe(duplex=False)
        self.process = context.Process(target=serve_front, args=(self.config, send),
                                       name=f"tally-device-front-{self.config.index}", daemon=True)
        self.process.start()
        send.close()
        try:
            said = await asyncio.to_thread(_receive, receive, timeout_s)
        finally:
            receive.close()
        if not isinstance(said, tuple):
            await self.stop(grace=0)
            raise RuntimeError(said)
        self._metrics_port, self.ready = said[1], True

    async def stop(self, grace: float) -> None:
        process, self.ready = self.process, False
        if process is None or process.exitcode is not None:
            return
        process.terminate()  # SIGTERM: it stops taking calls and lets running ones finish
        await asyncio.to_thread(process.join, grace + STOP_MARGIN_S)
        if process.exitcode is None:
            process.kill()
            await asyncio.to_thread(process.join)


def _receive(connection: multiprocessing.connection.Connection, timeout_s: float) -> tuple | str:
    if not connection.poll(timeout_s):
        return f"no word from the device front within {timeout_s:g} s"
    try:
        return connection.recv()
    except EOFError:
        return "the device front exited before it served"
