"""Prometheus metrics per process (or per service object in tests): each service owns a
registry and serves it on its own port, so two services in one process never collide.

Every role's registry is a ``RoleRegistry``: it carries ``tally_build_info`` and the process and
Python runtime collectors, and it leaves out the ``_created`` samples prometheus_client adds to
every counter and histogram (the text format shows each as one more series per label set, which
no rule or dashboard reads). ``MetricsServer`` serves it beside plain-HTTP ``/healthz`` and
``/readyz`` on one port per role (``METRICS_PORTS``), loopback unless told otherwise.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from socketserver import ThreadingMixIn
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from cryptography import x509
from prometheus_client import CollectorRegistry, Gauge, GCCollector, PlatformCollector, ProcessCollector, make_wsgi_app
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from tally.version import VERSION

# Phase durations span milliseconds (keys) to minutes (local training).
DURATION_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)

# The default /metrics port of each role (docs/metrics.md): one per role so that roles sharing a
# host never collide, clear of node_exporter's 9100 (which Tally used before) and Prometheus's own
# 9090-9094. 9464 is also OpenTelemetry's exporter default: only one of the two fits in one pod.
METRICS_PORTS = {"coordinator": 9464, "aggregator": 9465, "client": 9466}


class RoleRegistry(CollectorRegistry):
    """The registry of one role (``coordinator``, ``aggregator`` or ``client``)."""

    def __init__(self, role: str) -> None:
        if role not in METRICS_PORTS:
            raise ValueError(f"role must be one of {sorted(METRICS_PORTS)}, got {role!r}")
        super().__init__()
        self.role = role
        ProcessCollector(registry=self)
        PlatformCollector(registry=self)
        GCCollector(registry=self)
        Gauge(
            "tally_build_info", "Always 1; the labels say which Tally version runs in which role",
            ["version", "role"], registry=self,
        ).labels(version=VERSION, role=role).set(1)

    def collect(self) -> Iterator[Metric]:
        for metric in super().collect():
            created = f"{metric.name}_created"
            metric.samples = [s for s in metric.samples if s.name != created]
            yield metric


class CertificateExpiry(Collector):
    """``tally_tls_certificate_expiry_timestamp_seconds{role}`` of a service's certificate, read at
    scrape time: services pick up renewed certificates in place, and so does the alert on expiry."""

    def __init__(self, certificate: Path, role: str) -> None:
        self._path, self._role = certificate, role

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily(
            "tally_tls_certificate_expiry_timestamp_seconds",
            "When the service's TLS certificate expires (Unix time, seconds)", labels=["role"],
        )
        try:
            cert = x509.load_pem_x509_certificate(self._path.read_bytes())
        except (OSError, ValueError):
            pass  # mid-renewal: no sample this scrape
        else:
            family.add_metric([self._role], cert.not_valid_after_utc.timestamp())
        yield family


def watch_certificate(registry: CollectorRegistry, certificate: Path | None, role: str) -> None:
    """Export the expiry of ``certificate`` (nothing for a plaintext service)."""
    if certificate is not None:
        registry.register(CertificateExpiry(certificate, role))


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True  # a scrape in flight never holds the process open


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        """Scrapes and probes come every few seconds: not worth a log line each."""


def _plain(start_response: Callable, status: str, body: bytes) -> Iterable[bytes]:
    start_response(status, [("Content-Type", "text/plain; charset=utf-8"), ("Content-Length", str(len(body)))])
    return [body]


class MetricsServer:
    """One service's HTTP port: ``/metrics``; ``/healthz``, 200 while the process answers; and
    ``/readyz``, 200 once ``ready()`` says the service takes work, 503 before and while stopping.
    Kubernetes probes, load balancers and people with curl need no gRPC client for them."""

    def __init__(self, registry: CollectorRegistry, ready: Callable[[], bool] = lambda: True) -> None:
        self.registry, self.ready = registry, ready
        self._metrics = make_wsgi_app(registry)
        self._server: WSGIServer | None = None

    def start(self, port: int = 0, addr: str = "127.0.0.1") -> int:
        """Serve in a daemon thread; port 0 picks a free port, which is returned. ``OSError``
        names the address when it cannot be bound (a port in use, an address not this host's)."""
        try:
            family, _, _, _, sockaddr = socket.getaddrinfo(
                addr, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
            server_class = type("MetricsHTTPServer", (_Server,), {"address_family": family})
            self._server = make_server(sockaddr[0], port, self._app, server_class, handler_class=_QuietHandler)
        except OSError as exc:
            error = OSError(f"metrics server on {addr}:{port}: {exc.strerror or exc}")
            error.errno = exc.errno
            raise error from None
        threading.Thread(target=self._server.serve_forever, name="metrics-http", daemon=True).start()
        return self._server.server_port

    def _app(self, environ: dict, start_response: Callable) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "")
        if path == "/healthz":
            return _plain(start_response, "200 OK", b"ok\n")
        if path == "/readyz":
            if self.ready():
                return _plain(start_response, "200 OK", b"ready\n")
            return _plain(start_response, "503 Service Unavailable", b"not ready\n")
        return self._metrics(environ, start_response)

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
