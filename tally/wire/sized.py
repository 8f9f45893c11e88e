"""Streams that count bytes as they cross the wire.

The secure-aggregation stream's byte counters used to call ``ByteSize`` on every message, and
upb computes it by encoding the whole message again: for a cohort's masked inputs that cost the
aggregator more CPU than the secure sum itself, and each simulated device one more encoding of
its upload (issue 8's profile). A stream registered with these (de)serialisers instead hands the
reader each message with its size on the wire, and takes from the writer bytes it has already
serialised and counted.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from google.protobuf.message import DecodeError, Message

M = TypeVar("M", bound=Message)


def sized(message_type: type[M]) -> Callable[[bytes], tuple[int, M | None]]:
    """A deserialiser yielding (bytes on the wire, message); the message is None when the bytes
    do not parse, so the reader refuses them with its own status and message (an exception here
    would surface in the reader as an internal error)."""

    def parse(data: bytes) -> tuple[int, M | None]:
        try:
            return len(data), message_type.FromString(data)
        except DecodeError:
            return len(data), None

    return parse


def already_serialized(data: bytes) -> bytes:
    """The serialiser of a stream whose writer passes bytes (``SerializeToString``, counted)."""
    return data
