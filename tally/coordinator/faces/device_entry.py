"""What every process serving devices does before any job is involved: per-source rate limits,
registration (enrolment checks, the devices-table write, the token), the token and revocation
check of every later call, and a check-in's shape.

Shared by the coordinator's ``DeviceService`` and its device fronts
(``tally.coordinator.faces.device_front``), which answer registrations and idle check-ins without it.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import grpc

from tally.coordinator.faces.ratelimit import SourceRateLimiter
from tally.coordinator.metrics import DeviceMetrics
from tally.coordinator.rounds.come_back import Retry
from tally.coordinator.rounds.pacing import CheckinPacer
from tally.coordinator.state.enrolled_devices import EnrolledDevices, EnrolmentRefused
from tally.coordinator.state.events import timestamp
from tally.secagg.crypto import PUBLIC_KEY_BYTES, SIGNATURE_BYTES, verify_signature
from tally.security import AuthError, DeviceClaims, TokenIssuer, token_from_metadata
from tally.security.enrolment import (
    REGISTRATION_WINDOW_S,
    EnrolmentClaim,
    EnrolmentVerifier,
    registration_statement,
)
from tally.security.peers import source_of
from tally.security.tokens import MAX_ID_CHARS
from tally.wire.task_reports import MAX_JOB_ID_CHARS, MAX_LEDGER_ID_CHARS, MAX_LEDGER_JOBS, MAX_REPORTS
from tally.wire.v1 import coordinator_pb2

MAX_ATTESTATION_CHARS = 16 << 10
MAX_CREDENTIAL_BYTES = 1024


class DeviceEntry:
    """``limits`` maps "Register" and "CheckIn" to their per-source limiter, or to None where the
    call was limited by the process it reached first (a front forwarding it here)."""

    def __init__(
        self,
        devices: EnrolledDevices,
        issuer: TokenIssuer,
        metrics: DeviceMetrics,
        clock: Callable[[], float],
        token_ttl_s: float,
        *,
        enrolment: EnrolmentVerifier,
        coordinator_key: bytes,
        limits: dict[str, SourceRateLimiter | None],
    ) -> None:
        self.devices, self.issuer, self.metrics = devices, issuer, metrics
        self.clock, self.token_ttl_s = clock, token_ttl_s
        self.enrolment, self.coordinator_key = enrolment, coordinator_key
        self._limits = limits

    async def claims(self, context: grpc.aio.ServicerContext, rpc: str) -> DeviceClaims:
        try:
            claims = self.issuer.verify(token_from_metadata(context.invocation_metadata()), self.clock())
        except AuthError as exc:
            await context.abort(exc.code, exc.message)
            raise  # unreachable: abort raises
        if self.devices.is_revoked(claims.device_id):
            # Its token is still unexpired: revocation must not wait for it to run out.
            await self.refuse(context, rpc, "revoked", grpc.StatusCode.PERMISSION_DENIED,
                              f"device {claims.device_id!r} is revoked")
        return claims

    async def refuse(
        self, context: grpc.aio.ServicerContext, rpc: str, reason: str, code: grpc.StatusCode, message: str
    ) -> None:
        self.metrics.refusals.labels(rpc=rpc, reason=reason).inc()
        await context.abort(code, message)

    async def limit(self, rpc: str, context: grpc.aio.ServicerContext) -> None:
        limiter = self._limits[rpc]
        if limiter is not None and not limiter.allow(source_of(context.peer())):
            await self.refuse(
                context, rpc, "rate_limited", grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{rpc} rate limit: {limiter.limit.rate_per_s:g}/s per source (burst "
                f"{limiter.limit.burst:g}); retry later",
            )

    async def register(
        self, request: coordinator_pb2.RegisterRequest, context: grpc.aio.ServicerContext
    ) -> coordinator_pb2.RegisterResponse:
        await self.limit("Register", context)
        problem = _malformed_registration(request)
        if problem is not None:
            await self.refuse(context, "Register", "malformed", grpc.StatusCode.INVALID_ARGUMENT, problem)
        now = self.clock()
        if abs(request.timestamp - now) > REGISTRATION_WINDOW_S:
            await self.refuse(
                context, "Register", "stale", grpc.StatusCode.INVALID_ARGUMENT,
                f"RegisterRequest.timestamp is more than {REGISTRATION_WINDOW_S:g} s from the "
                "coordinator's clock",
            )
        try:
            self.enrolment.admit(EnrolmentClaim(
                request.device_id, request.population, request.identity_public,
                request.enrolment_credential, request.attestation,
            ))
        except AuthError as exc:
            await self.refuse(context, "Register", "not_enrolled", exc.code, exc.message)
        statement = registration_statement(
            request.device_id, request.population, request.identity_public, request.timestamp
        )
        if not verify_signature(request.identity_public, request.signature, statement):
            await self.refuse(
                context, "Register", "bad_signature", grpc.StatusCode.UNAUTHENTICATED,
                "RegisterRequest.signature does not verify with identity_public",
            )
        try:
            self.devices.enrol(request.device_id, request.population, request.identity_public,
                               request.timestamp, now)
        except EnrolmentRefused as exc:
            await self.refuse(context, "Register", exc.reason, grpc.StatusCode.PERMISSION_DENIED, exc.message)
        token = self.issuer.issue(request.device_id, request.population, self.token_ttl_s, now)
        return coordinator_pb2.RegisterResponse(
            token=token, expires_at=timestamp(now + self.token_ttl_s), coordinator_key=self.coordinator_key
        )

    async def check_in(
        self, request: coordinator_pb2.CheckInRequest, context: grpc.aio.ServicerContext
    ) -> DeviceClaims:
        """The claims of a check-in within its limits, from a device in good standing, whose
        reports and ledger are within bounds; aborts the call otherwise."""
        await self.limit("CheckIn", context)
        claims = await self.claims(context, "CheckIn")
        if len(request.reports) > MAX_REPORTS:
            await self.refuse(context, "CheckIn", "malformed", grpc.StatusCode.INVALID_ARGUMENT,
                              f"reports: at most {MAX_REPORTS} per check-in, got {len(request.reports)}")
        ledger = request.input_ledger.latest_round
        if len(ledger) > MAX_LEDGER_JOBS or any(r < 1 for r in ledger.values()):
            await self.refuse(context, "CheckIn", "malformed", grpc.StatusCode.INVALID_ARGUMENT,
                              f"input_ledger: at most {MAX_LEDGER_JOBS} jobs, each with a round >= 1")
        if len(request.input_ledger.ledger_id) > MAX_LEDGER_ID_CHARS:
            await self.refuse(context, "CheckIn", "malformed", grpc.StatusCode.INVALID_ARGUMENT,
                              f"input_ledger.ledger_id: at most {MAX_LEDGER_ID_CHARS} characters")
        spent = request.privacy_budget_spent
        if len(spent) > MAX_LEDGER_JOBS or any(not 0 < len(job) <= MAX_JOB_ID_CHARS for job in spent):
            await self.refuse(context, "CheckIn", "malformed", grpc.StatusCode.INVALID_ARGUMENT,
                              f"privacy_budget_spent: at most {MAX_LEDGER_JOBS} job ids of 1 to "
                              f"{MAX_JOB_ID_CHARS} characters")
        return claims


def retry_proto(retry: Retry) -> coordinator_pb2.RetryAfter:
    return coordinator_pb2.RetryAfter(seconds=retry.seconds, reason=retry.reason,
                                      population_idle=retry.population_idle)


def turned_away(
    retry: Retry, pacer: CheckinPacer, metrics: DeviceMetrics, now: float
) -> coordinator_pb2.CheckInResponse:
    """The answer to a check-in that gets no task: a come-back time at the pacer's next slot."""
    retry = pacer.steer(retry, now)
    metrics.checkins_retried.inc()
    metrics.retry_after.observe(retry.seconds)
    return coordinator_pb2.CheckInResponse(retry_after=retry_proto(retry))


def _malformed_registration(request: coordinator_pb2.RegisterRequest) -> str | None:
    """The first field of a RegisterRequest out of bounds, as a message naming it."""
    for field in ("device_id", "population"):
        if not 0 < len(getattr(request, field)) <= MAX_ID_CHARS:
            return f"RegisterRequest.{field}: 1..{MAX_ID_CHARS} characters"
    if len(request.attestation) > MAX_ATTESTATION_CHARS:
        return f"RegisterRequest.attestation: at most {MAX_ATTESTATION_CHARS} characters"
    if len(request.enrolment_credential) > MAX_CREDENTIAL_BYTES:
        return f"RegisterRequest.enrolment_credential: at most {MAX_CREDENTIAL_BYTES} bytes"
    if len(request.identity_public) != PUBLIC_KEY_BYTES:
        return f"RegisterRequest.identity_public: exactly {PUBLIC_KEY_BYTES} bytes"
    if len(request.signature) != SIGNATURE_BYTES:
        return f"RegisterRequest.signature: exactly {SIGNATURE_BYTES} bytes"
    if not math.isfinite(request.timestamp):
        # NaN compares false with everything: it would pass the freshness window.
        return f"RegisterRequest.timestamp: a finite number of seconds, got {request.timestamp}"
    return None
