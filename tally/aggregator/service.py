"""The secure-aggregator service: both gRPC services, health and reflection, and Prometheus
metrics on a port of their own.

``AggregatorControl`` (the coordinator) and ``SecureAggregation`` (devices) share one port unless
``control_listen`` gives the control API its own: then devices never reach it, a network policy
can admit only the coordinator there, and only the control port takes messages larger than
``max_request_bytes`` (a very large cohort's OpenSession). The coordinator learns the device
address from OpenSession either way. Any number of replicas can run side by side: each holds only
the sessions the coordinator opened on it, and only until they end.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import socket
import time
from collections.abc import Callable

import grpc
from cryptography.hazmat.primitives.asymmetric import ed25519
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from tally import logs
from tally.aggregator.control import ControlServicer
from tally.aggregator.held_sessions import HeldSessions
from tally.aggregator.metrics import AggregatorMetrics
from tally.aggregator.stream import SERVICE as DEVICE_SERVICE
from tally.aggregator.stream import DeviceStreams
from tally.aggregator.stream import add_to_server as add_device_streams
from tally.metrics import MetricsServer, watch_certificate
from tally.security import TicketVerifier, TLSConfig, bind
from tally.security.certs import COORDINATOR_CN
from tally.security.connections import DEFAULT_LIMITS, ConnectionLimits, guard
from tally.security.tls import server_options
from tally.wire.undecodable import RefuseUndecodable
from tally.wire.v1 import aggregator_pb2, aggregator_pb2_grpc

log = logging.getLogger(__name__)

CONTROL_SERVICE = aggregator_pb2.DESCRIPTOR.services_by_name["AggregatorControl"].full_name
SERVICE_NAMES = (CONTROL_SERVICE, DEVICE_SERVICE)
_WILDCARD_HOSTS = {"", "0.0.0.0", "[::]", "::"}
# The largest message received: four masked-input chunks, and an OpenSession of ~40,000 devices.
# A device stream's messages are read only after its Join (in the stream's metadata) was checked.
DEFAULT_MAX_REQUEST_BYTES = 4 << 20


class AggregatorService:
    """``ticket_public_key``: the coordinator's Ed25519 ticket key (raw 32 bytes or a key
    object). ``advertised_address``: what devices should dial, when it differs from ``listen``
    (behind a Service or NAT). ``controller``: the certificate CN the control API admits when
    ``tls`` demands client certificates, which it then does on the control port only: devices
    present no certificate (each stream is authenticated by its Join), so mutual TLS needs
    ``control_listen``. ``max_request_bytes``: the largest message received; masked inputs arrive
    in chunks (``tally.wire.chunks``), so only a very large cohort's OpenSession needs more than
    the default."""

    def __init__(
        self,
        listen: str,
        tls: TLSConfig,
        ticket_public_key: bytes | ed25519.Ed25519PublicKey,
        aggregator_id: str,
        *,
        advertised_address: str | None = None,
        metrics_port: int = 0,
        metrics_addr: str = "127.0.0.1",
        max_message_bytes: int = 64 << 20,
        max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
        result_ttl_s: float = 600.0,
        clock: Callable[[], float] = time.time,
        controller: str = COORDINATOR_CN,
        control_listen: str | None = None,
        connection_limits: ConnectionLimits = DEFAULT_LIMITS,
    ) -> None:
        """``connection_limits``: of the device port (``tally.security.connections``)."""
        if not aggregator_id:
            raise ValueError("aggregator_id must be non-empty")
        if tls.require_client_auth and control_listen is None:
            raise ValueError("client certificates are demanded of the coordinator only: give the control API "
                             "its own port (--control-listen); devices present none, their Join authenticates them")
        self.id = aggregator_id
        self.metrics = AggregatorMetrics()
        self._listen = listen
        self._tls = tls
        self._advertised = advertised_address
        self._metrics_request = (metrics_port, metrics_addr)
        self.connection_limits = connection_limits.resolved()
        self._options = [*server_options(max_message_bytes, max_request_bytes),
                         *self.connection_limits.server_options()]
        self._source_cap: asyncio.Task[None] | None = None
        self._control_listen = control_listen
        self._control_options = server_options(max_message_bytes)
        self._verifier = TicketVerifier(ticket_public_key)
        self._sessions = HeldSessions(result_ttl_s)
        self._clock = clock
        self._controller = controller
        self._servers: list[grpc.aio.Server] = []
        self._health: list[health.aio.HealthServicer] = []
        self._metrics_server = MetricsServer(self.metrics.registry, ready=lambda: self._ready)
        self._ready = False
        watch_certificate(self.metrics.registry, tls.cert, "aggregator")
        self._port: int | None = None
        self._control_port: int | None = None
        self._metrics_port: int | None = None

    @property
    def port(self) -> int:
        if self._port is None:
            raise RuntimeError("the aggregator is not started")
        return self._port

    @property
    def control_port(self) -> int:
        """The port of AggregatorControl: the device port unless ``control_listen`` was given."""
        if self._control_port is None:
            raise RuntimeError("the aggregator is not started")
        return self._control_port

    @property
    def metrics_port(self) -> int:
        if self._metrics_port is None:
            raise RuntimeError("the aggregator is not started")
        return self._metrics_port

    @property
    def address(self) -> str:
        """host:port for devices: the advertised address, else the bound one."""
        if self._advertised:
            return self._advertised
        host = self._listen.rsplit(":", 1)[0]
        return f"{socket.getfqdn() if host in _WILDCARD_HOSTS else host}:{self.port}"

    async def start(self) -> int:
        """Bind, serve, and return the bound gRPC port."""
        if self._servers:
            raise RuntimeError("the aggregator is already started")
        ports: list[tuple[tuple[str, ...], str, list[tuple[str, int]], TLSConfig]]
        if self._control_listen is None:
            ports = [(SERVICE_NAMES, self._listen, self._options, self._tls)]
        else:
            devices = dataclasses.replace(self._tls, require_client_auth=False)
            ports = [((DEVICE_SERVICE,), self._listen, self._options, devices),
                     ((CONTROL_SERVICE,), self._control_listen, self._control_options, self._tls)]
        servers = [(self._build(names, options), names) for names, _, options, _ in ports]
        bound = [bind(server, listen, tls) for (server, _), (_, listen, _, tls) in zip(servers, ports)]
        self._port, self._control_port = bound[0], bound[-1]
        self._metrics_port = self._metrics_server.start(*self._metrics_request)
        try:
            for server, _ in servers:
                await server.start()
                self._servers.append(server)
        except BaseException:
            await self._stop_servers(None)
            raise
        for checker, (_, names) in zip(self._health, servers):
            for name in ("", *names):
                await checker.set(name, health_pb2.HealthCheckResponse.SERVING)
        self._source_cap = guard(self._port, self.connection_limits, self.metrics.registry, "aggregator")
        self._ready = True  # /readyz: as the gRPC health service says SERVING
        logs.event(log, "aggregator started", aggregator_id=self.id, address=self.address,
                   port=self._port, control_port=self._control_port, metrics_port=self._metrics_port)
        return self._port

    def _build(self, services: tuple[str, ...], options: list[tuple[str, int]]) -> grpc.aio.Server:
        server = grpc.aio.server(options=options, interceptors=(RefuseUndecodable(),))
        if CONTROL_SERVICE in services:
            aggregator_pb2_grpc.add_AggregatorControlServicer_to_server(
                ControlServicer(self.id, self._verifier, self._sessions, self.metrics, self._clock,
                                lambda: self.address, self._controller),
                server,
            )
        if DEVICE_SERVICE in services:
            add_device_streams(
                DeviceStreams(self.id, self._verifier, self._sessions, self.metrics, self._clock), server)
        checker = health.aio.HealthServicer()
        self._health.append(checker)
        health_pb2_grpc.add_HealthServicer_to_server(checker, server)
        reflection.enable_server_reflection(
            (*services, health.SERVICE_NAME, reflection.SERVICE_NAME), server
        )
        return server

    async def stop(self, grace: float | None = None) -> None:
        """Stop taking work, abort running sessions for their devices, and let RPCs in flight
        finish for up to ``grace`` seconds."""
        if not self._servers:
            return
        self._ready = False
        for checker in self._health:
            await checker.enter_graceful_shutdown()
        self._sessions.close_all("the aggregator is shutting down")
        await self._stop_servers(grace)
        logs.event(log, "aggregator stopped", aggregator_id=self.id)

    async def _stop_servers(self, grace: float | None) -> None:
        if self._source_cap is not None:
            self._source_cap.cancel()
            await asyncio.gather(self._source_cap, return_exceptions=True)
            self._source_cap = None
        await asyncio.gather(*(server.stop(grace) for server in self._servers))
        self._metrics_server.stop()
        self._servers, self._health = [], []
