"""The phases of a secure-aggregation session, in one table.

A phase's name is also a metric label, a log field, a key of the job spec's ``deadlines:`` and
of ``PhaseDeadlines`` (as ``<name>_seconds``), so every service must spell it the same way; and
the aggregator, the device SDK and the in-process driver must agree on which request opens which
phase and which deadline bounds it. Each member is a ``str`` equal to its name, so labels, logs
and dictionary keys stay the plain strings they were.
"""

from __future__ import annotations

from enum import StrEnum

from tally.secagg.messages import (
    ConsistencyCheckRequest,
    MaskedInputRequest,
    ServerMessage,
    ShareKeysRequest,
    UnmaskRequest,
)


class Phase(StrEnum):
    """A phase: its name, the server request that asks a device for it (``None`` where no request
    of its own opens it: devices advertise keys on joining, and the share-checking rounds continue
    ShareKeys), the phase whose deadline setting bounds it, and whether a device may drop in it
    (a planned dropout, simulated or in a load test, names one of those)."""

    request: type | None
    droppable: bool
    _deadline: str | None

    def __new__(cls, name: str, request: type | None, deadline: str | None, droppable: bool) -> Phase:
        member = str.__new__(cls, name)
        member._value_ = name
        member.request = request
        member._deadline = deadline
        member.droppable = droppable
        return member

    # A plain session (benchmarks only) waits here for its devices to join, as long as
    # AdvertiseKeys would last in a secure one.
    JOIN = ("join", None, "advertise_keys", False)
    ADVERTISE_KEYS = ("advertise_keys", None, "advertise_keys", True)
    SHARE_KEYS = ("share_keys", ShareKeysRequest, "share_keys", True)
    SHARE_COMPLAINTS = ("share_complaints", None, "share_keys", False)
    JUSTIFY = ("justify", None, "share_keys", False)
    # The device's wait for the server's verdict on complaints (the server is in one of the two above).
    SHARE_VERDICT = ("share_verdict", None, "share_keys", False)
    MASKED_INPUT = ("masked_input", MaskedInputRequest, "masked_input", True)
    CONSISTENCY_CHECK = ("consistency_check", ConsistencyCheckRequest, "consistency_check", True)
    UNMASK = ("unmask", UnmaskRequest, "unmask", True)
    # The server's session is over. (A device's own states between phases, done and awaiting its
    # input, are no phase of the session: they stay in ``tally.secagg.client``.)
    FINISHED = ("finished", None, None, False)

    def __repr__(self) -> str:
        # The plain string's: error messages that list phases read as they did before the table.
        return repr(self.value)

    @property
    def deadline(self) -> Phase | None:
        """The phase whose deadline setting bounds this one (itself, for a phase with its own)."""
        return None if self._deadline is None else _BY_NAME[self._deadline]

    @property
    def deadline_field(self) -> str:
        """This phase's field of ``PhaseDeadlines``; only phases that are their own deadline have one."""
        if self.deadline is not self:
            raise ValueError(f"phase {self.value!r} has no deadline of its own")
        return f"{self.value}_seconds"


_BY_NAME: dict[str, Phase] = {p.value: p for p in Phase}

# Phases with a deadline setting of their own, in protocol order (``PhaseDeadlines``, the spec's
# ``deadlines:``); CONSISTENCY_CHECK only runs when the session checks consistency.
DEADLINED = tuple(p for p in Phase if p.deadline is p)
# Phases a device may drop in, in protocol order.
DROPPABLE = tuple(p for p in Phase if p.droppable)
# Every phase the in-process driver times (server or device side), in protocol order.
TIMED = tuple(p for p in Phase if p.deadline is not None and p is not Phase.JOIN)

_BY_REQUEST: dict[type, Phase] = {p.request: p for p in Phase if p.request is not None}


def asked_for(message: ServerMessage) -> tuple[Phase, str] | None:
    """(phase, sum id) that ``message`` asks its recipient for; ``None`` for a message that asks
    for no phase. The sum id is ``""`` for a phase of the whole session."""
    phase = _BY_REQUEST.get(type(message))
    if phase is None:
        return None
    return phase, getattr(message, "sum_id", "")
