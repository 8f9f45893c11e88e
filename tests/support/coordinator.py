"""The coordinator under test with fake aggregators and scripted devices, over real gRPC on
127.0.0.1 (``in_process().coordinator_with_fakes`` in ``support.stack`` starts them), and the job
specs and algorithms its tests use.

The fake aggregators (``FakeAggregatorControl``) check the coordinator's session tickets and grants
and compute cohort sums the way a real one hands them back: devices encode their contributions with
the step's schema, map them into the session's ring, and the fake adds them mod 2^bits and packs the
total at the wire width. That tests everything on the coordinator's side of a sum (decoding each
cohort at its own width, adding across aggregators, applying, committing) without the
secure-aggregation protocol, which the aggregator's own tests cover; ``in_process().whole_system``
runs the whole system. The coordinator's service tests, its pacing and its Sybil tests share this.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import time
from collections import defaultdict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import numpy as np
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from support.enrolment import provisioned_request
from support.stack import PLAINTEXT, InProcess
from tally import modelio
from tally.algorithms.base import StepSpec
from tally.algorithms.fedavg import FedAvgClient, FedAvgOptions, FedAvgServer
from tally.client.input_ledger import InputLedger
from tally.codec import Field, Kind, PayloadSchema, ring_dtype, ring_mask, to_ring
from tally.coordinator.service import CoordinatorService
from tally.coordinator.spec import jobspec
from tally.coordinator.state.store import Store
from tally.evaluation import EvaluatedClient
from tally.secagg import SessionConfig, SumResult
from tally.security import (
    AuthError,
    TicketVerifier,
    TLSConfig,
    bearer_metadata,
    bind,
    channel_options,
    config_digest,
)
from tally.security.tokens import OWNER_METADATA_KEY
from tally.sim.rounds import plain_sum, run_rounds
from tally.wire.protocol import from_proto, session_config_bytes
from tally.wire.sums import cohort_sum_to_proto, schema_from_proto
from tally.wire.tensors import tensors_from_proto
from tally.wire.v1 import (
    admin_pb2,
    admin_pb2_grpc,
    aggregator_pb2,
    aggregator_pb2_grpc,
    common_pb2,
    coordinator_pb2,
    coordinator_pb2_grpc,
)

TEST_TIMEOUT = 50.0


FRAC_BITS = 20


SUCCEEDED, FAILED, CANCELLED = (
    common_pb2.JOB_STATE_SUCCEEDED, common_pb2.JOB_STATE_FAILED, common_pb2.JOB_STATE_CANCELLED,
)


def run(coro) -> Any:
    """Every service test is bounded: a hang is a failure, never a stuck CI job."""
    return asyncio.run(asyncio.wait_for(coro, TEST_TIMEOUT))


def spec_yaml(name: str, *, rounds: int = 1, cohort: int = 10, hidden: int = 8, population: str = "default",
              extra: str = "") -> str:
    return (
        f"name: {name}\nalgorithm: fedavg\nrounds: {rounds}\ncohort_size: {cohort}\nover_selection: 1.0\n"
        f"min_cohort: 5\npopulation: {population}\nmodel: {{inputs: 64, classes: 10, hidden: {hidden}}}\n"
        f"options: {{local_epochs: 1}}\n" + extra
    )


@dataclass(frozen=True)
class TwoStepState:
    params: dict[str, np.ndarray]
    mean_loss: float = 0.0
    rounds: int = 0


class TwoStepServer:
    """Sum 1: losses and counts; its mean is broadcast; sum 2: updates scaled by that mean."""

    name = "twostep"

    def __init__(self, options: Mapping[str, Any] | None) -> None:
        if options:
            raise ValueError(f"twostep takes no options, got {sorted(options)}")

    def init(self, params):
        return TwoStepState(dict(params))

    def steps(self, state):
        dim = sum(v.size for v in state.params.values())
        return [
            StepSpec("stats", PayloadSchema((Field("loss", (), clip=10.0, frac_bits=FRAC_BITS),
                                             Field("count", (), kind=Kind.COUNT, clip=100)))),
            StepSpec("update", PayloadSchema((Field("delta", (dim,), clip=1.0, frac_bits=FRAC_BITS),
                                              Field("weight", (), kind=Kind.COUNT, clip=100)))),
        ]

    def broadcast(self, state, step):
        return dict(state.params) if step == "stats" else {"mean_loss": np.float64(state.mean_loss)}

    def apply(self, state, step, total):
        if step == "stats":
            return dataclasses.replace(state, mean_loss=float(total["loss"]) / int(total["count"]))
        mean = total["delta"] / int(total["weight"])
        flat = np.concatenate([v.ravel() for v in state.params.values()]) + mean
        params, offset = {}, 0
        for k, v in state.params.items():
            params[k] = flat[offset:offset + v.size].reshape(v.shape).astype(v.dtype)
            offset += v.size
        return dataclasses.replace(state, params=params, rounds=state.rounds + 1)

    def model(self, state):
        return state.params


def planner_spec(**overrides) -> jobspec.JobSpec:
    raw = {"name": "unit", "algorithm": "fedavg", "rounds": 1, "cohort_size": 10, "min_cohort": 5}
    raw.update(overrides)
    return jobspec.from_dict(raw)


STEP = StepSpec("s", PayloadSchema((Field("x", (3,), clip=1.0, frac_bits=FRAC_BITS),
                                    Field("n", (), kind=Kind.COUNT, clip=10))))


@dataclass
class FakeSession:
    config: SessionConfig
    schemas: dict[str, PayloadSchema]
    grants: dict[int, bytes]
    ticket: bytes
    owner_sha256: bytes
    inputs: dict[str, dict[int, np.ndarray]] = field(default_factory=lambda: defaultdict(dict))
    dropped: set[int] = field(default_factory=set)
    closed: str | None = None
    changed: asyncio.Condition = field(default_factory=asyncio.Condition)


class FakeAggregatorControl(aggregator_pb2_grpc.AggregatorControlServicer):
    """Checks tickets and grants like a real aggregator; sums ring vectors in the clear."""

    def __init__(self, ident: str, verifier: TicketVerifier) -> None:
        self.ident, self.verifier = ident, verifier
        self.sessions: dict[str, FakeSession] = {}
        self.abort_reason: str | None = None  # every session aborts
        self.aborts: list[str] = []  # the next sessions abort, one reason each
        # A malicious aggregator: it unmasks the next sum it is asked for, keeps it, and reports
        # an abort instead (once).
        self.withhold_next = False
        # Every sum this aggregator computed, withheld or not: (session id, sum id, device indices).
        self.computed: list[tuple[str, str, tuple[int, ...]]] = []
        self.hang = False
        self.open_gate: asyncio.Event | None = None  # OpenSession waits for it when set
        self.close_gate: asyncio.Event | None = None  # and CloseSession for this one
        self.opened = asyncio.Event()
        self.address = ""
        self._server: grpc.aio.Server | None = None

    async def start(self, tls: TLSConfig = PLAINTEXT, host: str = "127.0.0.1") -> None:
        self._server = grpc.aio.server(options=channel_options())
        aggregator_pb2_grpc.add_AggregatorControlServicer_to_server(self, self._server)
        checker = health.aio.HealthServicer()
        await checker.set("", health_pb2.HealthCheckResponse.SERVING)
        health_pb2_grpc.add_HealthServicer_to_server(checker, self._server)
        self.address = f"{host}:{bind(self._server, '127.0.0.1:0', tls)}"
        await self._server.start()

    async def stop(self, grace: float | None = None) -> None:
        if self._server is not None:
            await self._server.stop(grace)
            self._server = None

    async def OpenSession(self, request, context):
        if self.open_gate is not None:
            await self.open_gate.wait()
        try:
            ticket = self.verifier.verify(request.session_ticket, time.time(), aggregator_id=self.ident)
        except AuthError as exc:
            await context.abort(exc.code, exc.message)
        config = from_proto(request.config)
        if ticket.config_digest != config_digest(session_config_bytes(config)):
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, "ticket does not match the config")
        grants = {g.device_index: g.token_sha256 for g in request.devices}
        assert sorted(grants) == list(range(1, config.n + 1)) and ticket.cohort_size == config.n
        schemas = dict(schema_from_proto(s) for s in request.schemas)
        assert list(schemas) == [s.sum_id for s in config.sums] == list(ticket.sum_ids)
        assert config.min_survivors >= 5  # the job's privacy floor reaches the aggregator
        assert len(request.owner_token_sha256) == 32
        self.sessions[config.ref.session_id] = FakeSession(
            config, schemas, grants, request.session_ticket, request.owner_token_sha256
        )
        self.opened.set()
        return aggregator_pb2.OpenSessionResponse(session_id=config.ref.session_id, address=self.address)

    def join(self, task: coordinator_pb2.TaskAssignment) -> FakeSession:
        ticket = self.verifier.verify(task.session_ticket, time.time(), aggregator_id=self.ident)
        session = self.sessions[ticket.session_id]
        assert hashlib.sha256(task.session_token.encode()).digest() == session.grants[task.device_index]
        assert session_config_bytes(from_proto(task.session)) == session_config_bytes(session.config)
        return session

    async def submit(self, session: FakeSession, index: int, sum_id: str, ring: np.ndarray) -> None:
        async with session.changed:
            session.inputs[sum_id][index] = ring
            session.changed.notify_all()

    @staticmethod
    async def check_owner(session: FakeSession, context) -> None:
        """Control calls must carry the owner token whose hash the session was opened with."""
        token = dict(context.invocation_metadata()).get(OWNER_METADATA_KEY, b"")
        if hashlib.sha256(token).digest() != session.owner_sha256:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, "not the session's owner")

    async def AwaitResult(self, request, context):
        session = self.sessions.get(request.session_id)
        if session is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, "no such session")
        await self.check_owner(session, context)
        spec = session.config.sum_spec(request.sum_id)
        reason = self.abort_reason or (self.aborts.pop(0) if self.aborts else None)
        if reason:
            return aggregator_pb2.CohortSum(session_id=request.session_id, sum_id=spec.sum_id, aborted_reason=reason)
        if self.hang:
            await asyncio.Event().wait()
        inputs = session.inputs[spec.sum_id]
        async with session.changed:
            await session.changed.wait_for(
                lambda: session.closed or len(inputs) + len(session.dropped) >= session.config.n
            )
        if session.closed:
            return aggregator_pb2.CohortSum(session_id=request.session_id, sum_id=spec.sum_id,
                                            aborted_reason=f"closed: {session.closed}")
        total = np.zeros(spec.dim, dtype=np.uint64)
        for ring in inputs.values():
            total += ring.astype(np.uint64)  # uint64 wraps: the sum mod 2^64, then mod 2^bits
        total = (total & np.uint64(ring_mask(spec.bits))).astype(ring_dtype(spec.bits))
        result = SumResult(spec.sum_id, total, tuple(sorted(inputs)), tuple(sorted(session.dropped)))
        self.computed.append((request.session_id, spec.sum_id, result.contributors))
        if self.withhold_next:
            self.withhold_next = False
            return aggregator_pb2.CohortSum(session_id=request.session_id, sum_id=spec.sum_id,
                                            aborted_reason=f"{spec.sum_id}: too few survivors (a lie)")
        return cohort_sum_to_proto(request.session_id, spec, result)

    async def CloseSession(self, request, context):
        if not request.session_id:  # the coordinator's health check, as the real aggregator answers it
            return aggregator_pb2.CloseSessionResponse()
        if self.close_gate is not None:
            await self.close_gate.wait()
        session = self.sessions.get(request.session_id)
        if session is not None:
            await self.check_owner(session, context)
            async with session.changed:
                session.closed = request.reason or "closed"
                session.changed.notify_all()
        return aggregator_pb2.CloseSessionResponse()


class FixedTrainer:
    """A device whose local training moves every parameter by a fixed device-specific amount, so
    the service path and the in-process reference see identical contributions."""

    def __init__(self, seed: int, examples: int) -> None:
        self.seed, self.examples = seed, examples

    @property
    def num_examples(self) -> int:
        return self.examples

    def train(self, params, epochs, lr, batch_size):
        rng = np.random.default_rng(self.seed)
        return {k: (v + rng.uniform(-0.05, 0.05, v.shape)).astype(v.dtype) for k, v in params.items()}, 0.0

    def evaluate(self, params):
        return 0.0, 0.0


Contribute = Callable[["FakeDevice", str, Mapping[str, np.ndarray]], dict[str, Any]]


class FakeDevice:
    """A device that speaks the device API itself rather than through the SDK (``tally.client.Device``):
    the test scripts every call, including the ones a real device would never make."""

    def __init__(self, stack: CoordinatorStack, device_id: str, trainer: FixedTrainer | None = None,
                 population: str = "default"):
        self.stack, self.device_id, self.trainer, self.population = stack, device_id, trainer, population
        self.stub = stack.device_stub
        self.token = ""
        self.reports: list[coordinator_pb2.TaskReport] = []  # go out with the next check-in
        # The SDK's durable input ledger, when the test gives the device one: stated at each
        # check-in, written before an input leaves.
        self.ledger: InputLedger | None = None
        self.rng = np.random.default_rng(abs(hash(device_id)) % 2**32)

    @property
    def md(self):
        return bearer_metadata(self.token)

    async def register(self) -> FakeDevice:
        reply = await self.stub.Register(
            provisioned_request(self.stack.service, self.device_id, self.population), timeout=5
        )
        self.token = reply.token
        return self

    async def check_in_once(self, timeout: float = 5.0) -> coordinator_pb2.CheckInResponse:
        return await self.stub.CheckIn(coordinator_pb2.CheckInRequest(), metadata=self.md, timeout=timeout)

    async def _pause(self, seconds: float, done: asyncio.Event | None) -> None:
        """Honour retry_after, shortened: the tests' rounds are milliseconds long."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for((done or asyncio.Event()).wait(), timeout=min(seconds, 0.05))

    async def task(self, done: asyncio.Event | None = None) -> coordinator_pb2.TaskAssignment | None:
        while done is None or not done.is_set():
            try:
                statement = self.ledger.statement() if self.ledger is not None else None
                reply = await self.stub.CheckIn(
                    coordinator_pb2.CheckInRequest(reports=self.reports, input_ledger=statement),
                    metadata=self.md, timeout=30)
            except grpc.aio.AioRpcError as exc:  # the coordinator restarting
                assert exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED), exc
                await self._pause(0.05, done)
                continue
            self.reports = []
            if reply.HasField("task"):
                return reply.task
            await self._pause(reply.retry_after.seconds, done)
        return None

    async def download(self, digest: str = "", version: str = "", offset: int = 0) -> tuple[bytes, list]:
        request = coordinator_pb2.DownloadModelRequest(model_version=version, digest=digest, offset=offset)
        chunks = [c async for c in self.stub.DownloadModel(request, metadata=self.md, timeout=30)]
        return b"".join(c.data for c in chunks), chunks

    async def step(self, task, sum_id: str) -> coordinator_pb2.Step | None:
        while True:
            try:
                reply = await self.stub.GetStep(
                    coordinator_pb2.GetStepRequest(
                        job_id=task.job_id, round=task.round, task_id=task.task_id, sum_id=sum_id
                    ),
                    metadata=self.md, timeout=10,
                )
            except grpc.aio.AioRpcError as exc:
                if exc.code() in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.UNAVAILABLE):
                    return None  # the attempt is gone (retried) or the coordinator restarting
                raise
            if reply.HasField("step"):
                return reply.step
            await self._pause(reply.retry_after.seconds, None)

    async def send(self, task, step: coordinator_pb2.Step, values: Mapping[str, Any]) -> None:
        """Encode ``values`` with the step's schema into the session's ring, as a device does, and
        hand them to the cohort's (fake) aggregator."""
        aggregator = self.stack.aggregator_at(task.aggregator_address)
        session = aggregator.join(task)
        bits = next(s.bits for s in task.session.sums if s.sum_id == step.sum_id)
        _, schema = schema_from_proto(step.schema)
        ring = to_ring(schema.encode(values, self.rng).vector, bits)
        if self.ledger is not None:
            self.ledger.sent(task.job_id, task.round)
        await aggregator.submit(session, task.device_index, step.sum_id, ring)

    async def participate(self, task, contribute: Contribute) -> bool:
        for k, spec in enumerate(task.session.sums):
            if k == 0:
                step = task.step
                blob, _ = await self.download(task.model_digest)
                assert len(blob) == task.model_size
                broadcast = modelio.deserialize(blob)
            else:
                step = await self.step(task, spec.sum_id)
                if step is None:
                    return False
                broadcast = tensors_from_proto(step.broadcast)
            await self.send(task, step, contribute(self, step.name, broadcast))
        return True

    async def loop(self, contribute: Contribute, done: asyncio.Event, before=None) -> None:
        while (task := await self.task(done)) is not None:
            if before is not None:
                await before(self, task)
            await self.participate(task, contribute)


def fedavg_contribution(options: FedAvgOptions) -> Contribute:
    client = EvaluatedClient(FedAvgClient(options))  # as a device runs it: the job's evaluation around it
    return lambda device, step, broadcast: client.contribute(step, broadcast, device.trainer, None)[0]


@dataclass
class CoordinatorStack:
    """A real coordinator and fake aggregators (unlike ``support.stack.Stack``, the whole system):
    the devices are scripted (``FakeDevice``), so a test controls every call the coordinator sees."""

    services: InProcess
    service: CoordinatorService
    aggregators: list[FakeAggregatorControl]
    channel: grpc.aio.Channel

    @property
    def state_dir(self) -> Path:
        return self.service.state_dir

    @property
    def device_stub(self) -> coordinator_pb2_grpc.CoordinatorStub:
        return coordinator_pb2_grpc.CoordinatorStub(self.channel)

    @property
    def admin(self) -> admin_pb2_grpc.AdminStub:
        return admin_pb2_grpc.AdminStub(self.channel)

    @property
    def admin_md(self):
        return bearer_metadata(self.service.admin_token)

    def aggregator_at(self, address: str) -> FakeAggregatorControl:
        return next(a for a in self.aggregators if a.address == address)

    async def devices(
        self, n: int, *, trainers: bool = True, prefix: str = "dev", population: str = "default"
    ) -> list[FakeDevice]:
        devices = [
            FakeDevice(self, f"{prefix}{i}", FixedTrainer(i, 40 + 10 * i) if trainers else None, population)
            for i in range(n)
        ]
        return list(await asyncio.gather(*(d.register() for d in devices)))

    async def submit(self, text: str) -> str:
        job = await self.admin.SubmitJob(admin_pb2.SubmitJobRequest(spec_yaml=text), metadata=self.admin_md, timeout=5)
        return job.job_id

    async def job(self, job_id: str) -> admin_pb2.Job:
        return await self.admin.GetJob(admin_pb2.GetJobRequest(job_id=job_id), metadata=self.admin_md, timeout=5)

    async def until_done(self, job_id: str) -> list[admin_pb2.JobEvent]:
        """Every event of the job until it ends (WatchJob ends the stream itself)."""
        stream = self.admin.WatchJob(admin_pb2.WatchJobRequest(job_id=job_id), metadata=self.admin_md)
        return [event async for event in stream]

    async def restart(self) -> None:
        """Stop the coordinator and start a new one on the same port and state directory."""
        self.service = await self.services.restart(self.service)


async def run_devices(devices: list[FakeDevice], contribute: Contribute, until, before=None) -> Any:
    """Run the devices' loops while ``until`` (a coroutine) runs; its result."""
    done = asyncio.Event()
    loops = [asyncio.create_task(d.loop(contribute, done, before)) for d in devices]
    try:
        return await until
    finally:
        done.set()
        await asyncio.gather(*loops, return_exceptions=True)


def reference_model(initial: dict, trainers: list[FixedTrainer], rounds: int, options: FedAvgOptions) -> dict:
    """The in-process result (tally.sim.rounds with an exact sum) for the same devices."""
    state, _ = run_rounds(FedAvgServer(options), FedAvgClient(options), trainers, initial, rounds,
                          len(trainers), plain_sum)
    return state.params


def fedavg_bound(trainers: list[FixedTrainer], options: FedAvgOptions, rounds: int, max_delta: float) -> float:
    """Quantisation bound on the FedAvg model after ``rounds``: each round the summed update and
    weight are each off by less than n 2^-frac_bits, so the mean update is off by at most
    (n 2^-f + |mean| n 2^-f) / (sum of weights - n 2^-f)."""
    n = len(trainers)
    unit = n * 2.0 ** -options.frac_bits
    weight = sum(min(t.examples, options.example_cap) / options.example_cap for t in trainers)
    return rounds * (unit + max_delta * unit) / (weight - unit) + 1e-6  # + float32 rounding


def committed_model(store: Store, job_id: str) -> tuple[dict, list]:
    """The job's latest model and its round attempts, from the running coordinator's store."""
    version = store.model_version(job_id)
    return modelio.deserialize(store.read_blob(version.model_digest)), store.rounds(job_id)
