"""Registering test devices the way provisioned devices do: a credential from the coordinator's
enrolment key and a statement signed by the device's identity key."""

from __future__ import annotations

import time

from tally.client.enrolment import register_request
from tally.coordinator.service import CoordinatorService
from tally.secagg import SigningKey
from tally.security.enrolment import SharedKeyEnrolment
from tally.wire.v1 import coordinator_pb2


def provisioned_request(
    service: CoordinatorService,
    device_id: str,
    population: str = "default",
    identity: SigningKey | None = None,
    now: float | None = None,
) -> coordinator_pb2.RegisterRequest:
    """A valid registration (a fresh identity key unless given)."""
    assert service.enrolment_key is not None, "the coordinator is not started"
    credential = SharedKeyEnrolment(service.enrolment_key).credential(population, device_id)
    return register_request(
        identity or SigningKey.generate(), device_id, population, credential, time.time() if now is None else now
    )
