"""Prometheus metrics per process (or per service object in tests): each service owns a
registry and serves it on its own port, so two services in one process never collide."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from wsgiref.simple_server import WSGIServer

from cryptography import x509
from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from tally.privacy.metrics import PrivacyCollector

# Phase durations span milliseconds (keys) to minutes (local training).
DURATION_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)


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


@dataclass
class MetricsServer:
    registry: CollectorRegistry = field(default_factory=CollectorRegistry)
    _server: WSGIServer | None = None

    def __post_init__(self) -> None:
        # Jobs' privacy ledgers (tally/privacy/metrics.py) are read at scrape time.
        self.registry.register(PrivacyCollector())

    def start(self, port: int = 0, addr: str = "127.0.0.1") -> int:
        """Serve /metrics; port 0 picks a free port, which is returned."""
        self._server, _ = start_http_server(port, addr=addr, registry=self.registry)
        return self._server.server_port

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
