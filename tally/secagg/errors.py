"""Typed protocol errors. Each names the gRPC status a service adapter should answer
with, so the adapters map errors without knowing every class."""

from __future__ import annotations


class ProtocolError(Exception):
    status = "FAILED_PRECONDITION"


class StaleMessage(ProtocolError):
    """The message belongs to another job, round, session or sum."""

    status = "FAILED_PRECONDITION"


class OutOfPhase(ProtocolError):
    """The message is of a phase the session is not in, or from a device not in this phase."""

    status = "FAILED_PRECONDITION"


class DuplicateMessage(ProtocolError):
    """A device sent the same phase twice: a replay, never applied twice."""

    status = "ALREADY_EXISTS"


class UnknownSender(ProtocolError):
    status = "PERMISSION_DENIED"


class MalformedMessage(ProtocolError):
    status = "INVALID_ARGUMENT"


class SessionAbortedError(ProtocolError):
    """The session ended without a result (too few survivors, inconsistent server)."""

    status = "ABORTED"
