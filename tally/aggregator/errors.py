"""One rejection type for everything the aggregator refuses, whatever layer refused it.

The protocol core (``ProtocolError``), the security layer (``AuthError``) and the wire converters
(``WireError``) each describe a refusal in their own terms; the servicers turn any of them into a
``Rejected`` so that every refusal ends its RPC the same way: a gRPC status named by the layer that
knows best, a message safe to show the peer, and a short ``reason`` label for the metrics.
"""

from __future__ import annotations

import re
from typing import Any, NoReturn

import grpc

from tally.secagg import ProtocolError
from tally.security import AuthError
from tally.wire.fields import WireError


class Rejected(Exception):
    """A request or message the aggregator refuses; ``status`` names a ``grpc.StatusCode``."""

    def __init__(self, status: str, message: str, reason: str | None = None) -> None:
        if not hasattr(grpc.StatusCode, status):
            raise ValueError(f"unknown gRPC status {status!r}")
        super().__init__(f"{status}: {message}")
        self.status = status
        self.message = message
        self.reason = reason or status.lower()

    @property
    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode[self.status]

    @classmethod
    def of(cls, error: Exception) -> Rejected:
        """The rejection a refusal of another layer amounts to; ``error`` must be one of
        ``Rejected``, ``ProtocolError``, ``AuthError`` or ``WireError``."""
        if isinstance(error, Rejected):
            return error
        if isinstance(error, ProtocolError):
            return cls(error.status, str(error), _snake(type(error).__name__))
        if isinstance(error, AuthError):
            return cls(error.status, error.message, "ticket")
        if isinstance(error, WireError):
            return cls("INVALID_ARGUMENT", str(error), "malformed")
        raise TypeError(f"not a refusal: {type(error).__name__}") from error


def _snake(name: str) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()


REFUSALS = (Rejected, ProtocolError, AuthError, WireError)


async def abort(context: grpc.aio.ServicerContext[Any, Any], rejected: Rejected) -> NoReturn:
    """End the current RPC with ``rejected``'s status and message."""
    await context.abort(rejected.code, rejected.message)
    raise AssertionError("context.abort returned")  # pragma: no cover
