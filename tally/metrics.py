"""Prometheus metrics per process (or per service object in tests): each service owns a
registry and serves it on its own port, so two services in one process never collide."""

from __future__ import annotations

from dataclasses import dataclass, field
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, start_http_server

from tally.privacy.metrics import PrivacyCollector

# Phase durations span milliseconds (keys) to minutes (local training).
DURATION_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)


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
