"""The one error type of the security layer. Like the secagg errors, it names the gRPC status a
service adapter should answer with, so adapters map it without knowing where it came from."""

from __future__ import annotations

from typing import Any, NoReturn

import grpc


class AuthError(Exception):
    """Authentication or authorisation failed.

    ``status`` is the name of a ``grpc.StatusCode`` (``"UNAUTHENTICATED"`` for device tokens,
    ``"PERMISSION_DENIED"`` for session tickets); ``message`` is safe to send to the peer: it says
    what was wrong (malformed, bad signature, expired) and never echoes secrets.
    """

    def __init__(self, status: str, message: str) -> None:
        if not hasattr(grpc.StatusCode, status):
            raise ValueError(f"unknown gRPC status {status!r}")
        super().__init__(f"{status}: {message}")
        self.status = status
        self.message = message

    @property
    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode[self.status]

    def abort(self, context: Any) -> NoReturn:
        """End the current RPC with this error (``context`` is a ``grpc.ServicerContext``)."""
        context.abort(self.code, self.message)
        raise AssertionError("context.abort returned")  # pragma: no cover
