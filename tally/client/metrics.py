"""Prometheus metrics of the device side (``tally_client_*``, base units).

One ``ClientMetrics`` per process: a fleet's devices share it, so a load test reads one
scrape for the whole fleet. Serve it with ``tally.metrics.MetricsServer(metrics.registry)``.
docs/metrics.md lists every series.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Mapping

from prometheus_client import Counter, Gauge, Histogram

from tally.metrics import DURATION_BUCKETS, RoleRegistry

# Quantiles of the devices' own epsilon a process exports (no device label: bounded series).
EPSILON_QUANTILES = {"0.5": 50.0, "0.99": 99.0, "1": 100.0}
# accuracy differences: fine around 0, where kept_federated and adapted part
ADAPTATION_GAIN_BUCKETS = (-0.5, -0.2, -0.1, -0.05, -0.02, 0.0, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0)


def epsilon_quantile(devices_at: Mapping[float, int], q: float) -> float:
    """The ``q``-th percentile of the devices' epsilons, given as epsilon -> devices at it (0
    with none): the smallest epsilon that at least q % of the devices do not exceed (Hyndman and
    Fan's definition 1, numpy's "inverted_cdf"). So it is always one device's own figure, never
    one interpolated between two (+Inf beside a finite epsilon would give NaN)."""
    total = sum(devices_at.values())
    if total == 0:
        return 0.0
    rank, seen = max(math.ceil(q / 100 * total), 1), 0
    for epsilon in sorted(devices_at):
        seen += devices_at[epsilon]
        if seen >= rank:
            return epsilon
    raise AssertionError("unreachable: the ranks add up to the total")


class ClientMetrics:
    """The ``observe_*`` methods are what a load test's report also records
    (``tally.loadtest.timeline.TimelineMetrics`` extends them)."""

    def __init__(self) -> None:
        self.registry = r = RoleRegistry("client")
        self.checkins = Counter(
            "tally_client_checkins_total", "Check-ins by outcome: the coordinator's answer (task, retry; "
            "empty: neither)", ["outcome"], registry=r,
        )
        self.sessions = Counter(
            "tally_client_sessions_total",
            "Secure-aggregation sessions by outcome (completed, aborted, dropped)",
            ["outcome"],
            registry=r,
        )
        self.upload_bytes = Counter(
            "tally_client_upload_bytes_total", "Bytes sent on secure-aggregation streams", registry=r
        )
        self.download_bytes = Counter(
            "tally_client_download_bytes_total",
            "Bytes received, by kind (model chunks, session messages)",
            ["kind"],
            registry=r,
        )
        self.retries = Counter(
            "tally_client_rpc_retries_total", "Coordinator calls retried, by method and status", ["method", "code"],
            registry=r,
        )
        self.digest_mismatches = Counter(
            "tally_client_model_digest_mismatches_total", "Downloaded blobs discarded for a wrong SHA-256",
            registry=r,
        )
        self.download_seconds = Histogram(
            "tally_client_download_seconds", "Time to obtain a model blob (cache hits included)",
            buckets=DURATION_BUCKETS, registry=r,
        )
        self.compute_seconds = Histogram(
            "tally_client_compute_seconds", "Local computation of one contribution (training and encoding)",
            buckets=DURATION_BUCKETS, registry=r,
        )
        self.encoded_values = Counter(
            "tally_client_encoded_values_total", "Values encoded into secure sums", registry=r,
        )
        self.clipped_values = Counter(
            "tally_client_clipped_values_total",
            "Encoded values that were outside their field's clip bound and were clipped", registry=r,
        )
        self.session_seconds = Histogram(
            "tally_client_session_seconds", "Secure-aggregation session duration, by outcome", ["outcome"],
            buckets=DURATION_BUCKETS, registry=r,
        )
        self.active_sessions = Gauge(
            "tally_client_active_sessions", "Secure-aggregation sessions running now", registry=r,
        )
        self.phase_duration = Histogram(
            "tally_client_phase_duration_seconds",
            "From the aggregator's request for a protocol phase to the device's answer sent "
            "(masked_input includes waiting for the local computation)",
            ["phase"], buckets=DURATION_BUCKETS, registry=r,
        )
        self.rpc_seconds = Histogram(
            "tally_client_rpc_seconds", "Coordinator calls that succeeded, by method: latency as the device saw it",
            ["method"], buckets=DURATION_BUCKETS, registry=r,
        )
        self.privacy_checks = Counter(
            "tally_client_privacy_checks_total",
            "Steps a device with a noise floor (--min-noise-multiplier) checked, by outcome: accepted, or "
            "refused as no_noise, central, below_floor or share_mismatch", ["outcome"], registry=r,
        )
        self.task_refusals = Counter(
            "tally_client_task_refusals_total",
            "Tasks a device refused by its own rules, by report reason: privacy_budget_spent (the release "
            "would take its own privacy ledger past its budget, --max-epsilon), privacy_floor, policy, "
            "invalid_task, already_sent_input, algorithm_version", ["reason"], registry=r,
        )
        self.device_epsilon = Gauge(
            "tally_client_device_epsilon",
            "Epsilon each device of this process has spent by its own privacy ledger (at its budget's delta, "
            "1e-5 without one), as quantiles over the devices (0.5, 0.99, 1 = max; each one device's own "
            "figure); +Inf after a release without verifiable noise", ["quantile"], registry=r,
        )
        # Each device's latest epsilon (``observe_epsilon``), which the quantiles are taken over.
        self.epsilons: dict[str, float] = {}
        for label, q in EPSILON_QUANTILES.items():
            self.device_epsilon.labels(quantile=label).set_function(
                lambda q=q: epsilon_quantile(collections.Counter(self.epsilons.values()), q))
        self.misbehaviours = Counter(
            "tally_client_misbehaviours_total",
            "Misbehaviour a simulated device's behaviour profile made it commit, by kind (late, duplicate, "
            "replay, corrupt, stall, inconsistent, garbage): what the aggregators' refusals and "
            "exclusions should account for", ["kind"], registry=r,
        )
        self.dropouts = Counter(
            "tally_client_dropouts_total",
            "Sessions that ended without completing, by the protocol phase they were in and outcome "
            "(aborted; dropped: a simulated fleet's planned dropout)", ["phase", "outcome"], registry=r,
        )

        self.adaptations = Counter(
            "tally_client_adaptations_total",
            "Local adaptations of a job's model on the device, by method and outcome: adapted (the adapted "
            "model kept), kept_federated (no better than the federated model on the held-out examples), "
            "failed (this device could not adapt the job)", ["method", "outcome"], registry=r,
        )
        self.adaptation_gain = Histogram(
            "tally_client_adaptation_accuracy_gain_ratio",
            "Adapted minus federated accuracy on the device's held-out examples, by method (adaptations "
            "with held-out examples only)", ["method"], buckets=ADAPTATION_GAIN_BUCKETS, registry=r,
        )

    def observe_epsilon(self, device_id: str, epsilon: float) -> None:
        """``device_id``'s own ledger has spent ``epsilon`` (when the device starts, and after
        each task)."""
        self.epsilons[device_id] = epsilon

    def observe_refusal(self, reason: str) -> None:
        """A device refused a task (``tally.wire.task_reports.REFUSALS``)."""
        self.task_refusals.labels(reason=reason).inc()

    def observe_rpc(self, method: str, seconds: float) -> None:
        self.rpc_seconds.labels(method=method).observe(seconds)

    def observe_phase(self, job_id: str, round_: int, phase: str, seconds: float) -> None:
        self.phase_duration.labels(phase=phase).observe(seconds)

    def observe_end(self, phase: str, outcome: str) -> None:
        """A session ended without completing, in ``phase``."""
        self.dropouts.labels(phase=phase, outcome=outcome).inc()
