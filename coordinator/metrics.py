"""Prometheus metrics of the coordinator, ``tally_coordinator_*`` in base units, on the
service's own registry (two coordinators in one test process never collide)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from tally.metrics import DURATION_BUCKETS


class CoordinatorMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.checkins = Counter(
            "tally_coordinator_checkins", "Device check-ins by outcome (task, retry, cancelled)",
            ["outcome"], registry=registry,
        )
        self.refusals = Counter(
            "tally_coordinator_refusals",
            "Device calls refused before any work, by RPC and reason (rate_limited, malformed, stale, "
            "not_enrolled, bad_signature, id_taken, key_taken, population_mismatch, replay)",
            ["rpc", "reason"], registry=registry,
        )
        self.task_reports = Counter(
            "tally_coordinator_task_reports",
            "Devices' reports on their tasks, by outcome (completed, dropped, aborted, refused; "
            "unmatched: not a task of the reporting device) and reason (training_error, "
            "model_mismatch, policy, already_sent_input, ...)",
            ["outcome", "reason"], registry=registry,
        )
        self.devices_selected = Counter(
            "tally_coordinator_devices_selected", "Devices placed in a cohort", registry=registry
        )
        self.plain_jobs = Counter(
            "tally_coordinator_plain_jobs",
            "Jobs accepted with secure.plain: benchmarks only, the aggregator sees each device's "
            "contribution", registry=registry,
        )
        self.rounds_committed = Counter(
            "tally_coordinator_rounds_committed", "Rounds whose model was checkpointed", registry=registry
        )
        self.rounds_retried = Counter(
            "tally_coordinator_rounds_retried",
            "Round retries: failed attempts and selection windows reopened for lack of devices",
            registry=registry,
        )
        self.rounds_failed = Counter(
            "tally_coordinator_rounds_failed", "Rounds abandoned after their retry budget (job failed)",
            registry=registry,
        )
        self.round_duration = Histogram(
            "tally_coordinator_round_duration_seconds", "Committed rounds, first check-in to commit",
            buckets=DURATION_BUCKETS, registry=registry,
        )
        self.cohort_sums = Counter(
            "tally_coordinator_cohort_sums", "Cohort sums by outcome (accepted, aborted, rejected, failed)",
            ["outcome"], registry=registry,
        )
        self.aggregators_up = Gauge(
            "tally_coordinator_aggregators_up", "Aggregators answering SERVING", registry=registry
        )
        self.current_round = Gauge(
            "tally_coordinator_current_round", "Round in progress per running job", ["job_id"],
            registry=registry,
        )
        self.bytes_served = Counter(
            "tally_coordinator_model_served_bytes", "Model and ONNX bytes streamed to devices",
            registry=registry,
        )
        self.revealed_values = Counter(
            "tally_coordinator_revealed_values",
            "Per-device values received in the clear under a job's reveal opt-in (DESIGN.md section 1)",
            ["job_id", "step"], registry=registry,
        )
