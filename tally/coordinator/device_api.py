"""The device-facing ``tally.v1.Coordinator`` service: registration, check-in, model download,
later steps' broadcasts and round status.

``Register`` admits only provisioned devices that prove they hold the identity key they enrol
(``tally.security.enrolment``); every later call must carry the device token it issued, which
names the device and its population, all selection uses. Register and CheckIn are rate limited
per source address.
"""

from __future__ import annotations

import asyncio
import math
import re
from collections.abc import AsyncIterator, Callable

import grpc

from tally.coordinator.active_jobs import ActiveJobs
from tally.coordinator.events import job_state, round_phase, timestamp
from tally.coordinator.metrics import CoordinatorMetrics
from tally.coordinator.pacing import CheckinPacer
from tally.coordinator.planner import Retry
from tally.coordinator.ratelimit import SourceRateLimiter
from tally.coordinator.reveals import RevealOutOfPhase
from tally.coordinator.runner import CHUNK_SIZE
from tally.coordinator.store import SERVED_KINDS, EnrolmentRefused, Store
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
from tally.wire.task_reports import MAX_LEDGER_JOBS, MAX_REPORTS
from tally.wire.v1 import coordinator_pb2, coordinator_pb2_grpc

MAX_ATTESTATION_CHARS = 16 << 10
MAX_CREDENTIAL_BYTES = 1024
_DIGEST = re.compile(r"[0-9a-f]{64}")


def retry_proto(retry: Retry) -> coordinator_pb2.RetryAfter:
    return coordinator_pb2.RetryAfter(seconds=retry.seconds, reason=retry.reason,
                                      population_idle=retry.population_idle)


class DeviceService(coordinator_pb2_grpc.CoordinatorServicer):
    def __init__(
        self,
        jobs: ActiveJobs,
        store: Store,
        issuer: TokenIssuer,
        metrics: CoordinatorMetrics,
        clock: Callable[[], float],
        token_ttl_s: float,
        *,
        enrolment: EnrolmentVerifier,
        coordinator_key: bytes,
        register_limit: SourceRateLimiter,
        checkin_limit: SourceRateLimiter,
        pacer: CheckinPacer,
    ) -> None:
        self.jobs, self.store, self.issuer, self.metrics = jobs, store, issuer, metrics
        self.clock, self.token_ttl_s = clock, token_ttl_s
        self.enrolment, self.coordinator_key = enrolment, coordinator_key
        self._limits = {"Register": register_limit, "CheckIn": checkin_limit}
        self.pacer = pacer

    async def _claims(self, context: grpc.aio.ServicerContext, rpc: str) -> DeviceClaims:
        try:
            claims = self.issuer.verify(token_from_metadata(context.invocation_metadata()), self.clock())
        except AuthError as exc:
            await context.abort(exc.code, exc.message)
            raise  # unreachable: abort raises
        if self.store.is_revoked(claims.device_id):
            # Its token is still unexpired: revocation must not wait for it to run out.
            await self._refuse(context, rpc, "revoked", grpc.StatusCode.PERMISSION_DENIED,
                               f"device {claims.device_id!r} is revoked")
        return claims

    async def _refuse(
        self, context: grpc.aio.ServicerContext, rpc: str, reason: str, code: grpc.StatusCode, message: str
    ) -> None:
        self.metrics.refusals.labels(rpc=rpc, reason=reason).inc()
        await context.abort(code, message)

    async def _limit(self, rpc: str, context: grpc.aio.ServicerContext) -> None:
        if not self._limits[rpc].allow(source_of(context.peer())):
            limit = self._limits[rpc].limit
            await self._refuse(
                context, rpc, "rate_limited", grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{rpc} rate limit: {limit.rate_per_s:g}/s per source (burst {limit.burst:g}); retry later",
            )

    async def Register(self, request: coordinator_pb2.RegisterRequest, context: grpc.aio.ServicerContext):
        await self._limit("Register", context)
        problem = _malformed_registration(request)
        if problem is not None:
            await self._refuse(context, "Register", "malformed", grpc.StatusCode.INVALID_ARGUMENT, problem)
        now = self.clock()
        if abs(request.timestamp - now) > REGISTRATION_WINDOW_S:
            await self._refuse(
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
            await self._refuse(context, "Register", "not_enrolled", exc.code, exc.message)
        statement = registration_statement(
            request.device_id, request.population, request.identity_public, request.timestamp
        )
        if not verify_signature(request.identity_public, request.signature, statement):
            await self._refuse(
                context, "Register", "bad_signature", grpc.StatusCode.UNAUTHENTICATED,
                "RegisterRequest.signature does not verify with identity_public",
            )
        try:
            self.store.enrol_device(
                request.device_id, request.population, request.identity_public, request.timestamp, now
            )
        except EnrolmentRefused as exc:
            await self._refuse(context, "Register", exc.reason, grpc.StatusCode.PERMISSION_DENIED, exc.message)
        token = self.issuer.issue(request.device_id, request.population, self.token_ttl_s, now)
        return coordinator_pb2.RegisterResponse(
            token=token, expires_at=timestamp(now + self.token_ttl_s), coordinator_key=self.coordinator_key
        )

    async def CheckIn(self, request: coordinator_pb2.CheckInRequest, context: grpc.aio.ServicerContext):
        await self._limit("CheckIn", context)
        claims = await self._claims(context, "CheckIn")
        if len(request.reports) > MAX_REPORTS:
            await self._refuse(context, "CheckIn", "malformed", grpc.StatusCode.INVALID_ARGUMENT,
                               f"reports: at most {MAX_REPORTS} per check-in, got {len(request.reports)}")
        ledger = request.input_ledger.latest_round
        if len(ledger) > MAX_LEDGER_JOBS or any(r < 1 for r in ledger.values()):
            await self._refuse(context, "CheckIn", "malformed", grpc.StatusCode.INVALID_ARGUMENT,
                               f"input_ledger: at most {MAX_LEDGER_JOBS} jobs, each with a round >= 1")
        self.jobs.record_reports(claims, request.reports)
        if request.HasField("input_ledger"):
            self.jobs.record_ledger(claims, request.input_ledger)
        try:
            result = await self.jobs.check_in(claims, context.time_remaining())
        except asyncio.CancelledError:
            self.metrics.checkins.labels(outcome="cancelled").inc()
            raise
        if isinstance(result, Retry):
            result = self.pacer.steer(result, self.clock())
            self.metrics.checkins.labels(outcome="retry").inc()
            self.metrics.retry_after.observe(result.seconds)
            return coordinator_pb2.CheckInResponse(retry_after=retry_proto(result))
        self.metrics.checkins.labels(outcome="task").inc()
        return coordinator_pb2.CheckInResponse(task=result)

    async def DownloadModel(
        self, request: coordinator_pb2.DownloadModelRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[coordinator_pb2.ModelChunk]:
        claims = await self._claims(context, "DownloadModel")
        if request.offset < 0:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "offset must be >= 0")
        if request.digest and not _DIGEST.fullmatch(request.digest):
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, "digest must be 64 lowercase hex characters"
            )
        digest = request.digest
        if request.model_version.endswith(".onnx"):
            try:
                digest = self.jobs.resolve_onnx(request.model_version, claims.population)
            except LookupError as exc:
                await context.abort(grpc.StatusCode.NOT_FOUND, str(exc))
            if request.digest and request.digest != digest:
                await context.abort(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"{request.model_version} has digest {digest}, not the requested {request.digest}",
                )
        elif not digest:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                "digest required (or model_version latest.onnx / v<round>.onnx)",
            )
        blob = self.store.blob(digest, SERVED_KINDS)
        if blob is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no model with digest {digest}")
        if request.offset > blob.size:
            await context.abort(
                grpc.StatusCode.OUT_OF_RANGE, f"offset {request.offset} beyond the {blob.size} bytes"
            )
        offset = request.offset
        with open(blob.path, "rb") as f:
            f.seek(offset)
            while True:
                data = f.read(CHUNK_SIZE)
                if not data and offset < blob.size:
                    await context.abort(grpc.StatusCode.DATA_LOSS, f"model {digest} is truncated on disk")
                yield coordinator_pb2.ModelChunk(
                    offset=offset, data=data, total_size=blob.size, digest=digest
                )
                self.metrics.bytes_served.inc(len(data))
                offset += len(data)
                if offset >= blob.size:
                    return

    async def GetStep(self, request: coordinator_pb2.GetStepRequest, context: grpc.aio.ServicerContext):
        claims = await self._claims(context, "GetStep")
        runner = self.jobs.runner(request.job_id)
        if runner is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no running job {request.job_id!r}")
        try:
            answer = runner.get_step(
                claims.device_id, request.round, request.task_id, request.sum_id, self.clock()
            )
        except LookupError as exc:
            await context.abort(grpc.StatusCode.NOT_FOUND, str(exc))
        if isinstance(answer, Retry):
            return coordinator_pb2.GetStepResponse(retry_after=retry_proto(answer))
        return coordinator_pb2.GetStepResponse(step=answer)

    async def Reveal(self, request: coordinator_pb2.RevealRequest, context: grpc.aio.ServicerContext):
        """A device's payload of a reveal step, accepted only under the job's reveal opt-in."""
        claims = await self._claims(context, "Reveal")
        runner = self.jobs.runner(request.job_id)
        if runner is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no running job {request.job_id!r}")
        try:
            runner.reveal(claims.device_id, request.round, request.task_id, request.step, list(request.values))
        except PermissionError as exc:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, str(exc))
        except RevealOutOfPhase as exc:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        except LookupError as exc:
            await context.abort(grpc.StatusCode.NOT_FOUND, str(exc))
        except ValueError as exc:  # WireError too
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        return coordinator_pb2.RevealResponse()

    async def RoundStatus(
        self, request: coordinator_pb2.RoundStatusRequest, context: grpc.aio.ServicerContext
    ):
        await self._claims(context, "RoundStatus")
        record = self.store.job(request.job_id)
        if record is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no job {request.job_id!r}")
        runner = self.jobs.runner(request.job_id)
        committed = runner.committed if runner is not None else record.committed_round
        version = self.store.model_version(request.job_id, committed) if committed else None
        model = {} if version is None else {
            "model_version": f"{request.job_id}/v{version.round}", "model_digest": version.model_digest}
        if runner is None:
            return coordinator_pb2.RoundStatusResponse(
                job_state=job_state(record.state), round=record.committed_round,
                committed_round=record.committed_round, **model,
            )
        return coordinator_pb2.RoundStatusResponse(
            job_state=job_state(record.state), round=runner.round, phase=round_phase(runner.phase),
            step=runner.step, committed_round=committed,
            next_check_in_seconds=runner.next_check_in_s(self.clock()), **model,
        )


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
