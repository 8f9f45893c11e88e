"""The load tester's side of the SDK's seam (``tally.client.hooks``): what makes a real ``Device``
a simulated one. A fleet gives each of its devices a ``SimulatedDevice``; a test may give one to
a single device (a planned dropout, say).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np

from tally.algorithms.base import Arrays
from tally.client.metrics import ClientMetrics
from tally.codec import PayloadSchema
from tally.codec.fingerprint import ring_fingerprint, sum_key
from tally.loadtest.behaviour import DeviceTraits, SessionEvents
from tally.loadtest.dropout import DropoutPlan
from tally.loadtest.sum_audit import InputFingerprint
from tally.loadtest.synthetic import SyntheticUpdates
from tally.secagg import DevicePolicy, SecAggClient, SessionConfig, SigningKey
from tally.secagg.messages import ClientMessage
from tally.wire.v1 import coordinator_pb2


class SimulatedDevice:
    """One simulated device (``Device(hooks=SimulatedDevice(...))``). ``dropout``: sessions it
    leaves, drawn per session; it overrides the dropouts of ``traits``, the device's draw from a
    behaviour profile (``Fleet.behave`` changes it between rounds). ``synthetic``: its inputs
    instead of training. ``audit``: where the fingerprint of each input is appended.
    ``metrics``: where the misbehaviour of a corrupt dealer is counted (the device's own)."""

    def __init__(
        self,
        device_id: str,
        *,
        dropout: DropoutPlan | None = None,
        traits: DeviceTraits | None = None,
        synthetic: SyntheticUpdates | None = None,
        audit: list[InputFingerprint] | None = None,
        metrics: ClientMetrics | None = None,
    ) -> None:
        self.traits = traits
        self._dropouts: Iterator[str | None] | None = dropout.draws(device_id) if dropout else None
        self._synthetic = synthetic
        self._audit = audit
        self._metrics = metrics
        # The opening message of the device's last session: a replaying device sends it again.
        self._last_opening: ClientMessage | None = None

    def offline_for(self, elapsed: float) -> float | None:
        if self.traits is None:
            return 0.0
        if elapsed >= self.traits.lifetime_s:
            return None  # churn
        return self.traits.offline_for(elapsed)

    def checkin_wait(self, asked: float) -> float | None:
        return self.traits.checkin_wait(asked) if self.traits is not None else None

    def compute_seconds(self) -> float:
        return self.traits.compute_seconds if self.traits is not None else 0.0

    def session(self) -> SimulatedSession | None:
        events = self.traits.session_events() if self.traits is not None else SessionEvents()
        if self._dropouts is not None:
            events = dataclasses.replace(events, drop_phase=next(self._dropouts))
        if self.traits is None:
            # Only a planned dropout: no network, no misbehaviour, nothing to replay later.
            return None if events.drop_phase is None else SimulatedSession(events)
        previous, self._last_opening = self._last_opening, None
        return SimulatedSession(events, self.traits, previous if events.replay else None, self._metrics,
                                self._opened)

    def _opened(self, message: ClientMessage) -> None:
        self._last_opening = message

    def inputs(self, task: coordinator_pb2.TaskAssignment, step: str, schema: PayloadSchema) -> Arrays | None:
        if self._synthetic is None:
            return None
        return self._synthetic.values(task.job_id, task.round, step, schema)

    def input_encoded(self, task: coordinator_pb2.TaskAssignment, session_id: str, sum_id: str, bits: int,
                      vector: np.ndarray) -> None:
        if self._audit is not None:
            self._audit.append(InputFingerprint(
                task.job_id, task.round, session_id, sum_id, task.device_index, bits,
                ring_fingerprint(vector, bits, sum_key(session_id, sum_id))))


@dataclass(frozen=True)
class SimulatedSession:
    """One session of a ``SimulatedDevice``: its draw of ``events``, the device's network
    (``traits``), the message it replays, where a corrupt dealer is counted, and who learns the
    session's opening message."""

    events: SessionEvents
    traits: DeviceTraits | None = None
    replay: ClientMessage | None = None
    metrics: ClientMetrics | None = None
    on_open: Callable[[ClientMessage], None] | None = None

    @property
    def drop_phase(self) -> str | None:
        return self.events.drop_phase

    @property
    def late(self) -> bool:
        return self.events.late

    @property
    def duplicate(self) -> bool:
        return self.events.duplicate

    @property
    def corrupt(self) -> bool:
        return self.events.corrupt

    @property
    def stall(self) -> bool:
        return self.events.stall

    def secagg_client(self, config: SessionConfig, index: int, identity: SigningKey,
                      policy: DevicePolicy) -> SecAggClient:
        dealer = self.events.dealer
        if dealer is None:
            return SecAggClient(config, index, identity, policy=policy)
        client = dealer(config, index, identity, policy=policy)
        if self.metrics is not None:
            self.metrics.misbehaviours.labels(kind=dealer.kind).inc()
        return client

    def opened(self, message: ClientMessage) -> None:
        if self.on_open is not None:
            self.on_open(message)

    def send_delay(self, size: int) -> float:
        return self.traits.send_delay(size) if self.traits is not None else 0.0

    def receive_delay(self, size: int) -> float:
        return self.traits.receive_delay(size) if self.traits is not None else 0.0
