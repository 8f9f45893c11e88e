"""Job events: persisted for the record, fanned out to ``WatchJob`` streams as they happen."""

from __future__ import annotations

import asyncio
from collections import defaultdict
from collections.abc import Callable, Mapping

from google.protobuf.timestamp_pb2 import Timestamp

from tally.coordinator.state.store import EventRecord, Store
from tally.wire.v1 import admin_pb2, common_pb2

TERMINAL_STATES = frozenset({"SUCCEEDED", "FAILED", "CANCELLED"})


def job_state(name: str) -> int:
    return common_pb2.JobState.Value(f"JOB_STATE_{name}") if name else 0


def round_phase(name: str) -> int:
    return common_pb2.RoundPhase.Value(f"ROUND_PHASE_{name}") if name else 0


def timestamp(seconds: float) -> Timestamp:
    out = Timestamp()
    out.FromNanoseconds(int(seconds * 1e9))
    return out


def event_to_proto(event: EventRecord) -> admin_pb2.JobEvent:
    return admin_pb2.JobEvent(
        job_id=event.job_id, round=event.round, phase=round_phase(event.phase), step=event.step,
        state=job_state(event.state), metrics=dict(event.metrics), message=event.message,
        time=timestamp(event.time),
    )


class EventHub:
    def __init__(self, store: Store, clock: Callable[[], float]) -> None:
        self._store, self._clock = store, clock
        self._subscribers: dict[str, set[asyncio.Queue[EventRecord | None]]] = defaultdict(set)
        # What reacts to every job's events in process (model-quality gauges, experiment tracking):
        # called on the event loop, so each must return at once.
        self._listeners: list[Callable[[EventRecord], None]] = []

    def listen(self, listener: Callable[[EventRecord], None]) -> None:
        self._listeners.append(listener)

    def publish(
        self,
        job_id: str,
        *,
        round: int,
        state: str,
        phase: str = "",
        step: str = "",
        message: str = "",
        metrics: Mapping[str, float] | None = None,
    ) -> EventRecord:
        event = EventRecord(job_id, self._clock(), round, phase, step, state, message, dict(metrics or {}))
        self._store.add_event(event)
        for queue in self._subscribers.get(job_id, ()):
            queue.put_nowait(event)
        for listener in self._listeners:
            listener(event)
        return event

    def subscribe(self, job_id: str) -> asyncio.Queue[EventRecord | None]:
        queue: asyncio.Queue[EventRecord | None] = asyncio.Queue()
        self._subscribers[job_id].add(queue)
        return queue

    def unsubscribe(self, job_id: str, queue: asyncio.Queue[EventRecord | None]) -> None:
        subscribers = self._subscribers.get(job_id)
        if subscribers is not None:
            subscribers.discard(queue)
            if not subscribers:
                del self._subscribers[job_id]

    def close(self) -> None:
        """End every watch stream (the coordinator is stopping)."""
        for queues in self._subscribers.values():
            for queue in queues:
                queue.put_nowait(None)
