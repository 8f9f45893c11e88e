"""The SDK's one seam for a load tester: what a simulated device does besides the product.

A real device has no hooks (``Device(hooks=None)``) and then none of this runs. The load tester
(``tally.loadtest.hooks``) plugs in here what it needs to make a fleet of real ``Device`` objects
behave like a population: availability and churn, check-in pacing, compute time, planned
dropouts and misbehaviour in sessions, network delays, synthetic inputs, and the fingerprints
of every input for its sum audit. The SDK names only these protocols, never the load tester.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from tally.algorithms.base import Arrays
from tally.codec import PayloadSchema
from tally.secagg import DevicePolicy, SecAggClient, SessionConfig, SigningKey
from tally.secagg.messages import ClientMessage
from tally.wire.v1 import coordinator_pb2


class SessionHooks(Protocol):
    """One session's departures from the protocol, drawn when the session starts."""

    @property
    def drop_phase(self) -> str | None:
        """Leave (cancel the call, no goodbye) when the aggregator asks for this phase."""

    @property
    def late(self) -> bool:
        """Hold the masked input until its phase's deadline has passed."""

    @property
    def duplicate(self) -> bool:
        """Send the opening message twice."""

    @property
    def replay(self) -> ClientMessage | None:
        """A message of an earlier session to open with (the aggregator must refuse it)."""

    @property
    def corrupt(self) -> bool:
        """Send bytes that are no message before the protocol starts."""

    @property
    def stall(self) -> bool:
        """Fall silent with the stream open until it times out."""

    def secagg_client(self, config: SessionConfig, index: int, identity: SigningKey,
                      policy: DevicePolicy) -> SecAggClient:
        """The protocol's device half: the honest one, or an adversary (``tally.secagg.adversary``)."""

    def opened(self, message: ClientMessage) -> None:
        """The first protocol message this session sent (a later session may replay it)."""

    def send_delay(self, size: int) -> float:
        """Seconds the device's uplink takes to send ``size`` bytes."""

    def receive_delay(self, size: int) -> float:
        """Seconds the device's downlink takes to receive ``size`` bytes."""


class DeviceHooks(Protocol):
    """What a load tester changes in one device's life (``Device(hooks=...)``)."""

    def offline_for(self, elapsed: float) -> float | None:
        """Seconds until the device is online, ``elapsed`` seconds after it started (0: it is);
        None when it has left the population for good."""

    def checkin_wait(self, asked: float) -> float | None:
        """Seconds an idle device waits when the coordinator asked for ``asked``; None: the
        device's own pacing."""

    def compute_seconds(self) -> float:
        """Seconds the local computation of an input takes on top of the real work."""

    def session(self) -> SessionHooks | None:
        """The next session's departures from the protocol; None: it follows the protocol."""

    def inputs(self, task: coordinator_pb2.TaskAssignment, step: str, schema: PayloadSchema) -> Arrays | None:
        """Values to sum instead of what the trainer computes (synthetic devices); None: train."""

    def input_encoded(self, task: coordinator_pb2.TaskAssignment, session_id: str, sum_id: str, bits: int,
                      vector: np.ndarray) -> None:
        """The ring-encoded input the device will mask for ``sum_id`` (called in a worker thread)."""
