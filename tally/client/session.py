"""The device end of one secure-aggregation session: a bidirectional gRPC stream to the
aggregator, pumping messages between it and the sans-IO ``SecAggClient``.

The device opens the stream with its Join in the metadata, checks that the configuration the
aggregator answers with is the one the coordinator assigned (an aggregator must not be able to
run the device in another session or graph), then relays protocol messages until SessionDone or
Abort. Its masked input goes out as soon as both the aggregator has asked and the local
computation is ready; an Abort that arrives meanwhile is seen at once. A simulated device's
hooks (``tally.client.hooks.SessionHooks``) may make it leave in a phase (it really cancels the
call), misbehave, or wait as a slow network would.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import grpc
import numpy as np

from tally import logs
from tally.algorithms.base import ModelMismatch
from tally.client.contribution import TaskError
from tally.client.download import DownloadError
from tally.client.hooks import SessionHooks
from tally.client.metrics import ClientMetrics
from tally.client.privacy_ledger import BudgetSpent
from tally.evaluation import EvaluationError
from tally.privacy.payload import NoiseBelowFloor
from tally.secagg import (
    DevicePolicy,
    ProtocolError,
    SecAggClient,
    SessionConfig,
    SigningKey,
)
from tally.secagg.messages import (
    Abort,
    ClientMessage,
    MaskedInputResponse,
    ServerMessage,
    ShareDelivery,
    ShareKeysRequest,
)
from tally.secagg.phases import Phase, asked_for
from tally.wire.chunks import split_masked_input
from tally.wire.fields import WireError
from tally.wire.join import join_metadata
from tally.wire.protocol import device_envelope, from_proto, open_envelope
from tally.wire.sized import already_serialized, sized
from tally.wire.v1 import coordinator_pb2, secagg_pb2

log = logging.getLogger(__name__)

COMPLETED, ABORTED, DROPPED = "completed", "aborted", "dropped"
SESSION_METHOD = f"/{secagg_pb2.DESCRIPTOR.services_by_name['SecureAggregation'].full_name}/Session"
# Slack on top of the sum of phase deadlines before the device gives up on a silent aggregator.
STREAM_SLACK_SECONDS = 30.0
# How long the device waits for the aggregator to end the call after SessionDone.
FINISH_SECONDS = 5.0
# How long a device whose write failed waits for the stream's status, to report the real reason.
STATUS_WAIT_SECONDS = 2.0

# Bytes that parse as no DeviceToAggregator (field 1 with an invalid wire type): a corrupt message.
CORRUPT_MESSAGE = b"\x0f\xff\xff\xff"

# Server messages whose handling is real work (key agreement, Shamir sharing, share decryption):
# run off the event loop so that many simulated devices share it.
_HEAVY = (ShareKeysRequest, ShareDelivery)


@dataclass(frozen=True)
class SessionOutcome:
    status: str  # COMPLETED, ABORTED or DROPPED
    reason: str = ""
    # True when the session finished with this device's input in every sum.
    contributed: bool = False
    bytes_up: int = 0
    bytes_down: int = 0
    # True once a masked input left the device: from then on it may be in a sum of the round.
    sent_input: bool = False
    # Why it did not complete, as a ``tally.client.reports.REASONS`` label.
    label: str = ""


class SessionMismatch(Exception):
    """The aggregator announced a configuration other than the assigned one."""


def stream_timeout(deadlines: secagg_pb2.PhaseDeadlines, sums: int) -> float | None:
    """Upper bound on a session's length from its phase deadlines; None when none are set."""
    d = deadlines
    total = d.advertise_keys_seconds + d.share_keys_seconds + sums * (
        d.masked_input_seconds + d.consistency_check_seconds + d.unmask_seconds
    )
    return total + STREAM_SLACK_SECONDS if total > 0 else None


async def stream_status(
    call: grpc.aio.Call | None, error: grpc.aio.AioRpcError | asyncio.InvalidStateError
) -> tuple[grpc.StatusCode, str]:
    """The status the server ended the stream with. A write that races the server's end of the
    stream fails with a generic error (INTERNAL "Internal error from Core", or "RPC already
    finished") while the call itself holds the server's status and message, which is what the
    device should report."""
    if call is not None:
        with contextlib.suppress(TimeoutError):
            # The server's status follows its end of the stream at once; wait briefly for it.
            code = await asyncio.wait_for(call.code(), STATUS_WAIT_SECONDS)
            if code != grpc.StatusCode.OK:
                return code, await call.details()
    if isinstance(error, grpc.aio.AioRpcError):
        return error.code(), error.details()
    return grpc.StatusCode.UNKNOWN, "the aggregator ended the stream"


async def settle(*tasks: asyncio.Future | None) -> None:
    """Cancel a session's helper tasks and collect how each ended. A read that failed while the
    session was leaving for another reason (a send to a killed aggregator, say) has nothing left
    to tell, but left uncollected it is logged as "Task exception was never retrieved"."""
    started = [t for t in tasks if t is not None]
    for t in started:
        t.cancel()  # a task already done stays as it ended
    await asyncio.gather(*started, return_exceptions=True)


def input_failure_label(error: BaseException) -> str:
    """The report label of a failure to produce this device's input."""
    if isinstance(error, ModelMismatch):
        return "model_mismatch"
    if isinstance(error, NoiseBelowFloor):
        return "privacy_floor"
    if isinstance(error, BudgetSpent):
        return "privacy_budget_spent"
    if isinstance(error, EvaluationError):
        return EvaluationError.reason
    if isinstance(error, (grpc.RpcError, DownloadError)):
        return "download_failed"
    if isinstance(error, TaskError):
        return "invalid_task"
    return "training_error"


class SecAggSession:
    """One session; ``run`` never raises for what the network or the aggregator does, it
    returns the outcome. ``ring_input(sum_id)`` supplies this device's encoded input;
    ``identity`` signs its keys; ``policy`` is what it accepts of the configuration."""

    def __init__(
        self,
        channel: grpc.aio.Channel,
        task: coordinator_pb2.TaskAssignment,
        config: SessionConfig,
        ring_input: Callable[[str], Awaitable[np.ndarray]],
        metrics: ClientMetrics,
        *,
        identity: SigningKey,
        policy: DevicePolicy,
        hooks: SessionHooks | None = None,
        on_input: Callable[[], None] | None = None,
    ) -> None:
        """``hooks``: a simulated device's departures from the protocol in this session (None on
        a real device). ``on_input`` runs (in a thread) before the first masked input is written:
        the device's ledger records it durably first, and if that fails nothing is sent."""
        self.task = task
        self.config = config
        self.identity = identity
        self.policy = policy
        self.ring_input = ring_input
        self.metrics = metrics
        self.drop_phase = hooks.drop_phase if hooks is not None else None
        # The generated stub's method, with (de)serialisers that count bytes on the wire.
        self._open = channel.stream_stream(
            SESSION_METHOD, request_serializer=already_serialized,
            response_deserializer=sized(secagg_pb2.AggregatorToDevice), _registered_method=True)
        self._call: grpc.aio.StreamStreamCall | None = None
        self._up = 0
        self._down = 0
        self._sent_input = False
        self._on_input = on_input
        # The protocol phase the session is in, and when the aggregator asked for it while the
        # device's answer is not sent yet (tally_client_phase_duration_seconds).
        self._phase = Phase.JOIN
        self._asked_at: float | None = None
        self._hooks = hooks
        # The first protocol message this device sent (the hooks learn it: a simulated device's
        # next session may replay it).
        self._opening: ClientMessage | None = None

    async def run(self) -> SessionOutcome:
        start = time.perf_counter()
        self.metrics.active_sessions.inc()
        try:
            outcome = await self._run()
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError) as exc:
            code, details = await stream_status(self._call, exc)
            outcome = self._outcome(ABORTED, f"stream ended: {code.name}: {details}")
        except (ProtocolError, WireError, SessionMismatch) as exc:
            outcome = self._outcome(ABORTED, f"{type(exc).__name__}: {exc}")
        finally:
            self._cancel()
            self.metrics.active_sessions.dec()
        self.metrics.sessions.labels(outcome.status).inc()
        self.metrics.session_seconds.labels(outcome.status).observe(time.perf_counter() - start)
        if outcome.status != COMPLETED:
            self.metrics.observe_end(self._phase, outcome.status)
        self.metrics.upload_bytes.inc(outcome.bytes_up)
        self.metrics.download_bytes.labels("session").inc(outcome.bytes_down)
        logs.event(log, f"session {outcome.status}", job_id=self.config.ref.job_id,
                   round=self.config.ref.round, session_id=self.config.ref.session_id,
                   device_index=self.task.device_index, reason=outcome.reason)
        return outcome

    async def _run(self) -> SessionOutcome:
        task = self.task
        join = secagg_pb2.Join(session_ticket=task.session_ticket, device_index=task.device_index,
                               session_token=task.session_token)
        # The Join rides in the stream's metadata: the aggregator checks it before reading anything.
        self._call = self._open(timeout=stream_timeout(task.deadlines, len(self.config.sums)),
                                metadata=join_metadata(join))
        joined = await self._read()
        if joined is None:
            return self._outcome(ABORTED, "the aggregator closed the stream before Joined")
        if not isinstance(joined, secagg_pb2.Joined):
            return self._outcome(ABORTED, f"expected Joined, got {type(joined).__name__}")
        if from_proto(joined.config) != self.config:
            raise SessionMismatch("the aggregator's session config differs from the assignment")
        hooks = self._hooks
        if hooks is None:
            client = SecAggClient(self.config, task.device_index, self.identity, policy=self.policy)
        else:
            client = hooks.secagg_client(self.config, task.device_index, self.identity, self.policy)
        self._asked(Phase.ADVERTISE_KEYS)  # Joined is the aggregator's request for the device's keys
        if self.drop_phase == Phase.ADVERTISE_KEYS:
            return self._drop()
        if hooks is not None:
            if hooks.replay is not None:
                self.metrics.misbehaviours.labels(kind="replay").inc()
                await self._send(hooks.replay)  # a message of another session: must be refused
            if hooks.corrupt:
                self.metrics.misbehaviours.labels(kind="corrupt").inc()
                await self._call.write(CORRUPT_MESSAGE)
            if hooks.stall:
                self.metrics.misbehaviours.labels(kind="stall").inc()
                return await self._stall()
        await self._send_all(client.start())
        return await self._pump(client)

    async def _pump(self, client: SecAggClient) -> SessionOutcome:
        first_sum = self.config.sums[0].sum_id
        reading: asyncio.Task | None = None
        computing: asyncio.Task | None = None
        try:
            while True:
                if reading is None:
                    reading = asyncio.ensure_future(self._read())
                waiting = {reading} if computing is None else {reading, computing}
                done, _ = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
                if computing in done:
                    sum_id = client.awaiting_input
                    try:
                        vector = computing.result()
                    except Exception as exc:  # noqa: BLE001  (the application's training code)
                        # No input, no place in the sum: leave now rather than at the deadline.
                        self._cancel()
                        return self._outcome(ABORTED, f"no input for sum {sum_id!r}: {type(exc).__name__}: {exc}",
                                             label=input_failure_label(exc))
                    computing = None
                    if self._hooks is not None and self._hooks.late:  # hold the input until its phase is over
                        self.metrics.misbehaviours.labels(kind="late").inc()
                        await asyncio.sleep(self.task.deadlines.masked_input_seconds + 1.0)
                    await self._send_all(await asyncio.to_thread(client.provide_input, sum_id, vector))
                if reading not in done:
                    continue
                message, reading = reading.result(), None
                if message is None:
                    return self._outcome(ABORTED, "the aggregator closed the stream without SessionDone")
                if isinstance(message, secagg_pb2.SessionDone):
                    await self._finish()
                    return self._outcome(COMPLETED, "", client.finished and client.aborted is None)
                if isinstance(message, Abort):
                    return self._outcome(ABORTED, message.reason or "aborted by the aggregator")
                if not isinstance(message, ServerMessage):
                    return self._outcome(ABORTED, f"unexpected {type(message).__name__} on the stream")
                request = asked_for(message)
                if request is not None:
                    phase, sum_id = request
                    self._asked(phase)
                    if phase == self.drop_phase and sum_id in ("", first_sum):
                        return self._drop()
                if isinstance(message, _HEAVY):
                    replies = await asyncio.to_thread(client.receive, message)
                else:
                    replies = client.receive(message)
                await self._send_all(replies)
                if client.awaiting_input is not None and computing is None:
                    computing = asyncio.ensure_future(self.ring_input(client.awaiting_input))
        finally:
            await settle(reading, computing)

    async def _stall(self) -> SessionOutcome:
        """Neither read nor write nor close until the stream's own timeout: the aggregator must
        go on without the device, and its writes to it must not block the session."""
        with contextlib.suppress(grpc.aio.AioRpcError, asyncio.InvalidStateError):
            await self._call.code()
        self._cancel()
        return self._outcome(DROPPED, "stalled: stopped reading without closing the stream")

    def _drop(self) -> SessionOutcome:
        """Leave as a lost connection would: cancel the call, no goodbye."""
        self._cancel()
        return self._outcome(DROPPED, f"planned dropout in {self.drop_phase}")

    async def _send(self, message: ClientMessage) -> None:
        if isinstance(message, MaskedInputResponse):
            if not self._sent_input and self._on_input is not None:
                await asyncio.to_thread(self._on_input)
            self._sent_input = True  # before the write: once it may have left, it counts as sent
        hooks = self._hooks
        opening = self._opening is None and (hooks is None or message is not hooks.replay)
        copies = 1
        if opening:
            self._opening = message
            if hooks is not None:
                hooks.opened(message)
                copies = 2 if hooks.duplicate else 1
        if copies == 2:
            self.metrics.misbehaviours.labels(kind="duplicate").inc()
        for envelope in split_masked_input(device_envelope(message)) * copies:
            data = envelope.SerializeToString()
            self._up += len(data)
            if hooks is not None:
                await asyncio.sleep(hooks.send_delay(len(data)))
            await self._call.write(data)

    async def _send_all(self, messages: list[ClientMessage]) -> None:
        for message in messages:
            await self._send(message)
        if messages and self._asked_at is not None:  # the answer to the phase asked is out
            self.metrics.observe_phase(self.config.ref.job_id, self.config.ref.round, self._phase,
                                       time.perf_counter() - self._asked_at)
            self._asked_at = None

    def _asked(self, phase: Phase) -> None:
        self._phase, self._asked_at = phase, time.perf_counter()

    async def _read(self):
        """The next message (protocol value, Joined or SessionDone); None at end of stream."""
        sized_envelope = await self._call.read()
        if sized_envelope is grpc.aio.EOF:
            return None
        size, envelope = sized_envelope
        self._down += size
        if envelope is None:
            raise WireError(f"the aggregator sent {size} bytes that are not an AggregatorToDevice")
        if self._hooks is not None:
            await asyncio.sleep(self._hooks.receive_delay(size))
        return open_envelope(envelope)

    async def _finish(self) -> None:
        """Close our side and let the aggregator end the call (cancel it if it lingers)."""
        with contextlib.suppress(grpc.aio.AioRpcError, asyncio.InvalidStateError, TimeoutError):
            await self._call.done_writing()
            async with asyncio.timeout(FINISH_SECONDS):
                while await self._call.read() is not grpc.aio.EOF:
                    pass

    def _cancel(self) -> None:
        if self._call is not None and not self._call.done():
            self._call.cancel()

    def _outcome(self, status: str, reason: str, contributed: bool = False, *,
                 label: str | None = None) -> SessionOutcome:
        if label is None:
            label = {COMPLETED: "", DROPPED: "dropped"}.get(status, "session_aborted")
        return SessionOutcome(status, reason, contributed, self._up, self._down, self._sent_input,
                              label)
