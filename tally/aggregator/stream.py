"""``SecureAggregation.Session``: one bidirectional stream per device per session.

The stream's metadata must carry its ``Join`` (``tally.wire.join``): its session ticket names the
session (and must be the one the session was opened with), its session token must hash to the
coordinator's grant for the device index. Both are checked before a single message is read, so a
stream that is not a selected device's costs the aggregator nothing it parses or keeps, and the
device port needs no client certificate shared by every device. After ``Joined``, two halves run
side by side: one reads the device's messages and
feeds them to the session, the other writes what the session routes to the device. A refused
message ends only this device's stream, with the refusal's status; the session goes on without the
device, which is then a dropout like any other.

The service is registered by ``add_to_server`` rather than the generated helper so that the byte
counters see each message's size as it crossed the wire (``tally.wire.sized``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import TypeAlias, TypeVar

import grpc
from prometheus_client import Counter

from tally import logs
from tally.aggregator.errors import REFUSALS, Rejected, abort
from tally.aggregator.held_sessions import HeldSessions
from tally.aggregator.metrics import AggregatorMetrics

# As AggregationSession: in DeviceStreams, ``Session`` is the RPC.
from tally.aggregator.session import DeviceQueue, StreamEnd
from tally.aggregator.session import Session as AggregationSession
from tally.secagg.messages import ClientMessage
from tally.security import TicketVerifier
from tally.wire.chunks import MaskedInputAssembler
from tally.wire.join import JoinError, join_from_metadata
from tally.wire.protocol import open_envelope
from tally.wire.sized import already_serialized, sized
from tally.wire.v1 import secagg_pb2, secagg_pb2_grpc

log = logging.getLogger(__name__)


SERVICE = secagg_pb2.DESCRIPTOR.services_by_name["SecureAggregation"].full_name
# How long a stream stays open after its session's last message (SessionDone or Abort), for the
# device to close its side. A device may still be writing: an unmask answer the session no longer
# needed (it closes Unmask at t shares of every secret, and over-selection seats more devices than
# that). A write to a call the server already ended fails on the device as gRPC core's bare
# "INTERNAL: Internal error from Core", with the SessionDone unread behind it: a device whose input
# is in the sum would report an aborted session. The device's own wait is FINISH_SECONDS (5 s).
CLOSE_GRACE_SECONDS = 5.0
R = TypeVar("R")
# The stream's requests and responses travel as bytes: ``add_to_server`` registers it so. (A
# string: grpc's classes are generic in its stubs only.)
_StreamContext: TypeAlias = "grpc.aio.ServicerContext[bytes, bytes]"


def cpu_counted(fn: Callable[..., R], counter: Counter) -> Callable[..., R]:
    """``fn`` with its thread CPU time added to ``counter``: the aggregator's CPU is itemised as
    engine, wire conversion and the rest (gRPC, TLS, the event loop), so a load test can say
    where a round's CPU goes."""

    def counted(*args: object) -> R:
        start = time.thread_time()
        try:
            return fn(*args)
        finally:
            counter.inc(time.thread_time() - start)

    return counted


def add_to_server(streams: DeviceStreams, server: grpc.aio.Server) -> None:
    """Like the generated ``add_SecureAggregationServicer_to_server``, with requests delivered as
    (wire size, message) and responses written as the bytes ``_send`` serialised and counted."""
    # Requests arrive as bytes: the stream parses them (``_read``), so that a stream that has not
    # joined yet cannot make the aggregator parse anything larger than a Join.
    handlers = {"Session": grpc.stream_stream_rpc_method_handler(
        streams.Session, request_deserializer=already_serialized, response_serializer=already_serialized)}
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
    server.add_registered_method_handlers(SERVICE, handlers)


class DeviceStreams(secagg_pb2_grpc.SecureAggregationServicer):
    def __init__(
        self,
        aggregator_id: str,
        verifier: TicketVerifier,
        sessions: HeldSessions,
        metrics: AggregatorMetrics,
        clock: Callable[[], float],
    ) -> None:
        self._id = aggregator_id
        self._verifier = verifier
        self._sessions = sessions
        self._metrics = metrics
        self._clock = clock
        decode = metrics.wire_cpu.labels(direction="decode")
        self._parse = cpu_counted(sized(secagg_pb2.DeviceToAggregator), decode)
        self._decode = cpu_counted(self._open, decode)
        self._serialise = cpu_counted(secagg_pb2.AggregatorToDevice.SerializeToString,
                                      metrics.wire_cpu.labels(direction="encode"))

    @property
    def metrics(self) -> AggregatorMetrics:
        return self._metrics

    @staticmethod
    def _open(chunks: MaskedInputAssembler, envelope: secagg_pb2.DeviceToAggregator) -> ClientMessage | None:
        """A device message as the engine's value, or None while a masked input's chunks are
        still arriving."""
        whole = chunks.add(envelope)
        return None if whole is None else open_envelope(whole)

    async def Session(self, request_iterator: AsyncIterator[bytes], context: _StreamContext) -> None:
        try:
            session, index, queue = self._join(context)
        except REFUSALS as exc:
            rejected = Rejected.of(exc)
            self._metrics.reject(rejected.reason, rejected.status)
            logs.event(log, "join refused", level=logging.WARNING, status=rejected.status,
                       reason=rejected.reason, detail=rejected.message)
            await abort(context, rejected)
        reader = asyncio.create_task(self._relay(context, session, index, queue))
        try:
            await self._send(context, queue)
            await asyncio.wait({reader}, timeout=CLOSE_GRACE_SECONDS)  # the device half-closes
        finally:
            reader.cancel()
            session.leave(index)

    async def _read(self, context: _StreamContext) -> secagg_pb2.DeviceToAggregator | None:
        """The next message, parsed."""
        data = await context.read()
        # grpc-stubs type a servicer's read as the request alone; gRPC returns grpc.aio.EOF once
        # the device half-closes (as the stubs say of the client's read).
        if data is grpc.aio.EOF:  # type: ignore[comparison-overlap]
            return None
        self._metrics.received_bytes.inc(len(data))
        size, envelope = self._parse(data)
        if envelope is None:
            raise Rejected("INVALID_ARGUMENT", f"a {size}-byte message that is not a DeviceToAggregator",
                           "malformed")
        return envelope

    def _join(self, context: _StreamContext) -> tuple[AggregationSession, int, DeviceQueue]:
        try:
            join = join_from_metadata(context.invocation_metadata())
        except JoinError as exc:
            raise Rejected("UNAUTHENTICATED", str(exc), "not_joined") from None
        ticket = self._verifier.verify(join.session_ticket, self._clock(), aggregator_id=self._id)
        session = self._sessions.get(ticket.session_id)
        queue = session.join(join.session_ticket, join.device_index, join.session_token)
        return session, join.device_index, queue

    async def _relay(
        self,
        context: _StreamContext,
        session: AggregationSession,
        index: int,
        queue: DeviceQueue,
    ) -> None:
        """Device -> session, until the device half-closes or a message is refused."""
        chunks = MaskedInputAssembler(session.packed_bytes)
        try:
            while (envelope := await self._read(context)) is not None:
                if (message := self._decode(chunks, envelope)) is None:
                    continue  # a masked input's chunk: wait for the rest
                await session.submit(index, message)
        except REFUSALS as exc:
            rejected = Rejected.of(exc)
            self._metrics.reject(rejected.reason, rejected.status)
            logs.event(log, "device message refused", level=logging.WARNING, device=index,
                       status=rejected.status, reason=rejected.reason, detail=rejected.message,
                       **session.log_fields)
            queue.put_nowait(StreamEnd(rejected.status, rejected.message))
        except asyncio.CancelledError:
            raise
        except Exception:  # never let one stream's bug pass silently or hang the device
            log.exception("device stream failed", extra={"fields": session.log_fields})
            queue.put_nowait(StreamEnd("INTERNAL", "internal error"))

    async def _send(self, context: _StreamContext, queue: DeviceQueue) -> None:
        """Session -> device, until the session ends the stream."""
        while True:
            item = await queue.get()
            if isinstance(item, StreamEnd):
                if item.status is not None:
                    await abort(context, Rejected(item.status, item.message))
                return
            data = self._serialise(item)
            self._metrics.sent_bytes.inc(len(data))
            await context.write(data)
