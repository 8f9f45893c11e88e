"""``tally_privacy_*`` gauges: the epsilon each running job has spent, at its delta.

Ledgers live in the job runners; a collector reads them at scrape time. A finished job's ledger
stays published (its final epsilon is still worth a dashboard) until the process ends; a
restarted coordinator publishes the ledgers of the jobs it resumes, rebuilt from their rounds.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

_LEDGERS: dict[str, Any] = {}


def publish(job_id: str, ledger: Any) -> None:
    """Expose ``ledger`` (a ``PrivacyLedger``) under ``job_id``."""
    _LEDGERS[job_id] = ledger


class PrivacyCollector(Collector):
    def collect(self) -> Iterator[GaugeMetricFamily]:
        total = GaugeMetricFamily("tally_privacy_epsilon", "Epsilon a job has spent so far, at its delta",
                                  labels=["job_id"])
        last = GaugeMetricFamily("tally_privacy_round_epsilon", "Epsilon of the job's last released sum alone",
                                 labels=["job_id"])
        delta = GaugeMetricFamily("tally_privacy_delta", "Delta of the job's (epsilon, delta) guarantee",
                                  labels=["job_id"])
        for job_id, ledger in sorted(_LEDGERS.items()):
            if ledger.rounds:
                total.add_metric([job_id], ledger.epsilon)
                last.add_metric([job_id], ledger.rounds[-1].epsilon_round)
                delta.add_metric([job_id], ledger.delta)
        yield from (total, last, delta)
