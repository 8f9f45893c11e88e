"""What `tally client` tells the person running it: a line when something happens (connected,
a task ended, a new kind of trouble, no job to join) and a one-line summary at the end.

A device used to be silent for minutes at a dead address and while contributing to rounds; its
JSON logs are for machines (``--log-level``). Lines, not a live display: a client usually runs
under a service manager, whose log file would keep a progress bar's every redraw.
"""

from __future__ import annotations

import sys
from typing import TextIO

from tally.client.device import DeviceStats

MIB = 1 << 20


class DeviceProgress:
    """``Device(on_update=...)``: prints what changed since the last update it saw."""

    def __init__(self, device_id: str, coordinator: str, out: TextIO | None = None) -> None:
        self.device_id, self.coordinator = device_id, coordinator
        self._out = out or sys.stderr
        self._connected = False
        self._tasks = 0
        self._error = ""
        self._idle = False

    def __call__(self, stats: DeviceStats) -> None:
        if stats.last_error and stats.last_error != self._error:
            self._say(f"retrying: {stats.last_error}")
        self._error = stats.last_error
        if stats.checkins and not self._connected:
            self._connected = True
            self._say(f"connected: {self.device_id} checked in at {self.coordinator}")
        if stats.tasks_done > self._tasks:
            self._tasks = stats.tasks_done
            self._say(f"task {stats.tasks_done}: {stats.last_task}")
        if stats.population_idle and not self._idle:
            self._say("no job of this device's population is running; checking in again later")
        self._idle = stats.population_idle

    def _say(self, line: str) -> None:
        print(f"tally client: {line}", file=self._out, flush=True)


def summary(stats: DeviceStats) -> str:
    """One line: the tasks and how they ended, the bytes moved, the last task."""
    ended = [f"{stats.sessions_completed} summed"] + [
        f"{count} {what}"
        for count, what in ((stats.dropouts, "dropped"), (stats.sessions_aborted, "aborted or refused"))
        if count]
    line = (f"{stats.tasks_done} task(s): {', '.join(ended)}; {stats.bytes_up / MIB:.1f} MiB up, "
            f"{stats.bytes_down / MIB:.1f} MiB down; {stats.checkins} check-in(s), {stats.retries} retried call(s)")
    return line + (f"; last: {stats.last_task}" if stats.last_task else "")
