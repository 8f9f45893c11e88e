"""A device's Join travels in the session stream's metadata, not as its first message.

The aggregator then checks the ticket and session token before it reads a single message: a
stream without a valid Join is refused before gRPC hands the handler any bytes of it, so the
device port needs no shared client certificate to bound what an unauthenticated peer costs
(issue 23, finding 9). The value is the serialized ``tally.v1.Join``.
"""

from __future__ import annotations

from collections.abc import Iterable

from google.protobuf.message import DecodeError

from tally.wire.v1 import secagg_pb2

JOIN_METADATA = "tally-join-bin"  # "-bin": gRPC carries the value as bytes
MAX_JOIN_BYTES = 16 * 1024


class JoinError(ValueError):
    """The stream's Join is missing, oversized or undecodable."""


def join_metadata(join: secagg_pb2.Join) -> tuple[tuple[str, bytes], ...]:
    return ((JOIN_METADATA, join.SerializeToString()),)


def join_from_metadata(metadata: Iterable[tuple[str, str | bytes]] | None) -> secagg_pb2.Join:
    values = [value for key, value in metadata or () if key == JOIN_METADATA]
    if len(values) != 1 or not isinstance(values[0], bytes):
        raise JoinError(f"a session stream must carry exactly one Join in its {JOIN_METADATA!r} metadata")
    if len(values[0]) > MAX_JOIN_BYTES:
        raise JoinError(f"the stream's Join is {len(values[0])} bytes, at most {MAX_JOIN_BYTES} are read")
    try:
        return secagg_pb2.Join.FromString(values[0])
    except DecodeError:
        raise JoinError("the stream's Join metadata is not a Join message") from None
