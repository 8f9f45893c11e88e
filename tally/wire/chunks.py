"""Masked inputs in chunks, so that no message on the device-facing port needs to be large.

A masked vector is the protocol's one large message (about 4 MB at a million values). Sent whole,
it would force the aggregator's device port to accept messages that large from anyone, before the
Join that authenticates a stream is even checked. Sent as chunks of at most ``CHUNK_BYTES``, the
port's receive limit stays at a few MiB whatever the model size; the aggregator joins the chunks
back into one ``MaskedInputResponse`` before the protocol core sees it, so the core is unchanged.
"""

from __future__ import annotations

from collections.abc import Callable

from tally.wire.fields import WireError
from tally.wire.v1 import secagg_pb2

CHUNK_BYTES = 1 << 20

_MASKED = "masked_input_response"


class ChunkError(WireError):
    """Chunks out of order, of another sum, interleaved with other messages, or too many bytes."""


def split_masked_input(
    envelope: secagg_pb2.DeviceToAggregator, chunk_bytes: int = CHUNK_BYTES
) -> list[secagg_pb2.DeviceToAggregator]:
    """``envelope`` as the messages to send: itself unless it is a masked input above
    ``chunk_bytes``, which becomes chunks in order, each marked with its offset."""
    if chunk_bytes < 1:
        raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes}")
    if envelope.WhichOneof("message") != _MASKED:
        return [envelope]
    whole = envelope.masked_input_response
    data = whole.data
    if len(data) <= chunk_bytes:
        return [envelope]
    return [
        secagg_pb2.DeviceToAggregator(masked_input_response=secagg_pb2.MaskedInputResponse(
            ref=whole.ref, sum_id=whole.sum_id, sender=whole.sender,
            data=data[offset:offset + chunk_bytes], offset=offset,
            more=offset + chunk_bytes < len(data),
        ))
        for offset in range(0, len(data), chunk_bytes)
    ]


class MaskedInputAssembler:
    """Joins one stream's chunks back into whole masked inputs.

    ``packed_bytes(sum_id)`` is the size of that sum's packed vector, or None when the session has
    no such sum: a chunked input may never grow past it, so a peer cannot make the aggregator hold
    more than one vector's bytes per stream.
    """

    def __init__(self, packed_bytes: Callable[[str], int | None]) -> None:
        self._packed_bytes = packed_bytes
        self._first: secagg_pb2.MaskedInputResponse | None = None
        self._parts: list[bytes] = []
        self._size = 0

    def add(
        self, envelope: secagg_pb2.DeviceToAggregator
    ) -> secagg_pb2.DeviceToAggregator | None:
        """The envelope to act on now (``envelope`` itself, or a whole masked input once its last
        chunk arrived), or None while a chunked input is incomplete."""
        kind = envelope.WhichOneof("message")
        if kind != _MASKED:
            if self._first is not None:
                raise ChunkError(f"{kind} arrived before the last chunk of the masked input for "
                                 f"sum {self._first.sum_id!r}")
            return envelope
        part = envelope.masked_input_response
        if self._first is None:
            if part.offset != 0:
                raise ChunkError(f"masked input for sum {part.sum_id!r} starts at offset "
                                 f"{part.offset}, not 0")
            if not part.more:
                return envelope
            self._first = part
        elif (part.sum_id, part.sender, part.ref) != (
            self._first.sum_id, self._first.sender, self._first.ref
        ):
            raise ChunkError(f"a chunk for sum {part.sum_id!r} arrived before the last chunk of "
                             f"the masked input for sum {self._first.sum_id!r}")
        elif part.offset != self._size:
            raise ChunkError(f"masked input chunk at offset {part.offset}, expected {self._size}")
        self._take(part)
        if part.more:
            return None
        first, data = self._first, b"".join(self._parts)
        self._first, self._parts, self._size = None, [], 0
        return secagg_pb2.DeviceToAggregator(masked_input_response=secagg_pb2.MaskedInputResponse(
            ref=first.ref, sum_id=first.sum_id, sender=first.sender, data=data))

    def _take(self, part: secagg_pb2.MaskedInputResponse) -> None:
        limit = self._packed_bytes(part.sum_id)
        if limit is None:
            raise ChunkError(f"chunked masked input for sum {part.sum_id!r}, which this session "
                             "does not have")
        if self._size + len(part.data) > limit:
            raise ChunkError(f"masked input for sum {part.sum_id!r} is larger than its "
                             f"{limit} packed bytes")
        self._parts.append(part.data)
        self._size += len(part.data)
