"""What a device checks before it joins a session: the servers' word is not enough.

A device's input is protected only if the session is configured as its own policy demands
(threshold, cohort, no plain sum it never opted into) and if the roster that lists its
neighbours' identity keys is the coordinator's. The roster travels inside the session config,
which the coordinator binds into the session ticket it signs; checking that signature with the
coordinator's key (learnt at registration over the coordinator's own TLS channel) means neither
the aggregator nor anything between the two can hand the device another roster.
"""

from __future__ import annotations

from tally.client.contribution import TaskError
from tally.secagg import DevicePolicy, ProtocolError, SessionConfig, SigningKey
from tally.security import AuthError, TicketVerifier, config_digest
from tally.wire.protocol import session_config_bytes
from tally.wire.v1 import coordinator_pb2


def check_assignment(
    task: coordinator_pb2.TaskAssignment,
    config: SessionConfig,
    identity: SigningKey,
    policy: DevicePolicy,
    coordinator_key: bytes | None,
    now: float,
) -> None:
    """``TaskError`` naming the first reason to refuse the assignment."""
    try:
        policy.check(config, task.device_index, identity.public)
    except ProtocolError as exc:
        raise TaskError(str(exc)) from None
    if config.plain or coordinator_key is None:
        return
    try:
        ticket = TicketVerifier(coordinator_key).verify(task.session_ticket, now)
    except (AuthError, ValueError) as exc:
        raise TaskError(f"session ticket: {exc}") from None
    ref = config.ref
    if (ticket.job_id, ticket.round, ticket.session_id, ticket.cohort_size) != (
        ref.job_id, ref.round, ref.session_id, config.n
    ):
        raise TaskError("the session ticket names another session than the assignment's config")
    if ticket.config_digest != config_digest(session_config_bytes(config)):
        raise TaskError("the session config (and its roster) is not the one the coordinator signed")
