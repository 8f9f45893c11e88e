"""Devices' reports on their tasks: why tasks failed, counted per round, and which seats a retry
of the round may give out again.

A report is believed only about the device's own task: its task id must be one this job handed
to that device in a recent round (task ids are random and go only to their device). Each task is
reported once; a second report of it, or one about someone else's task, is not counted.

What a report may change is limited to the reporting device: "I sent no masked input" frees that
device's own seat for the round's retries (``Store.release_seats``). A device that lies about it
can only expose its own input to differencing; a device that says nothing keeps its seat taken,
which is the safe default (planner module docstring).
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Iterable

from tally import logs
from tally.coordinator.rounds.planner import Seat
from tally.coordinator.state.store import Store
from tally.wire.task_reports import reason_label
from tally.wire.v1 import coordinator_pb2

log = logging.getLogger(__name__)

Outcome = coordinator_pb2.TaskReport.Outcome
# Reports may arrive a check-in after their round committed: tasks of this many recent rounds
# are remembered.
KEEP_ROUNDS = 2


class Recorded(enum.Enum):
    UNMATCHED = "unmatched"  # not a task of the device's, or reported already: nothing counted
    COUNTED = "counted"
    RELEASED = "released"  # counted, and the device's seat in the round is free again


def outcome_name(report: coordinator_pb2.TaskReport) -> str:
    """The outcome's name in lower case; an outcome this coordinator does not know is unspecified."""
    known = report.outcome in Outcome.values()
    return (Outcome.Name(report.outcome) if known else "OUTCOME_UNSPECIFIED").lower()


class TaskReportBook:
    """One job's issued tasks and what their devices reported."""

    def __init__(self, store: Store, job_id: str) -> None:
        self._store, self._job_id = store, job_id
        self._issued: dict[str, tuple[str, int]] = {}  # task id -> (device id, round)
        # Tasks already reported: a task issued before a restart is known from the store's seats,
        # whose seat may outlive its report (an input was sent), so each is counted once here.
        self._reported: set[str] = set()

    def issue(self, round_: int, seats: Iterable[Seat]) -> None:
        """An attempt's tasks are going out; tasks of rounds before the kept ones are forgotten."""
        self._issued = {t: owner for t, owner in self._issued.items()
                        if owner[1] > round_ - KEEP_ROUNDS}
        self._issued.update({s.task_id: (s.device_id, round_) for s in seats})

    def record(self, device_id: str, report: coordinator_pb2.TaskReport) -> Recorded:
        """Count ``device_id``'s report on its task and free its seat if it sent no input."""
        if self._issued.get(report.task_id) == (device_id, report.round):
            del self._issued[report.task_id]
            self._reported.add(report.task_id)
        elif not self._seated_before_restart(device_id, report):
            return Recorded.UNMATCHED
        outcome, reason = outcome_name(report), reason_label(report.reason)
        self._store.count_task_report(self._job_id, report.round, outcome, reason, report.detail)
        released = 0
        if not report.sent_input:
            released = self._store.release_seats(self._job_id, report.round,
                                                 [(device_id, report.task_id)])
        if outcome != "completed":
            # A device that left its session is routine (fleets plan dropouts by the hundred); a
            # device that could not do its task is what an operator must see.
            level = logging.INFO if outcome == "dropped" else logging.WARNING
            logs.event(log, "device task report", level, job_id=self._job_id,
                       round=report.round, device_id=device_id, outcome=outcome, reason=reason,
                       sent_input=report.sent_input, seat_released=bool(released),
                       detail=report.detail[:500])
        return Recorded.RELEASED if released else Recorded.COUNTED

    def _seated_before_restart(self, device_id: str, report: coordinator_pb2.TaskReport) -> bool:
        """A task this process did not issue, but the store's seats record for this device: one
        an earlier coordinator handed out before it stopped, reported for the first time."""
        if report.task_id in self._reported or not self._store.has_seat(
                self._job_id, report.round, device_id, report.task_id):
            return False
        self._reported.add(report.task_id)
        return True
