"""What a device tells the coordinator about its tasks.

A failed task used to be visible only in the device's own log: the operator saw "0 devices
answered" and nothing else. Each task now ends in a ``TaskReport`` that rides on the device's next
check-in, with a reason from a fixed set so the coordinator can count reasons per round.

The report also says whether the device sent a masked input. That is what a retry of a round
needs to know: two sums of one round over cohorts that differ by one device isolate that device's
input, so a device that sent an input in a round must never send another in it, while a device
that sent none can safely be seated again. The device enforces the first part itself
(``tally.client.input_ledger``), whatever the coordinator asks; the coordinator uses the reports
only to stop wasting seats on devices that will refuse.
"""

from __future__ import annotations

from collections import deque

from tally.wire.task_reports import MAX_REPORTS, REASONS
from tally.wire.v1 import coordinator_pb2

Outcome = coordinator_pb2.TaskReport.Outcome

DETAIL_CHARS = 500


class TaskReports:
    """Reports waiting for the next check-in; those sent are dropped only once it succeeded."""

    def __init__(self) -> None:
        # A device that cannot reach the coordinator for many tasks drops the oldest reports
        # rather than grow without bound (and a check-in carries at most MAX_REPORTS).
        self._pending: deque[coordinator_pb2.TaskReport] = deque(maxlen=MAX_REPORTS)

    def add(
        self,
        task: coordinator_pb2.TaskAssignment,
        outcome: Outcome,
        reason: str = "",
        detail: str = "",
        *,
        sent_input: bool,
    ) -> None:
        if reason not in REASONS:
            raise ValueError(f"unknown task report reason {reason!r}")
        self._pending.append(coordinator_pb2.TaskReport(
            job_id=task.job_id, round=task.round, task_id=task.task_id, outcome=outcome,
            reason=reason, detail=detail[:DETAIL_CHARS], sent_input=sent_input,
        ))

    def pending(self) -> list[coordinator_pb2.TaskReport]:
        return list(self._pending)

    def delivered(self, reports: list[coordinator_pb2.TaskReport]) -> None:
        """The check-in that carried ``reports`` succeeded: forget them."""
        for report in reports:
            if self._pending and self._pending[0] is report:
                self._pending.popleft()
