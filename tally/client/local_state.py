"""A device's per-job algorithm state (``local_state``: LG-FedAvg's local layers, SuPerFed's personal
model), kept across device restarts when the device has a state directory.

What is personal never leaves the device, so a restart must not lose it either: a device that
forgot its local layers would start them again from the broadcast's warm-start values. States that
are a mapping of names to arrays are written with ``tally.modelio`` (a JSON header and raw array
bytes: data only, never pickle), one file per job, replaced atomically after each session that
committed them. Other states stay in memory only. A file that does not parse is ignored (with a
warning) and the job's state starts afresh, as on a device that never ran it.
"""

from __future__ import annotations

import logging
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any
from urllib.parse import quote

import numpy as np

from tally import logs, modelio
from tally.security.files import private_dir

log = logging.getLogger(__name__)
SUFFIX = ".local-state"


def persistable(state: Any) -> bool:
    return isinstance(state, Mapping) and all(
        isinstance(k, str) and isinstance(v, np.ndarray | np.generic) for k, v in state.items())


class LocalStateStore:
    def __init__(self, directory: Path | None = None) -> None:
        self.directory = Path(directory) if directory is not None else None
        self._memory: dict[str, Any] = {}
        if self.directory is not None:
            private_dir(self.directory)

    def path(self, job_id: str) -> Path:
        assert self.directory is not None
        return self.directory / (quote(job_id, safe="") + SUFFIX)

    def get(self, job_id: str) -> Any:
        if job_id in self._memory or self.directory is None:
            return self._memory.get(job_id)
        try:
            state = modelio.deserialize(self.path(job_id).read_bytes())
        except FileNotFoundError:
            return None
        except ValueError as exc:
            logs.event(log, "local state unreadable; starting afresh", logging.WARNING, job_id=job_id,
                       reason=str(exc))
            return None
        self._memory[job_id] = state
        return state

    def __setitem__(self, job_id: str, state: Any) -> None:
        self._memory[job_id] = state
        if self.directory is None:
            return
        if not persistable(state):
            logs.event(log, "local state kept in memory only (not a mapping of arrays)", job_id=job_id,
                       kind=type(state).__name__)
            return
        fd, tmp = tempfile.mkstemp(dir=self.directory, prefix=".partial-")
        with os.fdopen(fd, "wb") as f:
            f.write(modelio.serialize(state))
        os.replace(tmp, self.path(job_id))
