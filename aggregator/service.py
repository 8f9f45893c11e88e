"""The secure-aggregator service: both gRPC services, health and reflection on one port, and
Prometheus metrics on another.

``AggregatorControl`` (the coordinator) and ``SecureAggregation`` (devices) share the port, so one
address per replica is all the coordinator hands devices. Any number of replicas can run side by
side: each holds only the sessions the coordinator opened on it, and only until they end.
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Callable

import grpc
from cryptography.hazmat.primitives.asymmetric import ed25519
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from tally import logs
from tally.metrics import MetricsServer
from tally.security import TicketVerifier, TLSConfig, bind
from tally.security.tls import server_options
from tally.security.certs import COORDINATOR_CN
from tally.wire.v1 import aggregator_pb2, aggregator_pb2_grpc, secagg_pb2, secagg_pb2_grpc

from aggregator.control import ControlServicer
from aggregator.metrics import AggregatorMetrics
from aggregator.registry import SessionRegistry
from aggregator.stream import DeviceStreams

log = logging.getLogger("tally.aggregator")

SERVICE_NAMES = (
    aggregator_pb2.DESCRIPTOR.services_by_name["AggregatorControl"].full_name,
    secagg_pb2.DESCRIPTOR.services_by_name["SecureAggregation"].full_name,
)
_WILDCARD_HOSTS = {"", "0.0.0.0", "[::]", "::"}
# What an unauthenticated peer can make the aggregator buffer: gRPC reads a message whole before
# the Join in it is checked. Four masked-input chunks, and an OpenSession of ~40,000 devices.
DEFAULT_MAX_REQUEST_BYTES = 4 << 20


class AggregatorService:
    """``ticket_public_key``: the coordinator's Ed25519 ticket key (raw 32 bytes or a key
    object). ``advertised_address``: what devices should dial, when it differs from ``listen``
    (behind a Service or NAT). ``controller``: the certificate CN the control API admits when
    ``tls`` demands client certificates. ``max_request_bytes``: the largest message received;
    masked inputs arrive in chunks (``tally.wire.chunks``), so only a very large cohort's
    OpenSession needs more than the default."""

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
    ) -> None:
        if not aggregator_id:
            raise ValueError("aggregator_id must be non-empty")
        self.id = aggregator_id
        self.metrics = AggregatorMetrics()
        self._listen = listen
        self._tls = tls
        self._advertised = advertised_address
        self._metrics_request = (metrics_port, metrics_addr)
        self._options = server_options(max_message_bytes, max_request_bytes)
        self._verifier = TicketVerifier(ticket_public_key)
        self._registry = SessionRegistry(result_ttl_s)
        self._clock = clock
        self._controller = controller
        self._server: grpc.aio.Server | None = None
        self._health: health.aio.HealthServicer | None = None
        self._metrics_server = MetricsServer(self.metrics.registry)
        self._port: int | None = None
        self._metrics_port: int | None = None

    @property
    def port(self) -> int:
        if self._port is None:
            raise RuntimeError("the aggregator is not started")
        return self._port

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
        if self._server is not None:
            raise RuntimeError("the aggregator is already started")
        server = self._build()
        self._port = bind(server, self._listen, self._tls)
        self._metrics_port = self._metrics_server.start(*self._metrics_request)
        try:
            await server.start()
        except BaseException:
            self._metrics_server.stop()
            raise
        self._server = server
        for name in ("", *SERVICE_NAMES):
            await self._health.set(name, health_pb2.HealthCheckResponse.SERVING)
        logs.event(log, "aggregator started", aggregator_id=self.id, address=self.address,
                   port=self._port, metrics_port=self._metrics_port)
        return self._port

    def _build(self) -> grpc.aio.Server:
        server = grpc.aio.server(options=self._options)
        aggregator_pb2_grpc.add_AggregatorControlServicer_to_server(
            ControlServicer(self.id, self._verifier, self._registry, self.metrics, self._clock,
                            lambda: self.address, self._controller),
            server,
        )
        secagg_pb2_grpc.add_SecureAggregationServicer_to_server(
            DeviceStreams(self.id, self._verifier, self._registry, self.metrics, self._clock),
            server,
        )
        self._health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        reflection.enable_server_reflection(
            (*SERVICE_NAMES, health.SERVICE_NAME, reflection.SERVICE_NAME), server
        )
        return server

    async def stop(self, grace: float | None = None) -> None:
        """Stop taking work, abort running sessions for their devices, and let RPCs in flight
        finish for up to ``grace`` seconds."""
        if self._server is None:
            return
        await self._health.enter_graceful_shutdown()
        self._registry.close_all("the aggregator is shutting down")
        await self._server.stop(grace)
        self._metrics_server.stop()
        self._server = None
        logs.event(log, "aggregator stopped", aggregator_id=self.id)
