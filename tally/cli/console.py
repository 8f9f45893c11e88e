"""The rich console every command prints through.

Writing to a file or a pipe (a service manager's log, `tally demo > run.log`), rich assumes 80
columns: it cut the fleet's progress line and wrapped the demo's summary mid-number. Off a
terminal, lines are now kept whole; on one, rich fits them to the window as before.
"""

from __future__ import annotations

from rich.console import Console

# Wide enough for the longest progress line; only tables and bars use the width off a terminal.
LOG_WIDTH = 200


def console(*, stderr: bool = False) -> Console:
    terminal = Console(stderr=stderr)
    if terminal.is_terminal:
        return terminal
    return Console(stderr=stderr, width=LOG_WIDTH, soft_wrap=True)
