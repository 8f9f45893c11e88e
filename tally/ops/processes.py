"""Tally's roles as local processes, for the demo, the fault campaign and the load benchmark:
started, stopped, killed and restarted like a deployment's pods, and measured from outside."""

from __future__ import annotations

import asyncio
import contextlib
import re
import signal
import sys
from pathlib import Path


class Process:
    """A ``tally`` subcommand in its own process; its first stdout line says where it listens.
    ``start`` again after ``kill`` is a restart with the same arguments (same ports, same state)."""

    def __init__(self, name: str, args: list[str], log: Path, python: str = sys.executable) -> None:
        """``python``: the interpreter to run it with (another environment's, with other packages)."""
        self.name, self.args, self.log, self.python = name, args, log, python
        self.proc: asyncio.subprocess.Process | None = None
        self.starts = 0

    async def start(self, pattern: str, timeout: float = 60.0) -> re.Match:
        self.log.parent.mkdir(parents=True, exist_ok=True)
        stderr = self.log.open("ab")
        self.proc = await asyncio.create_subprocess_exec(
            self.python, "-m", "tally.cli", *self.args, stdout=asyncio.subprocess.PIPE, stderr=stderr
        )
        stderr.close()
        self.starts += 1
        assert self.proc.stdout is not None
        line = await asyncio.wait_for(self.proc.stdout.readline(), timeout)
        match = re.search(pattern, line.decode())
        if match is None:  # the log's end says why: a temporary directory may be gone by the time anyone looks
            tail = self.log.read_text(errors="replace").splitlines()[-15:] if self.log.exists() else []
            raise RuntimeError(f"{self.name} did not start: {line.decode()!r} (log: {self.log}, ending:\n"
                               + "\n".join(tail) + ")")
        return match

    async def line(self, pattern: str, timeout: float = 60.0) -> re.Match:
        """The next stdout line after the first that matches ``pattern`` (a role announces more
        than where it listens: the coordinator names the jobs it submitted from --jobs-dir)."""
        assert self.proc is not None and self.proc.stdout is not None
        async with asyncio.timeout(timeout):
            while line := await self.proc.stdout.readline():
                if (match := re.search(pattern, line.decode())) is not None:
                    return match
        raise RuntimeError(f"{self.name} ended without a line matching {pattern!r} (log: {self.log})")

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.returncode is None

    def exit_code(self) -> int | None:
        """The exit status once the process has ended by itself or been stopped, else None."""
        return self.proc.returncode if self.proc is not None else None

    async def kill(self) -> None:
        """SIGKILL, as a node failure or an OOM kill would: no shutdown code runs."""
        if self.running:
            assert self.proc is not None
            self.proc.send_signal(signal.SIGKILL)
            await self.proc.wait()

    def pause(self) -> None:
        """SIGSTOP, as a frozen VM or a stalled host would: the process holds its connections and
        does nothing until ``resume``."""
        if self.running:
            assert self.proc is not None
            self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        """SIGCONT: a paused process goes on where it stopped, unaware of the time it lost."""
        if self.running:
            assert self.proc is not None
            self.proc.send_signal(signal.SIGCONT)

    async def stop(self) -> None:
        if self.running:
            assert self.proc is not None
            self.resume()  # a paused process would hold SIGTERM until the kill below
            self.proc.terminate()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.proc.wait(), 15)
            if self.proc.returncode is None:
                self.proc.kill()
                await self.proc.wait()
