"""Connections that end, and a cap on how many one source holds, on every device-facing port.

Why (issue 38, finding 3): a TLS connection that completes the HTTP/2 preface and opens no stream
needs only the public CA, and gRPC kept every such connection for good: 1,000 of them from one host
held an aggregator's descriptors and 45 MiB for over a minute, and under ``ulimit -n 1024`` left
no descriptor for devices.

What gRPC offers, as server channel arguments (``ConnectionLimits.server_options``):

- ``grpc.max_connection_idle_ms``: a connection with no call in flight for ``idle_s`` is sent a
  GOAWAY and closed (a client's channel reconnects on its next call);
- ``grpc.max_connection_age_ms`` and ``..._grace_ms``: every connection is asked to go after
  ``max_age_s`` (gRPC adds ±10 % jitter) and closed ``age_grace_s`` later, calls in flight or not;
- ``grpc.server_handshake_timeout_ms``: TLS and the HTTP/2 preface within ``handshake_s``;
- keepalive: the server pings a peer with calls in flight every ``KEEPALIVE_S`` and drops it
  when no answer comes within ``KEEPALIVE_TIMEOUT_S`` (a device that vanished mid-session); a
  peer that pings more often than every ``MIN_PEER_PING_S`` without calls is sent away after two
  such pings;
- ``grpc.max_allowed_incoming_connections``: a cap on the server's connections in all, below the
  process's descriptor limit, so that it always keeps descriptors for its own files and calls.

gRPC has nothing per source: gRPC Python exposes no accept hook, and a connection that opens no
stream never reaches an interceptor. ``SourceCap`` is the mechanism instead: every ``SWEEP_S`` the
process lists its own established TCP connections on the port (psutil, which reads ``/proc``),
and for any source address holding more than its cap it shuts down (``shutdown(2)``) the
surplus on gRPC's own descriptors, checked to still be those connections first; gRPC sees the
peer gone and closes them itself. Which of an offending source's connections go is arbitrary.
Between sweeps a source can exceed its cap; the total cap holds meanwhile. Devices behind one
NAT, or a gateway that does not keep the client's address, share one source: raise the cap, or
cap connections at the gateway (docs/security.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import math
import os
import resource
import socket
from collections import defaultdict
from dataclasses import dataclass, replace
from typing import Any

import psutil
from prometheus_client import CollectorRegistry, Counter

from tally import logs

log = logging.getLogger(__name__)

SWEEP_S = 0.5
KEEPALIVE_S = 60.0
KEEPALIVE_TIMEOUT_S = 20.0
MIN_PEER_PING_S = 30.0
# Of the soft open-file limit, what the connections of one server may take in all, and of that
# total what one source may hold, when not configured.
TOTAL_SHARE = 0.75
SOURCE_SHARE = 1 / 8


@dataclass(frozen=True)
class ConnectionLimits:
    """The limits of one device-facing port. ``total`` and ``per_source`` None: derived from the
    process's open-file limit when the server starts (``resolved``); ``per_source`` 0: no cap."""

    idle_s: float = 60.0
    max_age_s: float = 3600.0
    age_grace_s: float = 3600.0
    handshake_s: float = 20.0
    total: int | None = None
    per_source: int | None = None

    def __post_init__(self) -> None:
        for name in ("idle_s", "max_age_s", "age_grace_s", "handshake_s"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
                raise ValueError(f"connection limit {name} must be a positive number of seconds, got {value!r}")
        if self.total is not None and self.total < 1:
            raise ValueError(f"connection limit total must be >= 1, got {self.total}")
        if self.per_source is not None and self.per_source < 0:
            raise ValueError(f"connection limit per_source must be >= 0 (0: no cap), got {self.per_source}")

    def resolved(self, processes: int = 1) -> ConnectionLimits:
        """Concrete ``total`` and ``per_source`` for one of ``processes`` serving the port: each
        has its own descriptors, and the kernel spreads a source's connections over them, so each
        holds its share of the per-source cap."""
        total = self.total
        if total is None:
            soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
            total = max(1, int(soft * TOTAL_SHARE)) if soft != resource.RLIM_INFINITY else 1 << 20
        per_source = self.per_source if self.per_source is not None else max(1, int(total * SOURCE_SHARE))
        return replace(self, total=total, per_source=math.ceil(per_source / processes))

    def server_options(self) -> list[tuple[str, int]]:
        """gRPC server arguments for these limits (``resolved`` first)."""
        if self.total is None:
            raise ValueError("resolve the limits first (ConnectionLimits.resolved)")
        return [
            ("grpc.max_connection_idle_ms", _ms(self.idle_s)),
            ("grpc.max_connection_age_ms", _ms(self.max_age_s)),
            ("grpc.max_connection_age_grace_ms", _ms(self.age_grace_s)),
            ("grpc.server_handshake_timeout_ms", _ms(self.handshake_s)),
            ("grpc.keepalive_time_ms", _ms(KEEPALIVE_S)),
            ("grpc.keepalive_timeout_ms", _ms(KEEPALIVE_TIMEOUT_S)),
            ("grpc.keepalive_permit_without_calls", 0),
            ("grpc.http2.min_ping_interval_without_data_ms", _ms(MIN_PEER_PING_S)),
            ("grpc.http2.max_ping_strikes", 2),
            ("grpc.max_allowed_incoming_connections", self.total),
        ]


DEFAULT_LIMITS = ConnectionLimits()


class SourceCap:
    """Holds each source address to ``per_source`` of this process's connections on ``port``
    (see the module docstring); ``run`` sweeps until cancelled. What it shuts is counted in
    ``tally_<role>_connections_over_source_cap_total`` on ``registry``."""

    def __init__(self, port: int, per_source: int, registry: CollectorRegistry, role: str) -> None:
        self.port, self.per_source = port, per_source
        self.closed = Counter(f"tally_{role}_connections_over_source_cap",
                              "Connections shut down because their source address held more than its "
                              "per-source cap (--max-connections-per-source)", registry=registry)

    async def run(self) -> None:
        if self.per_source == 0:
            return
        while True:
            await asyncio.sleep(SWEEP_S)
            try:
                over = await asyncio.to_thread(self.sweep)
            except (OSError, psutil.Error) as exc:  # /proc unreadable: the other limits still hold
                logs.event(log, "connection sweep failed", logging.WARNING, port=self.port, error=str(exc))
                continue
            for source, count in over.items():
                logs.event(log, "connections over the per-source cap closed", logging.WARNING, port=self.port,
                           source=source, closed=count, cap=self.per_source)

    def sweep(self) -> dict[str, int]:
        """Shut down each source's connections beyond the cap; {source: connections shut}."""
        if _open_descriptors() <= self.per_source:
            return {}  # no source can be over the cap: skip reading every socket
        by_source: dict[str, list[Any]] = defaultdict(list)
        for conn in psutil.Process().net_connections(kind="tcp"):
            if conn.status == psutil.CONN_ESTABLISHED and conn.raddr and conn.laddr.port == self.port:
                by_source[conn.raddr.ip].append(conn)
        over = {}
        for source, conns in by_source.items():
            surplus = sorted(conns, key=lambda c: c.fd)[self.per_source:]
            shut = sum(_shut_down(c) for c in surplus)
            if shut:
                over[source] = shut
                self.closed.inc(shut)
        return over


def guard(port: int, limits: ConnectionLimits, registry: CollectorRegistry, role: str) -> asyncio.Task[None]:
    """Start holding ``port``'s sources to ``limits.per_source`` (resolved) in the running loop;
    cancel the task to stop."""
    assert limits.per_source is not None, "resolve the limits first (ConnectionLimits.resolved)"
    return asyncio.get_running_loop().create_task(SourceCap(port, limits.per_source, registry, role).run())


def _ms(seconds: float) -> int:
    return int(seconds * 1000)


def _open_descriptors() -> int:
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:
        return psutil.Process().num_fds()


def _shut_down(conn: Any) -> bool:
    """Shut down the socket of ``conn`` on its descriptor, unless that descriptor is no longer
    this connection (gRPC closed it and reused the number since it was listed). The descriptor
    stays gRPC's: it closes it once it sees the connection end."""
    if conn.fd < 0:
        return False
    try:
        sock = socket.socket(fileno=conn.fd)
    except OSError:
        return False
    try:
        if sock.getpeername()[:2] != tuple(conn.raddr) or sock.getsockname()[1] != conn.laddr.port:
            return False
        sock.shutdown(socket.SHUT_RDWR)
        return True
    except OSError as exc:
        if exc.errno not in (errno.ENOTCONN, errno.ENOTSOCK, errno.EBADF):
            raise
        return False
    finally:
        with contextlib.suppress(OSError):
            sock.detach()
