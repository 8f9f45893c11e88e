"""The device-facing ``tally.v1.Coordinator`` service: registration, check-in, model download,
later steps' broadcasts and round status.

``Register`` admits only provisioned devices that prove they hold the identity key they enrol
(``tally.security.enrolment``); every later call must carry the device token it issued, which
names the device and its population, all selection uses. Register and CheckIn are rate limited
per source address.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator, Callable

import grpc

from tally.coordinator.faces.device_entry import DeviceEntry, retry_proto, turned_away
from tally.coordinator.metrics import CoordinatorMetrics
from tally.coordinator.rounds import declared_algorithms
from tally.coordinator.rounds.active_jobs import ActiveJobs
from tally.coordinator.rounds.come_back import Retry
from tally.coordinator.rounds.pacing import CheckinPacer
from tally.coordinator.rounds.reveals import RevealOutOfPhase
from tally.coordinator.rounds.runner import CHUNK_SIZE
from tally.coordinator.state.events import job_state, round_phase
from tally.coordinator.state.store import SERVED_KINDS, Store
from tally.wire.v1 import coordinator_pb2, coordinator_pb2_grpc

_DIGEST = re.compile(r"[0-9a-f]{64}")


class DeviceService(coordinator_pb2_grpc.CoordinatorServicer):
    def __init__(
        self,
        jobs: ActiveJobs,
        store: Store,
        entry: DeviceEntry,
        metrics: CoordinatorMetrics,
        clock: Callable[[], float],
        pacer: CheckinPacer,
    ) -> None:
        self.jobs, self.store, self.entry, self.metrics = jobs, store, entry, metrics
        self.clock, self.pacer = clock, pacer

    async def Register(self, request: coordinator_pb2.RegisterRequest, context: grpc.aio.ServicerContext):
        return await self.entry.register(request, context)

    async def CheckIn(self, request: coordinator_pb2.CheckInRequest, context: grpc.aio.ServicerContext):
        claims = await self.entry.check_in(request, context)
        declared = request.capabilities
        refused = declared_algorithms.problem(declared)
        if refused is not None:
            await self.entry.refuse(context, "CheckIn", "invalid_capabilities", grpc.StatusCode.INVALID_ARGUMENT,
                                    refused)
        installed = self.jobs.record_declared(claims, declared)
        if request.reports:
            self.jobs.record_reports(claims, request.reports)
        if request.HasField("input_ledger"):
            self.jobs.record_ledger(claims, request.input_ledger)
        if request.privacy_budget_spent:
            self.jobs.record_budget_spent(claims, request.privacy_budget_spent)
        try:
            result = await self.jobs.check_in(claims, context.time_remaining(), request.input_ledger.ledger_id,
                                              installed)
        except asyncio.CancelledError:
            self.metrics.checkins.labels(outcome="cancelled").inc()
            raise
        if self.entry.devices.is_revoked(claims.device_id):
            # Revoked while its check-in was held for a selection: no task, no come-back time.
            await self.entry.refuse(context, "CheckIn", "revoked", grpc.StatusCode.PERMISSION_DENIED,
                                    f"device {claims.device_id!r} is revoked")
        if isinstance(result, Retry):
            return turned_away(result, self.pacer, self.metrics, self.clock())
        self.metrics.checkins.labels(outcome="task").inc()
        return coordinator_pb2.CheckInResponse(task=result)

    async def DownloadModel(
        self, request: coordinator_pb2.DownloadModelRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[coordinator_pb2.ModelChunk]:
        claims = await self.entry.claims(context, "DownloadModel")
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
        claims = await self.entry.claims(context, "GetStep")
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
        claims = await self.entry.claims(context, "Reveal")
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
        await self.entry.claims(context, "RoundStatus")
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

