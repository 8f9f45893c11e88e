"""The aggregator's Prometheus metrics, in base units, on a registry of its own.

Each ``AggregatorService`` owns one ``AggregatorMetrics`` so that two aggregators in one process
(tests, the demo) never share or collide on a series. docs/metrics.md lists every series.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

from tally.metrics import DURATION_BUCKETS, RoleRegistry

# Devices per phase: from a handful (tests) to tens of thousands (a large cohort).
DEVICE_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 50000)


class AggregatorMetrics:
    def __init__(self) -> None:
        self.registry = r = RoleRegistry("aggregator")
        self.sessions_opened = Counter(
            "tally_aggregator_sessions_opened_total", "Sessions opened by the coordinator",
            registry=r,
        )
        self.sessions_finished = Counter(
            "tally_aggregator_sessions_finished_total",
            "Sessions that ended, by outcome (completed, aborted, closed before the end)",
            ["outcome"], registry=r,
        )
        self.active_sessions = Gauge(
            "tally_aggregator_active_sessions", "Sessions running now", registry=r
        )
        self.leader_epoch = Gauge(
            "tally_aggregator_coordinator_leader_epoch",
            "The newest coordinator leader epoch this aggregator knows of (replicas over PostgreSQL); "
            "session tickets of older ones are refused", registry=r,
        )
        self.phase_duration = Histogram(
            "tally_aggregator_phase_duration_seconds", "Wall time of each protocol phase",
            ["phase"], buckets=DURATION_BUCKETS, registry=r,
        )
        self.phase_devices = Histogram(
            "tally_aggregator_phase_devices",
            "Devices that answered a phase before it closed (the phase's survivors)",
            ["phase"], buckets=DEVICE_BUCKETS, registry=r,
        )
        self.dropouts = Counter(
            "tally_aggregator_dropouts_total",
            "Devices a phase expected that did not make it into the next one",
            ["phase"], registry=r,
        )
        self.received_bytes = Counter(
            "tally_aggregator_received_bytes_total",
            "Serialized size of the device messages received", registry=r,
        )
        self.sent_bytes = Counter(
            "tally_aggregator_sent_bytes_total",
            "Serialized size of the messages sent to devices", registry=r,
        )
        self.engine_cpu = Counter(
            "tally_aggregator_engine_cpu_seconds",
            "CPU time inside the secure-sum engine (the sans-IO server's calls), by the phase it was "
            "in; the rest of the process's CPU is gRPC, TLS, protobuf and the event loop",
            ["phase"], registry=r,
        )
        self.wire_cpu = Counter(
            "tally_aggregator_wire_cpu_seconds",
            "CPU time converting between the wire and the engine's messages: 'decode' parses device "
            "messages and turns them into the engine's values, 'encode' turns what the engine emits "
            "into messages and serialises them; with the engine's CPU, what is left of the "
            "process's CPU is gRPC, TLS and the event loop",
            ["direction"], registry=r,
        )
        self.unmask_seconds = Histogram(
            "tally_aggregator_unmask_seconds",
            "CPU time of the server call that closes an Unmask phase (reconstruction and mask "
            "removal)", buckets=DURATION_BUCKETS, registry=r,
        )
        self.rejected = Counter(
            "tally_aggregator_rejected_total",
            "Requests and device messages refused, by reason and gRPC status",
            ["reason", "status"], registry=r,
        )
        self.misbehaving_devices = Counter(
            "tally_aggregator_misbehaving_devices_total",
            "Devices caught sending shares that do not rebuild their owner's committed secret "
            "(decoded around; the sum went on without trusting them), or complaining about a "
            "share its dealer's proven key shows good", registry=r,
        )
        self.excluded_devices = Counter(
            "tally_aggregator_excluded_devices_total",
            "Dealers excluded for every device before any masked input: their shares were proved "
            "bad under their own proven key, their check does not open their committed secrets, or "
            "they left complaints about them unanswered", registry=r,
        )
        self.disputed_complaints = Counter(
            "tally_aggregator_disputed_complaints_total",
            "Share complaints no proof settled (their dealer left first): nobody's fault on record",
            registry=r,
        )
        self.late_messages = Counter(
            "tally_aggregator_late_messages_total",
            "Unmask answers that arrived after their sum was already unmasked (ignored)",
            registry=r,
        )

    def reject(self, reason: str, status: str) -> None:
        self.rejected.labels(reason=reason, status=status).inc()
