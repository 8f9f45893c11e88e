"""What a device tells the coordinator about its tasks, and the rule it keeps about its inputs.

A failed task used to be visible only in the device's own log: the operator saw "0 devices
answered" and nothing else. Each task now ends in a ``TaskReport`` that rides on the device's next
check-in, with a reason from a fixed set so the coordinator can count reasons per round.

The report also says whether the device sent a masked input. That is what a retry of a round
needs to know: two sums of one round over cohorts that differ by one device isolate that device's
input, so a device that sent an input in a round must never send another in it, while a device
that sent none can safely be seated again. The device enforces the first part itself
(``InputLedger``), whatever the coordinator asks; the coordinator uses the reports only to stop
wasting seats on devices that will refuse.
"""

from __future__ import annotations

import json
from collections import deque
from pathlib import Path

from tally.security.files import write_new
from tally.wire.task_reports import MAX_LEDGER_JOBS, MAX_REPORTS, REASONS
from tally.wire.v1 import coordinator_pb2

Outcome = coordinator_pb2.TaskReport.Outcome

DETAIL_CHARS = 500
LEDGER_FILE = "input-ledger.json"  # in the device's state directory


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


class InputLedger:
    """The latest round of each job in which this device sent a masked input.

    With a ``path`` the ledger is a file, written (and fsynced) before the masked input leaves the
    device: a device that crashes or restarts mid-round still knows it sent one, so "at most one
    input per device and round" holds across restarts. Without a path it lives in memory only (a
    device without a state directory keeps nothing across restarts anyway). A ledger file that
    does not parse is refused rather than treated as empty: forgetting would reopen the hole."""

    def __init__(self, path: Path | None = None) -> None:
        self.path = path
        self._rounds: dict[str, int] = {}
        if path is not None and path.exists():
            self._rounds = _read_ledger(path)

    def sent(self, job_id: str, round_: int) -> None:
        latest = max(round_, self._rounds.get(job_id, round_))
        if self._rounds.get(job_id) == latest:
            return
        # The job just written goes last: the file keeps the order in which jobs were updated.
        rounds = {**{k: v for k, v in self._rounds.items() if k != job_id}, job_id: latest}
        if self.path is not None:
            write_new(self.path, json.dumps(rounds).encode(), 0o600, replace=True)
        self._rounds = rounds

    def already_sent(self, job_id: str, round_: int) -> bool:
        return self._rounds.get(job_id) == round_

    def statement(self) -> coordinator_pb2.InputLedger | None:
        """What a check-in says of the inputs sent: the most recently updated jobs' latest rounds,
        only from a ledger on disk. A ledger in memory started empty with this process, so it
        cannot say that a restarted device sent nothing before."""
        if self.path is None:
            return None
        recent = list(self._rounds.items())[-MAX_LEDGER_JOBS:]
        return coordinator_pb2.InputLedger(latest_round=dict(recent))


def _read_ledger(path: Path) -> dict[str, int]:
    try:
        rounds = json.loads(path.read_bytes())
    except (OSError, ValueError) as exc:
        raise ValueError(f"input ledger {path} is unreadable ({exc}): refusing to start without it") from None
    if not isinstance(rounds, dict) or not all(
            isinstance(k, str) and type(v) is int for k, v in rounds.items()):
        raise ValueError(f"input ledger {path} is not a mapping of job ids to rounds")
    return rounds
