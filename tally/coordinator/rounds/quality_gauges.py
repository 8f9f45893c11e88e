"""Model quality on ``/metrics``: each running job's latest figures (``tally.evaluation``) as
``tally_coordinator_model_quality{job_id, metric}``.

Cardinality is bounded by jobs, never by devices (the figures are sums over a round's devices): a
histogram's bins stay out (its worst-decile estimate ``eval.accuracy_p10`` is in), and a finished
job's series stay (its final figures are what a dashboard shows last) until ``KEEP_FINISHED`` more
recent jobs have finished.
"""

from __future__ import annotations

from collections import deque

from prometheus_client import Gauge

from tally.coordinator.state.events import TERMINAL_STATES
from tally.coordinator.state.store import EventRecord
from tally.evaluation import is_quality

KEEP_FINISHED = 20


def gauged(key: str) -> bool:
    """The figures exported: model quality, less the histograms' bins."""
    return is_quality(key) and ".hist." not in key and not key.startswith("eval.accuracy_hist.")


class QualityGauges:
    """An ``EventHub`` listener keeping the gauge at each job's latest committed figures."""

    def __init__(self, gauge: Gauge) -> None:
        self.gauge = gauge
        self._series: dict[str, set[str]] = {}
        self._finished: deque[str] = deque()

    def __call__(self, event: EventRecord) -> None:
        if event.phase == "COMMITTED":
            for key, value in event.metrics.items():
                if gauged(key):
                    self.gauge.labels(job_id=event.job_id, metric=key).set(value)
                    self._series.setdefault(event.job_id, set()).add(key)
        if event.state in TERMINAL_STATES and event.job_id in self._series and event.job_id not in self._finished:
            self._finished.append(event.job_id)
            while len(self._finished) > KEEP_FINISHED:
                old = self._finished.popleft()
                for key in self._series.pop(old, ()):
                    self.gauge.remove(old, key)
