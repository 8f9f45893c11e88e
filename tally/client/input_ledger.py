"""The device's privacy invariant: at most one masked input per job and round, across restarts.

Two sums of one round over cohorts that differ by one device isolate that device's input. So a
device that sent an input in a round must never send another in it, whatever the coordinator
asks (a retried round, a replayed task, a restarted coordinator): the device refuses such a task
itself (``Device._do_task``) and states its ledger at each check-in so the coordinator does not
seat it again (``tally.coordinator.rounds.planner``).

A ledger that was lost (a state directory on an emptyDir, a re-install that kept the identity)
knows nothing of the inputs sent before it, so it must not vouch for them: "no input in this
round" from a ledger younger than a seat would release that seat, re-seat the device in the
round's retry, and hand a malicious aggregator two sums that differ by the devices that kept
their ledgers. So every ledger is born with a random id, written with it, and stated with it;
the coordinator records the id a device stated when it was seated and believes a later
statement about that seat only under the same id (``tally.coordinator.rounds.runner``). A ledger
created after the seat has another id and releases nothing.

Do not restore this file from a backup: a restored ledger keeps its id but forgets the inputs
sent since the backup, and nothing can tell it from an intact one. Restoring the identity without
the ledger is safe (a new ledger starts).
"""

from __future__ import annotations

import json
import secrets
from pathlib import Path

from tally.security.files import write_new
from tally.wire.task_reports import MAX_LEDGER_JOBS
from tally.wire.v1 import coordinator_pb2

LEDGER_FILE = "input-ledger.json"  # in the device's state directory
LEDGER_ID_BYTES = 16


class InputLedger:
    """The latest round of each job in which this device sent a masked input.

    With a ``path`` the ledger is a file, written (and fsynced) before the masked input leaves the
    device: a device that crashes or restarts mid-round still knows it sent one, so "at most one
    input per device and round" holds across restarts. A missing file is a new ledger, given a
    fresh id and written when it is first stated or written to (not when the device starts: a
    fleet of simulated devices would pay an fsync each at once). Without a path it lives in
    memory only (a device without a state directory keeps nothing across restarts anyway) and
    states nothing. A ledger file that does not parse is refused rather than treated as empty:
    forgetting would reopen the hole."""

    def __init__(self, path: Path | None = None) -> None:
        self.path = path
        self._rounds: dict[str, int] = {}
        self.ledger_id = ""  # until written: a new ledger, or one written before ledgers had ids
        if path is not None and path.exists():
            self.ledger_id, self._rounds = _read_ledger(path)

    def sent(self, job_id: str, round_: int) -> None:
        latest = max(round_, self._rounds.get(job_id, round_))
        if self._rounds.get(job_id) == latest:
            return
        # The job just written goes last: the file keeps the order in which jobs were updated.
        rounds = {**{k: v for k, v in self._rounds.items() if k != job_id}, job_id: latest}
        if self.path is not None:
            self._write(rounds)
        self._rounds = rounds

    def already_sent(self, job_id: str, round_: int) -> bool:
        """Whether a task for ``round_`` must be refused: the ledger keeps only each job's latest
        round, so any round up to it may have had an input (a task for an older round, replayed
        or from a coordinator restored from an old backup, is refused like the latest's)."""
        latest = self._rounds.get(job_id)
        return latest is not None and round_ <= latest

    def statement(self) -> coordinator_pb2.InputLedger | None:
        """What a check-in says of the inputs sent since this ledger was created: its id and the
        most recently updated jobs' latest rounds, only from a ledger on disk. A ledger in memory
        started empty with this process, so it cannot say that a restarted device sent nothing
        before."""
        if self.path is None:
            return None
        if not self.ledger_id:
            self._write(self._rounds)
        recent = list(self._rounds.items())[-MAX_LEDGER_JOBS:]
        return coordinator_pb2.InputLedger(latest_round=dict(recent), ledger_id=self.ledger_id)

    def _write(self, rounds: dict[str, int]) -> None:
        """Write ``rounds`` (fsynced) under this ledger's id, drawing the id first if it has none."""
        assert self.path is not None
        ledger_id = self.ledger_id or secrets.token_hex(LEDGER_ID_BYTES)
        record = {"ledger_id": ledger_id, "latest_round": rounds}
        write_new(self.path, json.dumps(record).encode(), 0o600, replace=True)
        self.ledger_id = ledger_id


def _read_ledger(path: Path) -> tuple[str, dict[str, int]]:
    """(id, rounds); the id is "" in a file written before ledgers had one (a bare mapping)."""
    try:
        record = json.loads(path.read_bytes())
    except (OSError, ValueError) as exc:
        raise ValueError(f"input ledger {path} is unreadable ({exc}): refusing to start without it") from None
    ledger_id, rounds = "", record
    if isinstance(record, dict) and set(record) == {"ledger_id", "latest_round"}:
        ledger_id, rounds = record["ledger_id"], record["latest_round"]
        if not isinstance(ledger_id, str) or len(ledger_id) != 2 * LEDGER_ID_BYTES:
            raise ValueError(f"input ledger {path} has no valid ledger_id")
    if not isinstance(rounds, dict) or not all(
            isinstance(k, str) and type(v) is int for k, v in rounds.items()):
        raise ValueError(f"input ledger {path} is not a mapping of job ids to rounds")
    return ledger_id, rounds
