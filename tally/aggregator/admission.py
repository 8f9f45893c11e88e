"""Admission of a session: an ``OpenSessionRequest`` checked against its signed ticket.

The ticket is the coordinator's word; the request is merely what arrived. So the ticket is
verified first (signature, expiry, this aggregator), then every part of the request that the
ticket binds must agree with it, then the rest of the request must be internally consistent.
Nothing here touches the network or the clock: ``now`` is passed in.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from tally.aggregator.errors import Rejected
from tally.codec import CodecError, PayloadSchema
from tally.secagg import SessionConfig
from tally.secagg.phases import DEADLINED, Phase
from tally.security import AuthError, SessionTicket, TicketVerifier, config_digest
from tally.wire.fields import WireError
from tally.wire.protocol import from_proto, session_config_bytes
from tally.wire.sums import schema_from_proto
from tally.wire.v1 import aggregator_pb2, secagg_pb2

TOKEN_DIGEST_BYTES = 32


@dataclass(frozen=True)
class SessionPlan:
    """An admitted session: everything needed to run it."""

    ticket: bytes
    config: SessionConfig
    schemas: dict[str, PayloadSchema]
    deadlines: dict[Phase, float]  # seconds per phase with a deadline of its own
    deadlines_proto: secagg_pb2.PhaseDeadlines
    grants: dict[int, bytes]  # device index -> SHA-256 of its session token
    owner_sha256: bytes  # SHA-256 of the coordinator's owner token for this session
    leader_epoch: int = 0  # of the coordinator leader that signed the ticket (``HeldSessions.fence``)

    @property
    def session_id(self) -> str:
        return self.config.ref.session_id


def admit(
    request: aggregator_pb2.OpenSessionRequest,
    verifier: TicketVerifier,
    aggregator_id: str,
    now: float,
) -> SessionPlan:
    """The plan of a valid request; ``Rejected`` naming the first problem otherwise."""
    try:
        ticket = verifier.verify(request.session_ticket, now, aggregator_id=aggregator_id)
    except AuthError as exc:
        raise Rejected.of(exc) from None
    if not request.HasField("config"):
        raise Rejected("INVALID_ARGUMENT", "OpenSessionRequest.config is missing", "malformed")
    try:
        config = from_proto(request.config)
    except WireError as exc:
        raise Rejected.of(exc) from None
    _match_ticket(ticket, config)
    if len(request.owner_token_sha256) != 32:
        raise Rejected(
            "INVALID_ARGUMENT", "OpenSessionRequest.owner_token_sha256: exactly 32 bytes", "malformed"
        )
    return SessionPlan(
        ticket=bytes(request.session_ticket),
        config=config,
        schemas=_schemas(request, config),
        deadlines=_deadlines(request, config),
        deadlines_proto=request.deadlines,
        grants=_grants(request, config),
        owner_sha256=bytes(request.owner_token_sha256),
        leader_epoch=ticket.leader_epoch,
    )


def _match_ticket(ticket: SessionTicket, config: SessionConfig) -> None:
    ref = config.ref
    pairs = [
        ("job_id", ticket.job_id, ref.job_id),
        ("round", ticket.round, ref.round),
        ("session_id", ticket.session_id, ref.session_id),
        ("sum_ids", ticket.sum_ids, tuple(s.sum_id for s in config.sums)),
        ("cohort_size", ticket.cohort_size, config.n),
    ]
    for name, signed, requested in pairs:
        if signed != requested:
            raise Rejected(
                "PERMISSION_DENIED",
                f"session ticket {name} {signed!r} does not match the request's {requested!r}",
                "ticket_mismatch",
            )
    if config_digest(session_config_bytes(config)) != ticket.config_digest:
        raise Rejected(
            "PERMISSION_DENIED",
            "session ticket config digest does not match the request's session config",
            "ticket_mismatch",
        )


def _invalid(message: str) -> Rejected:
    return Rejected("INVALID_ARGUMENT", message, "invalid_request")


def _schemas(
    request: aggregator_pb2.OpenSessionRequest, config: SessionConfig
) -> dict[str, PayloadSchema]:
    """One schema per sum, each of the sum's dimension and safe in its ring for the cohort."""
    schemas: dict[str, PayloadSchema] = {}
    for proto in request.schemas:
        try:
            sum_id, schema = schema_from_proto(proto)
        except WireError as exc:
            raise Rejected.of(exc) from None
        if sum_id in schemas:
            raise _invalid(f"two schemas for sum {sum_id!r}")
        schemas[sum_id] = schema
    wanted = [s.sum_id for s in config.sums]
    if sorted(schemas) != sorted(wanted):
        raise _invalid(f"schemas cover sums {sorted(schemas)}, the config has {sorted(wanted)}")
    for spec in config.sums:
        schema = schemas[spec.sum_id]
        if schema.dim != spec.dim:
            raise _invalid(
                f"sum {spec.sum_id!r}: schema has {schema.dim} values, the config says {spec.dim}"
            )
        try:
            schema.check_bits(config.n, spec.bits)
        except CodecError as exc:
            raise _invalid(f"sum {spec.sum_id!r}: {exc}") from None
    return schemas


def _deadlines(
    request: aggregator_pb2.OpenSessionRequest, config: SessionConfig
) -> dict[Phase, float]:
    """Seconds per phase the session runs; each must be positive and finite (no phase may wait
    forever, and none may close before a device could answer)."""
    if not request.HasField("deadlines"):
        raise _invalid("OpenSessionRequest.deadlines is missing")
    phases = [p for p in DEADLINED if p != Phase.CONSISTENCY_CHECK or config.consistency_check]
    out = {}
    for phase in phases:
        seconds = getattr(request.deadlines, phase.deadline_field)
        if not (math.isfinite(seconds) and seconds > 0):
            raise _invalid(f"PhaseDeadlines.{phase.deadline_field} must be > 0, got {seconds}")
        out[phase] = float(seconds)
    return out


def _grants(
    request: aggregator_pb2.OpenSessionRequest, config: SessionConfig
) -> dict[int, bytes]:
    grants: dict[int, bytes] = {}
    for grant in request.devices:
        if not 1 <= grant.device_index <= config.n:
            raise _invalid(f"device grant index {grant.device_index} is outside 1..{config.n}")
        if grant.device_index in grants:
            raise _invalid(f"two device grants for index {grant.device_index}")
        if len(grant.token_sha256) != TOKEN_DIGEST_BYTES:
            raise _invalid(
                f"device grant {grant.device_index}: token_sha256 must be "
                f"{TOKEN_DIGEST_BYTES} bytes"
            )
        grants[grant.device_index] = bytes(grant.token_sha256)
    if len(grants) != config.n:
        missing = sorted(set(range(1, config.n + 1)) - grants.keys())
        raise _invalid(f"no device grant for indices {missing[:10]}")
    return grants
