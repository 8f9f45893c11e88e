"""The device's privacy invariant: at most one masked input per job and round, across restarts.

Two sums of one round over cohorts that differ by one device isolate that device's input. So a
device that sent an input in a round must never send another in it, whatever the coordinator
asks (a retried round, a replayed task, a restarted coordinator): the device refuses such a task
itself (``Device._do_task``) and states its ledger at each check-in so the coordinator does not
seat it again (``tally.coordinator.rounds.planner``).
"""

from __future__ import annotations

import json
from pathlib import Path

from tally.security.files import write_new
from tally.wire.task_reports import MAX_LEDGER_JOBS
from tally.wire.v1 import coordinator_pb2

LEDGER_FILE = "input-ledger.json"  # in the device's state directory


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
