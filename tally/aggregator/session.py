"""One secure-aggregation session: a sans-IO ``SecAggServer`` driven by device streams and phase
deadlines.

The protocol core decides everything; this class only feeds it and routes what it says:

- every call into the server that can close a phase (a deadline, a lost device, the last message
  a phase waits for, any Unmask answer) runs in a worker thread, one at a time under the session's
  lock, so the Unmask close of a large cohort (about a second of CPU) never stalls the event loop
  that serves every other session and stream; the other messages only validate and store, and
  run inline, where the hand-off to a thread cost more CPU than the work (issue 8's profile);
- that work runs as its own task, shielded from the caller: a device that disconnects halfway
  through a call cannot cancel it and leave the lock free while the thread still mutates the
  server;
- each phase gets a timer for its deadline; a phase change bumps a generation number, so a timer
  of an old phase that fires late (or is already waiting for the lock) cannot close the new one;
- what the server emits goes to the queue of each connected device; a device that is not
  connected just misses it, which is exactly what a dropout is.

Nothing outlives the session: ``HeldSessions`` drops it when the coordinator closes it or its
results expire.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from functools import partial
from typing import Any, TypedDict, TypeVar

from tally import logs
from tally.aggregator.admission import SessionPlan
from tally.aggregator.errors import Rejected
from tally.aggregator.metrics import AggregatorMetrics
from tally.codec import packed_size
from tally.secagg import ProtocolError, SecAggServer, SessionConfig
from tally.secagg.messages import (
    Abort,
    ClientMessage,
    Outgoing,
    SessionAborted,
    SumResult,
    UnmaskResponse,
)
from tally.secagg.phases import Phase
from tally.wire.protocol import aggregator_envelope, to_proto
from tally.wire.v1 import secagg_pb2

log = logging.getLogger(__name__)

COMPLETED, ABORTED, CLOSED = "completed", "aborted", "closed"
T = TypeVar("T")


@dataclass(frozen=True)
class StreamEnd:
    """The last item of a device's queue: end the stream, with this status when it is set."""

    status: str | None = None
    message: str = ""


DeviceQueue = asyncio.Queue[secagg_pb2.AggregatorToDevice | StreamEnd]  # the envelopes, then one StreamEnd
Routed = list[tuple[int, secagg_pb2.AggregatorToDevice]]


class LogFields(TypedDict):
    """What every log line about a session carries (``logs.event`` fields)."""

    job_id: str
    round: int
    session_id: str


class Session:
    """``on_finished`` is called once, when the session completes, aborts or is closed."""

    def __init__(
        self,
        plan: SessionPlan,
        metrics: AggregatorMetrics,
        on_finished: Callable[[Session], None],
    ) -> None:
        self.plan = plan
        self.config: SessionConfig = plan.config
        self.server = SecAggServer(plan.config)
        self.outcome: str | None = None
        self._metrics = metrics
        self._on_finished = on_finished
        self._loop = asyncio.get_running_loop()
        self._lock = asyncio.Lock()
        self._streams: dict[int, DeviceQueue] = {}
        self._joined: set[int] = set()
        self._results: dict[str, asyncio.Future[SumResult | SessionAborted]] = {
            spec.sum_id: self._loop.create_future() for spec in self.config.sums
        }
        self._tasks: set[asyncio.Task[object]] = set()  # kept alive until done
        self._timer: asyncio.TimerHandle | None = None
        self._generation = 0
        self._phase_key: tuple[str, int] = ("", 0)
        self._phase_started = 0.0
        self._phase_expected: frozenset[int] = frozenset()
        self._phase_answered: set[int] = set()
        ref = self.config.ref
        self.log_fields: LogFields = {"job_id": ref.job_id, "round": ref.round, "session_id": ref.session_id}

    @property
    def session_id(self) -> str:
        return self.config.ref.session_id

    @property
    def finished(self) -> bool:
        return self.outcome is not None

    def start(self) -> None:
        """The session is in AdvertiseKeys (a plain session: in its join window) from now on;
        its first deadline starts."""
        self._metrics.sessions_opened.inc()
        self._metrics.active_sessions.inc()
        self._enter_phase()
        logs.event(log, "session opened", n=self.config.n, k=self.config.params.k,
                   t=self.config.threshold, sums=[s.sum_id for s in self.config.sums],
                   leader_epoch=self.plan.leader_epoch, **self.log_fields)

    # -- devices ----------------------------------------------------------------------------------

    def join(self, ticket: bytes, index: int, token: str) -> DeviceQueue:
        """Admit device ``index``: its queue, which starts with ``Joined``."""
        if not hmac.compare_digest(bytes(ticket), self.plan.ticket):
            raise Rejected("PERMISSION_DENIED", "session ticket does not match this session",
                           "ticket_mismatch")
        if not 1 <= index <= self.config.n:
            raise Rejected("INVALID_ARGUMENT",
                           f"device_index {index} is outside the cohort 1..{self.config.n}",
                           "invalid_join")
        digest = hashlib.sha256(token.encode("utf-8")).digest()
        if not hmac.compare_digest(digest, self.plan.grants[index]):
            raise Rejected("UNAUTHENTICATED", f"session token is not valid for device {index}",
                           "bad_token")
        if index in self._joined:
            raise Rejected("ALREADY_EXISTS",
                           f"device {index} already joined session {self.session_id}",
                           "duplicate_join")
        if self.finished:
            raise Rejected("FAILED_PRECONDITION", f"session {self.session_id} is over",
                           "session_over")
        if self.server.phase not in (Phase.ADVERTISE_KEYS, Phase.JOIN):
            raise Rejected("FAILED_PRECONDITION",
                           f"session {self.session_id} is past advertise_keys: device {index} "
                           "joined too late", "late_join")
        self._joined.add(index)
        queue: DeviceQueue = asyncio.Queue()
        joined = secagg_pb2.Joined(config=to_proto(self.config),
                                   deadlines=self.plan.deadlines_proto)
        queue.put_nowait(aggregator_envelope(joined))
        self._streams[index] = queue
        logs.event(log, "device joined", level=logging.DEBUG, device=index, **self.log_fields)
        if self.server.phase == Phase.JOIN and len(self._joined) == self.config.n:
            self._spawn(self._drive(self._begin_plain))
        return queue

    def packed_bytes(self, sum_id: str) -> int | None:
        """The size of a masked input for ``sum_id`` on the wire; None if there is no such sum."""
        spec = next((s for s in self.config.sums if s.sum_id == sum_id), None)
        return None if spec is None else packed_size(spec.dim, spec.wire_bits)

    def leave(self, index: int) -> None:
        """The device's stream ended: nothing more is routed to it, and no phase waits for it."""
        if self._streams.pop(index, None) is not None and not self.finished:
            self._spawn(self._lost(index))

    async def _lost(self, index: int) -> None:
        await self._drive(partial(self.server.device_lost, index))

    async def submit(self, index: int, message: ClientMessage) -> None:
        """Feed a message of device ``index`` to the server; a refusal is raised."""
        if message.sender != index:
            raise Rejected("PERMISSION_DENIED",
                           f"device {index} cannot send as device {message.sender}",
                           "wrong_sender")
        refusal = await self._shielded(self._receive(message))
        if refusal is not None:
            raise refusal

    # -- the coordinator --------------------------------------------------------------------------

    def result(self, sum_id: str) -> asyncio.Future[SumResult | SessionAborted]:
        """Resolves to the sum's result, or to SessionAborted when the session ends without it."""
        future = self._results.get(sum_id)
        if future is None:
            raise Rejected("NOT_FOUND", f"session {self.session_id} has no sum {sum_id!r}",
                           "unknown_sum")
        return future

    def close(self, reason: str) -> None:
        """End the session now; devices still connected get an Abort saying ``reason``."""
        self._finish(CLOSED, f"session closed: {reason}")

    # -- driving the server -----------------------------------------------------------------------

    def _spawn(self, coroutine: Coroutine[Any, Any, T]) -> asyncio.Task[T]:
        task = self._loop.create_task(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _shielded(self, coroutine: Coroutine[Any, Any, T]) -> T:
        return await asyncio.shield(self._spawn(coroutine))

    async def _receive(self, message: ClientMessage) -> Exception | None:
        async with self._lock:
            if self.outcome == CLOSED:
                return Rejected("ABORTED", f"session {self.session_id} was closed",
                                "session_closed")
            call = partial(self._call, partial(self.server.receive, message))
            try:
                routed, seconds = await asyncio.to_thread(call) if self._may_close(message) else call()
            except ProtocolError as exc:
                if self._is_late(message):
                    self._metrics.late_messages.inc()
                    return None
                return exc
            except Exception as exc:  # noqa: BLE001 (a bug in the core fails this session, not the process)
                self._fail(exc)
                return Rejected("INTERNAL", "internal error; the session was aborted", "internal")
            self._phase_answered.add(message.sender)
            self._apply(routed, seconds)
            return None

    async def _deadline(self, generation: int) -> None:
        call = self._begin_plain if self.server.phase == Phase.JOIN else self.server.on_deadline
        await self._drive(call, lambda: generation == self._generation)

    def _begin_plain(self) -> list[Outgoing]:
        """A plain session's join window is over (all joined, or its deadline): devices that did
        not join are gone, and the others are asked for their inputs."""
        outgoing = []
        for index in sorted(set(range(1, self.config.n + 1)) - self._joined):
            outgoing += self.server.device_lost(index)
        return outgoing + self.server.start()

    async def _drive(self, call: Callable[[], list[Outgoing]], still_wanted: Callable[[], bool] = lambda: True) -> None:
        """An event that is not a device message (a deadline, a lost device) into the server."""
        async with self._lock:
            if self.finished or not still_wanted():
                return
            try:
                routed, seconds = await asyncio.to_thread(self._call, call)
            except Exception as exc:  # noqa: BLE001 (as above: the session fails, the process serves on)
                self._fail(exc)
                return
            self._apply(routed, seconds)

    def _call(self, call: Callable[[], list[Outgoing]]) -> tuple[Routed, float]:
        """In the worker thread: the server call, and the protobuf form of what it emits."""
        start, cpu, phase = time.perf_counter(), time.thread_time(), self.server.phase
        outgoing = call()
        seconds = time.perf_counter() - start
        engine_done = time.thread_time()
        self._metrics.engine_cpu.labels(phase=phase).inc(engine_done - cpu)
        routed = [(o.recipient, aggregator_envelope(o.message)) for o in outgoing]
        self._metrics.wire_cpu.labels(direction="encode").inc(time.thread_time() - engine_done)
        return routed, seconds

    def _may_close(self, message: ClientMessage) -> bool:
        """Unmask closes as soon as every secret has its shares, so any answer there may close it."""
        return self.server.phase == Phase.UNMASK or self.server.awaiting <= {message.sender}

    def _is_late(self, message: ClientMessage) -> bool:
        """An Unmask answer for a sum the server already unmasked: it closed Unmask as soon as
        it had t shares of every secret, so answers of slower devices are expected, not errors."""
        return (
            isinstance(message, UnmaskResponse)
            and message.ref == self.config.ref
            and message.sum_id in self.server.results
        )

    def _apply(self, routed: Routed, seconds: float) -> None:
        if self.outcome == CLOSED:  # closed while the thread ran: nothing goes out any more
            return
        for index, envelope in routed:
            queue = self._streams.get(index)
            if queue is None:
                continue
            queue.put_nowait(envelope)
            if envelope.WhichOneof("message") == "abort":
                queue.put_nowait(StreamEnd())
                del self._streams[index]
        for sum_id, result in self.server.results.items():
            if not self._results[sum_id].done():
                self._results[sum_id].set_result(result)
        if self._key() != self._phase_key:
            self._close_phase(seconds)
            if self.server.finished:
                aborted = self.server.aborted
                self._finish(ABORTED if aborted else COMPLETED, aborted.reason if aborted else "")
            else:
                self._enter_phase()

    def _key(self) -> tuple[str, int]:
        """Names the current phase uniquely within the session (phases repeat once per sum)."""
        return self.server.phase, len(self.server.results)

    def _enter_phase(self) -> None:
        self._generation += 1
        if self._timer is not None:
            self._timer.cancel()
        self._phase_key = self._key()
        self._phase_started = self._loop.time()
        self._phase_expected = self.server.awaiting
        self._phase_answered = set()
        deadline = self.server.phase.deadline
        assert deadline is not None, "only a finished session is in a phase without a deadline"
        seconds = self.plan.deadlines[deadline]
        self._timer = self._loop.call_later(seconds, self._fire, self._generation)

    def _fire(self, generation: int) -> None:
        self._spawn(self._deadline(generation))

    def _close_phase(self, seconds: float) -> None:
        phase = self._phase_key[0]
        m = self._metrics
        elapsed = self._loop.time() - self._phase_started
        m.phase_duration.labels(phase=phase).observe(elapsed)
        m.phase_devices.labels(phase=phase).observe(len(self._phase_answered))
        if phase == Phase.UNMASK:
            m.unmask_seconds.observe(seconds)
        if not self.server.finished:
            dropped = self._phase_expected - self.server.awaiting
        elif self.server.aborted is not None:
            dropped = self._phase_expected - self._phase_answered
        else:
            dropped = frozenset()
        if dropped:
            m.dropouts.labels(phase=phase).inc(len(dropped))
        logs.event(log, "phase closed", phase=phase, answered=len(self._phase_answered),
                   dropped=sorted(dropped), seconds=round(elapsed, 4), **self.log_fields)

    def _fail(self, error: Exception) -> None:
        log.error("session failed", exc_info=error, extra={"fields": self.log_fields})
        self._finish(ABORTED, f"internal error in the aggregator: {type(error).__name__}")

    def _finish(self, outcome: str, reason: str) -> None:
        if self.finished:
            return
        self.outcome = outcome
        self._generation += 1
        if self._timer is not None:
            self._timer.cancel()
        final: secagg_pb2.SessionDone | Abort
        if outcome == COMPLETED:
            final = secagg_pb2.SessionDone(sum_ids=[s.sum_id for s in self.config.sums])
        else:
            final = Abort(self.config.ref, reason)
        envelope = aggregator_envelope(final)
        for queue in self._streams.values():
            queue.put_nowait(envelope)
            queue.put_nowait(StreamEnd())
        self._streams.clear()
        for sum_id, future in self._results.items():
            if not future.done():
                future.set_result(self.server.results.get(sum_id) or SessionAborted(reason))
        self._metrics.sessions_finished.labels(outcome=outcome).inc()
        self._metrics.active_sessions.dec()
        if self.server.misbehaving:
            self._metrics.misbehaving_devices.inc(len(self.server.misbehaving))
            logs.event(log, "devices sent wrong shares", logging.WARNING,
                       devices={str(i): why for i, why in sorted(self.server.misbehaving.items())},
                       **self.log_fields)
        if self.server.disputed:
            self._metrics.disputed_complaints.inc(len(self.server.disputed))
            logs.event(log, "share complaints disputed", logging.INFO,
                       complaints={f"{dealer}>{holder}": what for (dealer, holder), what in sorted(
                           self.server.disputed.items())}, **self.log_fields)
        if self.server.excluded:
            self._metrics.excluded_devices.inc(len(self.server.excluded))
            logs.event(log, "devices excluded", logging.WARNING,
                       devices={str(i): why for i, why in sorted(self.server.excluded.items())},
                       **self.log_fields)
        logs.event(log, "session finished", level=logging.INFO if outcome == COMPLETED
                   else logging.WARNING, outcome=outcome, reason=reason,
                   sums=sorted(self.server.results), **self.log_fields)
        self._on_finished(self)
