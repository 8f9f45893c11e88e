"""Prometheus metrics of the coordinator, ``tally_coordinator_*`` (and the jobs' privacy
ledgers, ``tally_privacy_*``) in base units, on the service's own registry (two coordinators in
one test process never collide). docs/metrics.md lists every series."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from tally.metrics import DURATION_BUCKETS, RoleRegistry
from tally.privacy.metrics import PrivacyCollector

# From the planner's 0.2 s floor to the pacer's one-hour ceiling.
RETRY_AFTER_BUCKETS = (0.2, 0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300, 600, 1800, 3600)
JOB_STATES = ("PENDING", "RUNNING", "SUCCEEDED", "FAILED", "CANCELLED")


class DeviceMetrics:
    """What every process serving devices counts (the coordinator and its device fronts, each on
    its own port: Prometheus sums them over the targets)."""

    def __init__(self, registry: RoleRegistry) -> None:
        self.registry = registry
        self.checkins = Counter(
            "tally_coordinator_checkins", "Device check-ins by outcome (task, retry, cancelled)",
            ["outcome"], registry=registry,
        )
        self.retry_after = Histogram(
            "tally_coordinator_checkin_retry_after_seconds",
            "Come-back times given to devices turned away at check-in (after pace steering: with "
            "--checkin-rate they grow with the population so arrivals stay at the target rate)",
            buckets=RETRY_AFTER_BUCKETS, registry=registry,
        )
        self.refusals = Counter(
            "tally_coordinator_refusals",
            "Device calls refused before any work, by RPC and reason (rate_limited, malformed, stale, "
            "not_enrolled, bad_signature, id_taken, key_taken, population_mismatch, replay, revoked)",
            ["rpc", "reason"], registry=registry,
        )
        self.leader = Gauge(
            "tally_coordinator_leader",
            "1 in the process that plans rounds (a coordinator, or the replica holding the lead over "
            "PostgreSQL), 0 in a device front or a following replica: rounds can run while the "
            "maximum over the coordinator's targets is 1",
            registry=registry,
        )
        # The idle check-in is the call a population makes most: its series, looked up once.
        self.checkins_retried = self.checkins.labels(outcome="retry")


class CoordinatorMetrics(DeviceMetrics):
    def __init__(self) -> None:
        super().__init__(RoleRegistry("coordinator"))
        registry = self.registry
        # Jobs' privacy ledgers (tally/privacy/metrics.py) are read at scrape time.
        registry.register(PrivacyCollector())
        # Only where rounds are planned: a following replica or a front does not count them.
        self.replicas = Gauge(
            "tally_coordinator_replicas",
            "Coordinator replicas alive (a heartbeat within the last 5 s), itself included, as the "
            "leading replica counts them to pace what the others forward; 1 without replicas",
            registry=registry,
        )
        self.replicas.set(1)
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
        self.devices_excluded = Counter(
            "tally_coordinator_devices_excluded",
            "Devices an aggregator excluded from a session before any masked input, their shares "
            "proved bad (each is named in the job's events)", registry=registry,
        )
        self.seats_released = Counter(
            "tally_coordinator_seats_released",
            "Seats of a round given back for its retries because their device cannot have sent an "
            "input, by cause (undelivered: the task never reached it; report: its task report says "
            "so; ledger: its durable input ledger, e.g. after the device restarted)",
            ["cause"], registry=registry,
        )
        for cause in ("undelivered", "report", "ledger"):
            self.seats_released.labels(cause=cause)
        self.devices_seated_early = Counter(
            "tally_coordinator_devices_seated_early",
            "Devices a selection seated as it opened, held since they checked in while the previous "
            "attempt aggregated", registry=registry,
        )
        self.front_restarts = Counter(
            "tally_coordinator_device_front_restarts",
            "Device fronts (--device-processes) the coordinator started again after they exited",
            registry=registry,
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
            "tally_coordinator_round_duration_seconds",
            "Wall time of committed rounds, from the round's start to its last sum applied (retries "
            "included; the checkpoint after it is tally_coordinator_commit_lag_seconds)",
            buckets=DURATION_BUCKETS, registry=registry,
        )
        self.phase_duration = Histogram(
            "tally_coordinator_phase_duration_seconds",
            "Wall time of each phase of a round attempt: selection (check-ins until the cohorts' "
            "sessions are open), aggregation (until a step's sum is in), update (the algorithm's "
            "server half on that sum); failed attempts included",
            ["phase"], buckets=DURATION_BUCKETS, registry=registry,
        )
        self.commit_lag = Histogram(
            "tally_coordinator_commit_lag_seconds",
            "Checkpointing a round after its last sum: model, state and ONNX written, the round "
            "recorded as committed", buckets=DURATION_BUCKETS, registry=registry,
        )
        self.cohort_sums = Counter(
            "tally_coordinator_cohort_sums", "Cohort sums by outcome (accepted, aborted, rejected, failed)",
            ["outcome"], registry=registry,
        )
        self.aggregators_up = Gauge(
            "tally_coordinator_aggregators_up", "Aggregators answering SERVING", registry=registry
        )
        self.aggregator_up = Gauge(
            "tally_coordinator_aggregator_up",
            "Per configured aggregator: 1 when its control API answered the last health check, else 0",
            ["aggregator"], registry=registry,
        )
        self.devices_out_of_budget = Gauge(
            "tally_coordinator_devices_out_of_budget",
            "Devices that stated their own privacy budget is spent for a running job (no longer selected)",
            ["job_id"], registry=registry,
        )
        self.current_round = Gauge(
            "tally_coordinator_current_round", "Round in progress per running job", ["job_id"],
            registry=registry,
        )
        self.model_quality = Gauge(
            "tally_coordinator_model_quality",
            "A job's latest committed model-quality figure from its devices' metric sums (eval.loss, "
            "eval.accuracy, train.loss, personal.accuracy, eval.accuracy_p10, per-domain, custom: "
            "docs/evaluation.md); a ratio, a mean loss or a count, never one device's value",
            ["job_id", "metric"], registry=registry,
        )
        self.bytes_served = Counter(
            "tally_coordinator_model_served_bytes", "Model and ONNX bytes streamed to devices",
            registry=registry,
        )
        self.cohort_sum_bytes = Counter(
            "tally_coordinator_cohort_sum_bytes",
            "Serialized size of the cohort sums received from aggregators", registry=registry,
        )
        self.revealed_values = Counter(
            "tally_coordinator_revealed_values",
            "Per-device values received in the clear under a job's reveal opt-in (DESIGN.md section 1)",
            ["job_id", "step"], registry=registry,
        )

    def watch(self, job_counts: Callable[[], dict[str, int]], open_sessions: Callable[[], int]) -> None:
        """Export what the store and the active jobs know, read at scrape time: jobs per state, and
        the aggregator sessions the running rounds hold open."""
        self.registry.register(_ServiceState(job_counts, open_sessions))


class _ServiceState(Collector):
    def __init__(self, job_counts: Callable[[], dict[str, int]], open_sessions: Callable[[], int]) -> None:
        self._job_counts, self._open_sessions = job_counts, open_sessions

    def collect(self) -> Iterator[GaugeMetricFamily]:
        jobs = GaugeMetricFamily(
            "tally_coordinator_jobs", f"Jobs in the store by state ({', '.join(JOB_STATES)})", labels=["state"])
        counts = self._job_counts()
        for state in JOB_STATES:
            jobs.add_metric([state], counts.get(state, 0))
        yield jobs
        yield GaugeMetricFamily(
            "tally_coordinator_open_sessions",
            "Secure-aggregation sessions the running rounds hold open on aggregators (one per cohort)",
            value=self._open_sessions(),
        )
