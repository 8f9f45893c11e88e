"""Run Tally's services as real processes for the deployment tests (packaging, manifests)."""

from __future__ import annotations

import os
import queue
import re
import subprocess
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
JOB_SPEC = (
    "name: {name}\nalgorithm: fedavg\nrounds: {rounds}\ncohort_size: {cohort}\n"
    "over_selection: 1.0\nmin_cohort: 5\nretries: 3\n"
    "model: {{inputs: 64, classes: 10, hidden: 16, seed: 0}}\n"
    "options: {{local_epochs: 1, local_lr: 0.1, batch_size: 16}}\n"
    "secure: {{dropout_rate: 0.1, corrupt_rate: 0.05}}\n"
    "deadlines: {{checkin: 20, download: 20, advertise_keys: 10, share_keys: 10, masked_input: 20, "
    "unmask: 10}}\n"
)


class Service:
    """A process whose stdout is read line by line in the background and whose stderr goes to a
    file, so neither pipe can fill and block it."""

    def __init__(self, name: str, argv: Sequence[str], log_dir: Path,
                 env: Mapping[str, str] | None = None, cwd: Path | None = None) -> None:
        self.name = name
        self.stderr_path = log_dir / f"{name}.stderr"
        self._stderr = self.stderr_path.open("w")
        self.process = subprocess.Popen(
            list(argv), stdout=subprocess.PIPE, stderr=self._stderr, text=True,
            env=dict(env) if env is not None else None, cwd=cwd,
        )
        self.lines: list[str] = []
        self._queue: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self._queue.put(line)
        self._queue.put(None)

    def wait_for(self, pattern: str, timeout: float = 120.0) -> re.Match[str]:
        """The first stdout line matching ``pattern``; fails with the process's stderr when it
        exits or the deadline passes first."""
        deadline = time.monotonic() + timeout
        regex = re.compile(pattern)
        while (left := deadline - time.monotonic()) > 0:
            try:
                line = self._queue.get(timeout=min(left, 1.0))
            except queue.Empty:
                continue
            if line is None:
                break
            self.lines.append(line)
            if match := regex.search(line):
                return match
        pytest.fail(f"{self.name}: no line matching {pattern!r}; stdout {self.lines[-5:]}, "
                    f"stderr:\n{self.tail()}")

    def tail(self, chars: int = 3000) -> str:
        self._stderr.flush()
        return self.stderr_path.read_text()[-chars:]

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._stderr.close()


def poll_until_ok(argv: Sequence[str], timeout: float = 60.0,
                  env: Mapping[str, str] | None = None) -> None:
    """Run ``argv`` until it exits 0 (a probe), failing with its last output at the deadline."""
    deadline = time.monotonic() + timeout
    while True:
        result = subprocess.run(list(argv), capture_output=True, text=True,
                                env=dict(env) if env is not None else None)
        if result.returncode == 0:
            return
        if time.monotonic() > deadline:
            pytest.fail(f"{' '.join(argv)} never succeeded: rc {result.returncode}, "
                        f"{result.stderr.strip()[-1000:]}")
        time.sleep(0.5)  # a polling interval between probe attempts, not a synchronisation


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def clean_env(**extra: str) -> dict[str, str]:
    """The environment without this venv's or pytest's Python settings."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PYTHON", "VIRTUAL_ENV", "PYTEST"))}
    env.update(extra)
    return env
