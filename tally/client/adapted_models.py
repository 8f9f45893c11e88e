"""What local adaptation as a job option leaves on a device: per job, the adaptation it still owes
(the job's option, until the job has ended), then the model it keeps, as ONNX, and its who-gains
record. None of it is ever sent: these are the device's own.

With a state directory everything is a file there (``<job>.adaptation-pending`` JSON,
``<job>.adapted.onnx``, ``<job>.who-gains.json``), written atomically, so a device restarted
before its job ended still adapts when it does, and one restarted after still serves its model.
Without one they live in memory. Nothing here imports torch: a device that never trains reads
its options without loading it.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any
from urllib.parse import quote, unquote

from tally import logs
from tally.algorithms.adaptation_options import JobAdaptation
from tally.client.metrics import ClientMetrics
from tally.security.certs import write_file_atomic
from tally.security.files import private_dir

log = logging.getLogger(__name__)
PENDING, MODEL, RECORD = ".adaptation-pending", ".adapted.onnx", ".who-gains.json"
PRIVATE = 0o600  # the device's own: nobody else on the machine reads it


class AdaptedModels:
    """``metrics``: the device's registry, where each adaptation kept or failed is counted."""

    def __init__(self, directory: Path | None = None, metrics: ClientMetrics | None = None) -> None:
        self.directory = Path(directory) if directory is not None else None
        self.metrics = metrics
        self._memory: dict[str, bytes] = {}
        self._owed: dict[str, JobAdaptation] = {}
        if self.directory is not None:
            private_dir(self.directory)
            for path in self.directory.glob("*" + PENDING):
                self._load_owed(unquote(path.name.removesuffix(PENDING)), path.read_bytes())

    def _load_owed(self, job_id: str, data: bytes) -> None:
        try:
            self._owed[job_id] = JobAdaptation.from_json(data.decode())
        except (ValueError, TypeError, UnicodeDecodeError) as exc:
            logs.event(log, "adaptation option unreadable; dropped", logging.WARNING, job_id=job_id, reason=str(exc))
            self.forget(job_id)

    def expect(self, job_id: str, option: JobAdaptation) -> None:
        """The device had a task of ``job_id``: it adapts the final model once the job succeeds."""
        if job_id not in self._owed and self.model(job_id) is None:
            self._owed[job_id] = option
            self._write(job_id, PENDING, option.to_json().encode())

    def pending(self) -> dict[str, JobAdaptation]:
        """Jobs whose adaptation is still owed, with their options."""
        return dict(self._owed)

    def forget(self, job_id: str) -> None:
        """No adaptation is owed for ``job_id`` any more (it failed, or this device cannot adapt)."""
        self._owed.pop(job_id, None)
        self._delete(job_id, PENDING)

    def failed(self, job_id: str, method: str) -> None:
        """This device could not adapt ``job_id``: nothing is owed any more, and it is counted."""
        if self.metrics is not None:
            self.metrics.adaptations.labels(method=method, outcome="failed").inc()
        self.forget(job_id)

    def keep(self, job_id: str, onnx: bytes, record: dict[str, Any]) -> None:
        self._write(job_id, MODEL, onnx)
        self._write(job_id, RECORD, json.dumps(record, sort_keys=True).encode())
        self.forget(job_id)
        if self.metrics is not None:
            method, accuracy = record["method"], record["accuracy"]
            outcome = "adapted" if record["kept"] == "adapted" else "kept_federated"
            self.metrics.adaptations.labels(method=method, outcome=outcome).inc()
            if "adapted" in accuracy and "federated" in accuracy:
                self.metrics.adaptation_gain.labels(method=method).observe(accuracy["adapted"] - accuracy["federated"])

    def model(self, job_id: str) -> bytes | None:
        return self._read(job_id, MODEL)

    def record(self, job_id: str) -> dict[str, Any] | None:
        data = self._read(job_id, RECORD)
        return None if data is None else json.loads(data)

    # -- files, or memory without a directory ------------------------------------------------

    def _name(self, job_id: str, suffix: str) -> str:
        return quote(job_id, safe="") + suffix

    def _write(self, job_id: str, suffix: str, data: bytes) -> None:
        name = self._name(job_id, suffix)
        if self.directory is None:
            self._memory[name] = data
        else:
            write_file_atomic(self.directory / name, data, PRIVATE)

    def _read(self, job_id: str, suffix: str) -> bytes | None:
        name = self._name(job_id, suffix)
        if self.directory is None:
            return self._memory.get(name)
        try:
            return (self.directory / name).read_bytes()
        except FileNotFoundError:
            return None

    def _delete(self, job_id: str, suffix: str) -> None:
        name = self._name(job_id, suffix)
        if self.directory is None:
            self._memory.pop(name, None)
        else:
            (self.directory / name).unlink(missing_ok=True)
