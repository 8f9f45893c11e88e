"""The operator-facing ``tally.v1.Admin`` service: submit, inspect, cancel and watch jobs.

Every call needs ``authorization: Bearer <admin token>``; the token is a random secret in
``<state_dir>/admin.token`` (0600), created on first start, so whoever can read the coordinator's
state directory can operate it and nobody else (devices' tokens are refused).
"""

from __future__ import annotations

import functools
import hmac
import logging
from collections.abc import AsyncIterator, Mapping
from typing import Any

import grpc
import yaml
from google.protobuf import json_format

from tally import logs
from tally.coordinator.faces.admin_token import ADMIN_TOKEN_FILE, load_or_create_admin_token  # noqa: F401 (re-exported)
from tally.coordinator.rounds.active_jobs import ActiveJobs
from tally.coordinator.rounds.cohort_risk import cohort_warnings
from tally.coordinator.spec import jobspec
from tally.coordinator.spec.evaluation_spec import schedule_of
from tally.coordinator.state.events import TERMINAL_STATES, event_to_proto, job_state, round_phase, timestamp
from tally.coordinator.state.store import JobRecord, Store
from tally.security import AuthError, token_from_metadata
from tally.wire.v1 import admin_pb2, admin_pb2_grpc, common_pb2

log = logging.getLogger(__name__)

DEFAULT_PAGE_SIZE = 50
MAX_PAGE_SIZE = 1000
MAX_SPEC_CHARS = 1 << 20
MODEL_CHUNK_BYTES = 1 << 20


def integral(value: Any) -> Any:
    """A protobuf Struct carries every number as a double; give whole numbers back as ints so
    ``rounds: 3`` validates the same whether it came as YAML or as a struct."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, Mapping):
        return {k: integral(v) for k, v in value.items()}
    if isinstance(value, list):
        return [integral(v) for v in value]
    return value


@functools.lru_cache(maxsize=256)
def rounds_of(spec_yaml: str) -> int:
    """A job's rounds in all, its evaluation-only ones counted (a stored spec was valid when
    submitted; one this coordinator no longer reads shows its training rounds)."""
    try:
        return schedule_of(jobspec.parse(spec_yaml)).total
    except ValueError:
        return int(yaml.safe_load(spec_yaml)["rounds"])


class AdminService(admin_pb2_grpc.AdminServicer):
    def __init__(self, jobs: ActiveJobs, store: Store, admin_token: str) -> None:
        self.jobs, self.store = jobs, store
        self._token = admin_token.encode()

    async def _authorize(self, context: grpc.aio.ServicerContext) -> None:
        try:
            token = token_from_metadata(context.invocation_metadata())
        except AuthError as exc:
            await context.abort(exc.code, exc.message)
        if not hmac.compare_digest(token.encode(), self._token):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "admin token invalid")

    def job_proto(self, record: JobRecord) -> admin_pb2.Job:
        runner = self.jobs.runner(record.job_id)
        out = admin_pb2.Job(
            job_id=record.job_id, name=record.name, algorithm=record.algorithm,
            state=job_state(record.state), committed_round=record.committed_round,
            round=record.committed_round, spec_yaml=record.spec_yaml, message=record.message,
            created_at=timestamp(record.created_at), updated_at=timestamp(record.updated_at),
            rounds=runner.schedule.total if runner is not None else rounds_of(record.spec_yaml),
        )
        if runner is not None:
            out.round, out.phase, out.step = runner.round, round_phase(runner.phase), runner.step
            out.selection = runner.selection_progress()
            out.algorithm_version = runner.algorithm_version
            out.model_kind, out.model_kind_version = runner.spec.model.kind, runner.requirement.model_version
            out.needs.extend(runner.requirement.needs)
            out.able_devices, out.declared_devices = self.jobs.able_devices(runner)
            out.devices_out_of_budget = len(runner.out_of_budget)
        elif record.state in ("FAILED", "CANCELLED") and record.committed_round < out.rounds:
            out.round = record.committed_round + 1  # the round it ended in, and its devices' reports
        out.attempts.extend(
            admin_pb2.RoundAttempt(attempt=a.attempt, state=a.state, started_at=timestamp(a.started_at),
                                   finished_at=timestamp(a.finished_at) if a.finished_at is not None else None,
                                   message=a.message)
            for a in self.store.rounds(record.job_id, out.round)
        )
        summary = self.store.task_report_summary(record.job_id, out.round)
        out.task_reports.extend(
            admin_pb2.TaskReportCount(outcome=outcome, reason=reason, count=count, example=example)
            for (outcome, reason), (count, example) in sorted(summary.items())
        )
        return out

    async def _record(self, job_id: str, context: grpc.aio.ServicerContext) -> JobRecord:
        record = self.store.job(job_id)
        if record is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no job {job_id!r}")
        return record

    async def SubmitJob(self, request: admin_pb2.SubmitJobRequest, context: grpc.aio.ServicerContext):
        await self._authorize(context)
        which = request.WhichOneof("spec")
        renamed: list[str] = []
        try:
            if which == "spec_yaml":
                if len(request.spec_yaml) > MAX_SPEC_CHARS:
                    raise jobspec.JobSpecError(f"spec_yaml longer than {MAX_SPEC_CHARS} characters")
                spec = jobspec.parse(request.spec_yaml, renamed)
            elif which == "spec_struct":
                spec = jobspec.from_dict(integral(json_format.MessageToDict(request.spec_struct)), renamed)
            else:
                raise jobspec.JobSpecError("spec_yaml or spec_struct is required")
        except jobspec.JobSpecError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"invalid job spec:\n{exc}")
        job_id = self.jobs.submit(spec)
        warnings = renamed + cohort_warnings(spec, len(self.jobs.pool.members))
        for warning in warnings:
            logs.event(log, "job spec warning", logging.WARNING, job_id=job_id, warning=warning)
        job = self.job_proto(await self._record(job_id, context))
        job.warnings.extend(warnings)
        return job

    async def GetJob(self, request: admin_pb2.GetJobRequest, context: grpc.aio.ServicerContext):
        await self._authorize(context)
        return self.job_proto(await self._record(request.job_id, context))

    async def ListJobs(self, request: admin_pb2.ListJobsRequest, context: grpc.aio.ServicerContext):
        await self._authorize(context)
        if request.page_size < 0:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "page_size must be >= 0")
        size = min(request.page_size or DEFAULT_PAGE_SIZE, MAX_PAGE_SIZE)
        after = 0
        if request.page_token:
            if not request.page_token.isdigit():
                await context.abort(
                    grpc.StatusCode.INVALID_ARGUMENT, "page_token is not one this service issued"
                )
            after = int(request.page_token)
        states = []
        for value in request.states:
            name = common_pb2.JobState.Name(value) if value in common_pb2.JobState.values() else ""
            if not name or value == common_pb2.JOB_STATE_UNSPECIFIED:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"unknown job state {value}")
            states.append(name.removeprefix("JOB_STATE_"))
        records = self.store.jobs(states, after_seq=after, limit=size + 1)
        page = records[:size]
        token = str(page[-1].seq) if len(records) > size else ""
        return admin_pb2.ListJobsResponse(jobs=[self.job_proto(r) for r in page], next_page_token=token)

    async def CancelJob(self, request: admin_pb2.CancelJobRequest, context: grpc.aio.ServicerContext):
        await self._authorize(context)
        try:
            await self.jobs.cancel(request.job_id, request.reason)
        except LookupError as exc:
            await context.abort(grpc.StatusCode.NOT_FOUND, str(exc))
        except ValueError as exc:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        return self.job_proto(await self._record(request.job_id, context))

    async def RevokeDevice(self, request: admin_pb2.RevokeDeviceRequest, context: grpc.aio.ServicerContext):
        await self._authorize(context)
        if not self.store.devices.revoke(request.device_id, self.jobs.clock()):
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no enrolled device {request.device_id!r}")
        self.jobs.revoked(request.device_id)
        logs.event(log, "device revoked", logging.WARNING, device_id=request.device_id)
        return admin_pb2.RevokedDevice(device_id=request.device_id)

    async def WatchJob(
        self, request: admin_pb2.WatchJobRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[admin_pb2.JobEvent]:
        await self._authorize(context)
        queue = self.jobs.events.subscribe(request.job_id)
        try:
            record = await self._record(request.job_id, context)
            current = self.job_proto(record)
            yield admin_pb2.JobEvent(
                job_id=current.job_id, round=current.round, phase=current.phase, step=current.step,
                state=current.state, message=current.message or "current state", time=current.updated_at,
            )
            if record.state in TERMINAL_STATES:
                return
            while (event := await queue.get()) is not None:
                yield event_to_proto(event)
                if event.state in TERMINAL_STATES:
                    return
        finally:
            self.jobs.events.unsubscribe(request.job_id, queue)

    async def GetModel(
        self, request: admin_pb2.GetModelRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[admin_pb2.ModelFileChunk]:
        """The ONNX export of a committed round, so an operator can take the trained model away
        (``tally job model``) without posing as a device of the job's population."""
        await self._authorize(context)
        await self._record(request.job_id, context)
        wanted = request.round if request.HasField("round") else None
        if wanted is not None and wanted < 0:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "round must be >= 0 (0: the initial model)")
        version = self.store.model_version(request.job_id, wanted)
        if version is None:
            if wanted is not None:
                await context.abort(grpc.StatusCode.NOT_FOUND,
                                    f"job {request.job_id!r} has no committed round {wanted}")
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"job {request.job_id!r} has no model yet")
        if version.onnx_digest is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"model {request.job_id}/v{version.round} has no ONNX export (its model kind "
                                "has no torch module)")
        data = self.store.read_blob(version.onnx_digest)
        for offset in range(0, max(len(data), 1), MODEL_CHUNK_BYTES):
            yield admin_pb2.ModelFileChunk(
                round=version.round, digest=version.onnx_digest, total_bytes=len(data), offset=offset,
                data=data[offset:offset + MODEL_CHUNK_BYTES],
            )

    async def GetJobMetrics(self, request: admin_pb2.GetJobMetricsRequest, context: grpc.aio.ServicerContext):
        await self._authorize(context)
        await self._record(request.job_id, context)
        committed = [r for r in self.store.rounds(request.job_id) if r.state == "committed"]
        return admin_pb2.JobMetrics(job_id=request.job_id, rounds=[
            admin_pb2.RoundMetrics(round=r.round, metrics=r.metrics,
                                   committed_at=timestamp(r.finished_at) if r.finished_at is not None else None)
            for r in sorted(committed, key=lambda r: r.round)
        ])

    async def GetRoundSums(self, request: admin_pb2.GetRoundSumsRequest, context: grpc.aio.ServicerContext):
        await self._authorize(context)
        await self._record(request.job_id, context)
        sums = self.store.committed_cohort_sums(request.job_id, request.round)
        if sums is None:
            await context.abort(grpc.StatusCode.NOT_FOUND,
                                f"job {request.job_id!r} has no committed round {request.round}")
        return admin_pb2.RoundSums(job_id=request.job_id, round=request.round, sums=[
            admin_pb2.CohortSumFingerprint(session_id=s.session_id, sum_id=s.sum_id, cohort=s.cohort, bits=s.bits,
                                           contributors=s.contributors, fingerprint=s.fingerprint)
            for s in sums
        ])
