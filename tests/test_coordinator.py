"""The coordinator: its round planner as pure decisions, then the service over real gRPC on
127.0.0.1 with fake aggregators and scripted devices.

The fake aggregators check the coordinator's session tickets and grants and compute cohort sums
the way a real one hands them back: devices encode their contributions with the step's schema,
map them into the session's ring, and the fake adds them mod 2^bits and packs the total at the
wire width. That tests everything on the coordinator's side of a sum (decoding each cohort at its
own width, adding across aggregators, applying, committing) without the secure-aggregation
protocol, which the aggregator's own tests cover; the full stack is tested elsewhere.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import hashlib
import stat
import time
import urllib.request
from collections import defaultdict
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import onnxruntime as ort
import pytest
import torch
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from support.enrolment import provisioned_request
from tally.cli import coordinator as coordinator_cli
from coordinator import catalogue, jobspec
from coordinator.runner import RETRY_BACKOFF_FIRST_S
from coordinator.aggregators import aio_channel, parse_aggregator
from coordinator.planner import (
    CohortRejected,
    Deliver,
    Extended,
    Failed,
    FormCohorts,
    MIN_RETRY_S,
    Hold,
    NoCapacity,
    Phase,
    Retry,
    RoundPlanner,
    StepSums,
    WaitingRoom,
    split_cohorts,
)
from coordinator.active_jobs import ActiveJobs
from coordinator.metrics import CoordinatorMetrics
from coordinator.service import CoordinatorService
from coordinator.state_codec import UnsupportedState, state_from_bytes, state_to_bytes
from coordinator.store import EnrolmentRefused, Store
from tally import modelio
from tally.algorithms.base import StepSpec
from tally.algorithms.fedavg import FedAvgClient, FedAvgConfig, FedAvgServer, FedAvgState
from tally.codec import Field, Kind, PayloadSchema, ring_dtype, ring_mask, to_ring
from tally.secagg import SessionConfig, SumResult
from tally.security import certs
from tally.security import (
    AuthError,
    DeviceClaims,
    TicketVerifier,
    TLSConfig,
    bearer_metadata,
    bind,
    channel_credentials,
    channel_options,
    config_digest,
    load_or_create_ticket_key,
)
from tally.security.tls import tls_config_from_args
from tally.security.tokens import OWNER_METADATA_KEY
from tally.sim.rounds import plain_sum, run_rounds
from tally.models.mlp import mlp
from tally.models.params import get_params, set_params
from tally.wire.convert import (
    cohort_sum_to_proto,
    from_proto,
    schema_from_proto,
    session_config_bytes,
    tensors_from_proto,
)
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
        f"config: {{local_epochs: 1}}\n" + extra
    )


# -- a two-step algorithm: the second sum's broadcast depends on the first sum ---------------------


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


@pytest.fixture
def twostep():
    catalogue.register_algorithm("twostep", TwoStepServer)
    yield
    catalogue.unregister_algorithm("twostep")


# -- unit tests of the planner -------------------------------------------------------------------


def _spec(**overrides) -> jobspec.JobSpec:
    raw = {"name": "unit", "algorithm": "fedavg", "rounds": 1, "cohort_size": 10, "min_cohort": 5}
    raw.update(overrides)
    return jobspec.from_dict(raw)


STEP = StepSpec("s", PayloadSchema((Field("x", (3,), clip=1.0, frac_bits=FRAC_BITS),
                                    Field("n", (), kind=Kind.COUNT, clip=10))))


def _planner(spec=None, steps=(STEP,), extensions=0, now=0.0) -> RoundPlanner:
    return RoundPlanner(spec or _spec(), list(steps), now, extensions=extensions, attempt_key="k")


def test_selection_takes_the_over_selected_target_then_turns_devices_away():
    planner = _planner(_spec(cohort_size=10, over_selection=1.3))
    assert planner.spec.selection_target == 13
    assert all(isinstance(planner.check_in(f"d{i}", 0.1), Hold) for i in range(13))
    late = planner.check_in("late", 0.2)
    assert isinstance(late, Retry) and late.reason == "cohort full" and 0.2 <= late.seconds <= 60
    decision = planner.tick(0.3)  # full before the deadline: no need to wait
    assert isinstance(decision, FormCohorts) and len(decision.devices) == 13


def test_waiting_room_holds_one_selection_in_arrival_order_and_lets_leavers_go():
    room = WaitingRoom(3)
    assert [room.offer(d) for d in ["a", "b", "a", "c", "d"]] == [True, True, True, True, False]
    room.withdraw("b")
    room.withdraw("never-held")
    assert room.offer("d") and not room.offer("e")
    assert list(room.held) == ["a", "c", "d"]


def test_selection_deadline_extends_with_the_retry_budget_then_fails():
    planner = _planner(extensions=1)
    for i in range(3):
        planner.check_in(f"d{i}", 0.0)
    assert planner.tick(1.0) is None  # window (30 s) still open
    extended = planner.tick(30.0)
    assert isinstance(extended, Extended) and "only 3 of the 5" in extended.reason
    failed = planner.tick(60.0)
    assert isinstance(failed, Failed) and planner.phase is Phase.FAILED
    assert planner.selection.extensions_used == 1

    enough = _planner()
    for i in range(6):
        enough.check_in(f"d{i}", 0.0)
    enough.withdraw("d5")  # a held check-in that gave up frees its seat
    decision = enough.tick(30.0)
    assert isinstance(decision, FormCohorts) and decision.devices == tuple(f"d{i}" for i in range(5))


def test_cohort_split_is_balanced_and_respects_the_bounds():
    devices = [f"d{i}" for i in range(23)]
    plans = split_cohorts(devices, ["a", "b", "c"], min_cohort=5, max_cohort=100)
    assert [len(p.devices) for p in plans] == [8, 8, 7] and [p.aggregator_id for p in plans] == ["a", "b", "c"]
    assert sorted(d for p in plans for d in p.devices) == sorted(devices)
    # Too few devices for one cohort per aggregator: fewer, larger cohorts, never below the floor.
    assert [len(p.devices) for p in split_cohorts(devices[:12], ["a", "b", "c"], 5, 100)] == [6, 6]
    # The per-aggregator maximum forces several cohorts onto one aggregator.
    plans = split_cohorts(devices, ["a"], 5, 8)
    assert [len(p.devices) for p in plans] == [8, 8, 7] and {p.aggregator_id for p in plans} == {"a"}
    # min = max = 10 cannot place 15 devices: 5 are left out rather than breaking a bound.
    assert [len(p.devices) for p in split_cohorts(devices[:15], ["a", "b"], 10, 10)] == [10]
    with pytest.raises(NoCapacity):
        split_cohorts(devices, [], 5, 100)
    with pytest.raises(NoCapacity):
        split_cohorts(devices[:4], ["a"], 5, 100)


def _ring_sum(schema: PayloadSchema, contributions: list[dict], bits: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    total = np.zeros(schema.dim, dtype=np.uint64)
    for c in contributions:
        total += to_ring(schema.encode(c, rng).vector, bits).astype(np.uint64)
    return (total & np.uint64(ring_mask(bits))).astype(ring_dtype(bits))


def test_cohort_sums_are_decoded_at_their_own_width_and_added():
    rng = np.random.default_rng(1)
    contributions = [{"x": rng.uniform(-1, 1, 3), "n": np.int64(i)} for i in range(11)]
    sums = StepSums(STEP, cohorts=2, min_contributors=5)
    # Two cohorts of different sizes have different ring widths.
    sums.add(0, SumResult("s", _ring_sum(STEP.schema, contributions[:5], 24, 0), tuple(range(1, 6)), ()), 24)
    assert not sums.complete
    sums.add(1, SumResult("s", _ring_sum(STEP.schema, contributions[5:], 30, 1), tuple(range(1, 7)), (7,)), 30)
    total = sums.total()
    exact = sum(c["x"] for c in contributions)
    assert np.abs(total["x"] - exact).max() <= STEP.schema.quantisation_bound(11)["x"]
    assert int(total["n"]) == sum(range(11)) and (sums.contributors, sums.dropped) == (11, 1)
    with pytest.raises(CohortRejected, match="already delivered"):
        sums.add(0, SumResult("s", _ring_sum(STEP.schema, contributions[:5], 24, 0), tuple(range(1, 6)), ()), 24)


def _formed(spec=None, steps=(STEP,), devices=10) -> RoundPlanner:
    planner = _planner(spec, steps)
    for i in range(devices):
        planner.check_in(f"d{i}", 0.0)
    assert isinstance(planner.tick(30.0), FormCohorts)
    planner.form(["a", "b"], 30.0)
    planner.opened()
    return planner


def test_privacy_floor_refuses_a_small_cohort_sum_and_discards_the_attempt():
    planner = _formed()
    contributions = [{"x": np.zeros(3), "n": np.int64(1)}] * 5
    full = SumResult("s", _ring_sum(STEP.schema, contributions, 24, 0), (1, 2, 3, 4, 5), ())
    assert planner.cohort_sum(0, full, 24) is None
    small = SumResult("s", _ring_sum(STEP.schema, contributions[:4], 24, 0), (1, 2, 3, 4), (5,))
    with pytest.raises(CohortRejected, match="privacy floor of 5"):
        planner.cohort_sum(1, small, 24)
    # The whole attempt is gone, including cohort 0's accepted sum: nothing partial is applied.
    assert planner.phase is Phase.FAILED and planner.sums is None and "privacy floor" in planner.failure


def test_later_steps_wait_for_every_cohort_and_tasks_belong_to_their_device():
    steps = (STEP, StepSpec("t", STEP.schema))
    planner = _formed(steps=steps)
    seat = planner.seats["d0"]
    assert isinstance(planner.check_in("d0", 31.0), Deliver)
    again = planner.check_in("d0", 31.0)
    assert isinstance(again, Retry) and again.reason == "already assigned"
    assert planner.step_request("d0", seat.task_id, "s", 31.0) == 0
    waiting = planner.step_request("d0", seat.task_id, "t", 31.0)
    assert isinstance(waiting, Retry) and "'s' of every cohort" in waiting.reason
    with pytest.raises(LookupError):
        planner.step_request("d1", seat.task_id, "t", 31.0)  # someone else's task
    with pytest.raises(LookupError):
        planner.step_request("d0", seat.task_id, "nope", 31.0)
    contributions = [{"x": np.zeros(3), "n": np.int64(1)}] * 5
    for cohort in (0, 1):
        result = SumResult("s", _ring_sum(STEP.schema, contributions, 24, 0), (1, 2, 3, 4, 5), ())
        total = planner.cohort_sum(cohort, result, 24)
    assert int(total["n"]) == 10
    assert planner.step_applied() is True
    assert planner.step_request("d0", seat.task_id, "t", 31.0) == 1


def test_state_codec_round_trips_fedavg_state_without_pickle():
    params = get_params(mlp(64, 10, 8))
    state = FedAvgState(params, round=7)
    data = state_to_bytes(state)
    assert b"pickle" not in data and data.startswith(b"TALLYS2\n")
    back = state_from_bytes(data, FedAvgServer().init(get_params(mlp(64, 10, 8, seed=3))))
    assert back.round == 7 and list(back.params) == list(params)
    assert all(np.array_equal(back.params[k], params[k]) and back.params[k].dtype == params[k].dtype for k in params)
    two = TwoStepState(params, mean_loss=0.25, rounds=2)
    assert state_from_bytes(state_to_bytes(two), TwoStepState({})).mean_loss == 0.25

    @dataclass(frozen=True)
    class Odd:
        history: set

    with pytest.raises(UnsupportedState):
        state_to_bytes(Odd({1, 2}))


class CommitSpy:
    """A store connection that notes the synchronous level of every COMMIT (the methods of
    sqlite3.Connection cannot be patched, so the connection is wrapped)."""

    def __init__(self, db) -> None:
        self.db, self.levels = db, []

    def __getattr__(self, name: str):
        return getattr(self.db, name)

    def execute(self, sql: str, *args):
        if sql == "COMMIT":
            self.levels.append(self.db.execute("PRAGMA synchronous").fetchone()[0])
        return self.db.execute(sql, *args)


def test_per_device_records_skip_the_fsync_but_survive_a_reopen_and_roll_back(tmp_path, monkeypatch):
    """Registrations and task reports are committed without an fsync (one each held the event
    loop ~5 ms per device); they are still committed, a refused one still rolls back, and the
    connection is back at synchronous=FULL for the records that must be on disk (seats)."""
    store = Store(tmp_path)
    spy = CommitSpy(store._db)
    monkeypatch.setattr(store, "_db", spy)
    store.enrol_device("dev-1", "pop", b"k" * 32, 1.0, 1.0)
    store.count_task_report("job", 1, "completed", "")
    store.add_seated("job", 1, [("dev-1", "t1"), ("dev-2", "t2")])
    assert spy.levels == [1, 1, 2]  # NORMAL, NORMAL, FULL: one transaction for all seats
    with pytest.raises(EnrolmentRefused):
        store.enrol_device("dev-1", "pop", b"x" * 32, 2.0, 2.0)  # the id is bound to another key
    assert spy.db.execute("PRAGMA synchronous").fetchone()[0] == 2
    monkeypatch.undo()
    store.close()
    reopened = Store(tmp_path)
    assert reopened.device_identities(["dev-1"]) == {"dev-1": b"k" * 32}
    assert reopened.task_report_counts("job", 1) == {("completed", ""): 1}
    assert reopened.seated("job", 1) == frozenset({"dev-1", "dev-2"})
    reopened.close()


def test_state_directory_has_one_owner_and_aggregator_flags_are_checked(tmp_path):
    store = Store(tmp_path)
    with pytest.raises(RuntimeError, match="in use by another coordinator"):
        Store(tmp_path)
    store.close()
    Store(tmp_path).close()  # released on close
    assert parse_aggregator("a1=127.0.0.1:7000") == ("a1", "127.0.0.1:7000")
    for bad in ("127.0.0.1:7000", "a1=", "=h:1", "a1=host"):
        with pytest.raises(ValueError):
            parse_aggregator(bad)
    with pytest.raises(ValueError, match="loopback only"):
        aio_channel("10.1.2.3:7000", TLSConfig.plaintext(), channel_options())


def test_job_spec_lists_every_problem_and_knows_registered_algorithms(twostep):
    with pytest.raises(jobspec.JobSpecError) as err:
        jobspec.parse("name: 'a b'\nalgorithm: nope\nrounds: 0\ncohort_size: 10\nmin_cohort: 3\n"
                      "deadlines: {unmask: -1}\nmodel: {hidden: 0}\n")
    lines = str(err.value).splitlines()
    for needle in ("name:", "algorithm:", "rounds:", "deadlines.unmask", "model.hidden", "min_cohort: 3 is too small"):
        assert any(needle in line for line in lines), (needle, lines)
    assert jobspec.parse("name: t\nalgorithm: twostep\nrounds: 1\ncohort_size: 10\n").algorithm == "twostep"
    with pytest.raises(jobspec.JobSpecError, match="twostep takes no options"):
        jobspec.parse("name: t\nalgorithm: twostep\nrounds: 1\ncohort_size: 10\nconfig: {x: 1}\n")


# -- fake aggregators ----------------------------------------------------------------------------


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

    async def start(self, tls: TLSConfig = TLSConfig.plaintext(), host: str = "127.0.0.1") -> None:
        self._server = grpc.aio.server(options=channel_options())
        aggregator_pb2_grpc.add_AggregatorControlServicer_to_server(self, self._server)
        checker = health.aio.HealthServicer()
        await checker.set("", health_pb2.HealthCheckResponse.SERVING)
        health_pb2_grpc.add_HealthServicer_to_server(checker, self._server)
        self.address = f"{host}:{bind(self._server, '127.0.0.1:0', tls)}"
        await self._server.start()

    async def stop(self) -> None:
        if self._server is not None:
            await self._server.stop(None)
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
        if self.close_gate is not None:
            await self.close_gate.wait()
        session = self.sessions.get(request.session_id)
        if session is not None:
            await self.check_owner(session, context)
            async with session.changed:
                session.closed = request.reason or "closed"
                session.changed.notify_all()
        return aggregator_pb2.CloseSessionResponse()


# -- scripted devices ----------------------------------------------------------------------------


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


Contribute = Callable[["Device", str, Mapping[str, np.ndarray]], dict[str, Any]]


class Device:
    def __init__(self, stack: Stack, device_id: str, trainer: FixedTrainer | None = None, population: str = "default"):
        self.stack, self.device_id, self.trainer, self.population = stack, device_id, trainer, population
        self.stub = stack.device_stub
        self.token = ""
        self.reports: list[coordinator_pb2.TaskReport] = []  # go out with the next check-in
        self.rng = np.random.default_rng(abs(hash(device_id)) % 2**32)

    @property
    def md(self):
        return bearer_metadata(self.token)

    async def register(self) -> Device:
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
                reply = await self.stub.CheckIn(coordinator_pb2.CheckInRequest(reports=self.reports),
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


def fedavg_contribution(config: FedAvgConfig) -> Contribute:
    client = FedAvgClient(config)
    return lambda device, step, broadcast: client.contribute(step, broadcast, device.trainer, None)[0]


# -- the stack -----------------------------------------------------------------------------------


@dataclass
class Stack:
    service: CoordinatorService
    aggregators: list[FakeAggregatorControl]
    channel: grpc.aio.Channel
    state_dir: Path

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
    ) -> list[Device]:
        devices = [
            Device(self, f"{prefix}{i}", FixedTrainer(i, 40 + 10 * i) if trainers else None, population)
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
        port = self.service.port
        aggregators = self.service.aggregators
        await self.service.stop(grace=0)
        self.service = CoordinatorService(f"127.0.0.1:{port}", TLSConfig.plaintext(), self.state_dir, aggregators)
        await self.service.start()


@contextlib.asynccontextmanager
async def stack(tmp_path: Path, aggregators: int = 2, **service_args) -> AsyncIterator[Stack]:
    state_dir = tmp_path / "state"
    verifier = TicketVerifier(load_or_create_ticket_key(state_dir).public_key())
    fakes = [FakeAggregatorControl(f"agg{i}", verifier) for i in range(aggregators)]
    for fake in fakes:
        await fake.start()
    service = CoordinatorService(
        "127.0.0.1:0", TLSConfig.plaintext(), state_dir, [(a.ident, a.address) for a in fakes], **service_args
    )
    port = await service.start()
    channel = grpc.aio.insecure_channel(
        f"127.0.0.1:{port}",
        options=channel_options() + [("grpc.initial_reconnect_backoff_ms", 50), ("grpc.max_reconnect_backoff_ms", 200)],
    )
    s = Stack(service, fakes, channel, state_dir)
    try:
        yield s
    finally:
        await channel.close()
        await s.service.stop(grace=0)
        for fake in fakes:
            await fake.stop()


async def run_devices(devices: list[Device], contribute: Contribute, until, before=None) -> Any:
    """Run the devices' loops while ``until`` (a coroutine) runs; its result."""
    done = asyncio.Event()
    loops = [asyncio.create_task(d.loop(contribute, done, before)) for d in devices]
    try:
        return await until
    finally:
        done.set()
        await asyncio.gather(*loops, return_exceptions=True)


def reference_model(initial: dict, trainers: list[FixedTrainer], rounds: int, config: FedAvgConfig) -> dict:
    """The in-process result (tally.sim.rounds with an exact sum) for the same devices."""
    state, _ = run_rounds(FedAvgServer(config), FedAvgClient(config), trainers, initial, rounds,
                          len(trainers), plain_sum)
    return state.params


def fedavg_bound(trainers: list[FixedTrainer], config: FedAvgConfig, rounds: int, max_delta: float) -> float:
    """Quantisation bound on the FedAvg model after ``rounds``: each round the summed update and
    weight are each off by less than n 2^-frac_bits, so the mean update is off by at most
    (n 2^-f + |mean| n 2^-f) / (sum of weights - n 2^-f)."""
    n = len(trainers)
    unit = n * 2.0 ** -config.frac_bits
    weight = sum(min(t.examples, config.example_cap) / config.example_cap for t in trainers)
    return rounds * (unit + max_delta * unit) / (weight - unit) + 1e-6  # + float32 rounding


def committed_model(store: Store, job_id: str) -> tuple[dict, list]:
    """The job's latest model and its round attempts, from the running coordinator's store."""
    version = store.model_version(job_id)
    return modelio.deserialize(store.read_blob(version.model_digest)), store.rounds(job_id)


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
        return reply.read().decode()


# -- service tests -------------------------------------------------------------------------------


def test_fedavg_over_two_aggregators_matches_the_in_process_reference(tmp_path):
    config = FedAvgConfig(local_epochs=1)
    rounds = 3

    async def main():
        async with stack(tmp_path, aggregators=2) as s:
            devices = await s.devices(10)
            job_id = await s.submit(spec_yaml("fidelity", rounds=rounds))
            watch = asyncio.create_task(s.until_done(job_id))
            seen: dict[str, Any] = {}
            first_round = asyncio.Event()

            async def before(device, task):
                # Round 1: every device holds its task until the late-comers were turned away.
                if task.round == 1 and not first_round.is_set():
                    seen[device.device_id] = task
                    if len(seen) == len(devices):
                        late = (await s.devices(1, prefix="late"))[0]
                        # Held for round 2 while round 1 aggregates, until its hold ends.
                        seen["late"] = await late.check_in_once(timeout=1.5)
                        seen["again"] = await device.check_in_once()
                        first_round.set()
                    await first_round.wait()

            events = await run_devices(devices, fedavg_contribution(config), watch, before)
            final_job = await s.job(job_id)
            metrics = scrape(s.service.metrics_port)
            status = await devices[0].stub.RoundStatus(
                coordinator_pb2.RoundStatusRequest(job_id=job_id), metadata=devices[0].md, timeout=5
            )
            model, round_rows = committed_model(s.service.store, job_id)
        return events, seen, final_job, metrics, status, model, round_rows

    events, seen, final_job, metrics, status, model, round_rows = run(main())
    # Over-selection target reached: nobody else gets in (a late-comer is held for the next
    # round's selection, and told to come back when its hold ends), and nobody gets two seats.
    assert seen["late"].retry_after.reason == "next selection not open yet"
    assert 0.2 <= seen["late"].retry_after.seconds <= 60
    assert seen["again"].retry_after.reason == "already assigned"
    tasks = [t for k, t in seen.items() if k.startswith("dev")]
    assert len({t.aggregator_address for t in tasks}) == 2  # two cohorts, one per aggregator
    assert sorted((t.aggregator_address, t.device_index) for t in tasks) == sorted(
        (a, i) for a in {t.aggregator_address for t in tasks} for i in range(1, 6)
    )
    assert all(t.session.min_survivors >= 5 and t.chunk_size == 1 << 20 for t in tasks)
    assert all(t.algorithm == "fedavg" and '"local_epochs": 1' in t.algorithm_options for t in tasks)

    assert final_job.state == SUCCEEDED and final_job.committed_round == rounds
    assert events[-1].state == SUCCEEDED
    commits = [e for e in events if e.phase == common_pb2.ROUND_PHASE_COMMITTED]
    assert [e.round for e in commits] == [1, 2, 3] and all(e.metrics["update.contributors"] == 10 for e in commits)
    assert status.job_state == SUCCEEDED and status.committed_round == rounds

    assert [(r.round, r.state) for r in round_rows] == [(1, "committed"), (2, "committed"), (3, "committed")]
    assert all(r.metrics["update.contributors"] == 10 and r.metrics["cohorts"] == 2 for r in round_rows)
    assert all(r.metrics["update.examples"] == sum(40 + 10 * i for i in range(10)) for r in round_rows)
    trainers = [FixedTrainer(i, 40 + 10 * i) for i in range(10)]
    expected = reference_model(get_params(mlp(64, 10, 8)), trainers, rounds, config)
    error = max(float(np.abs(model[k].astype(np.float64) - expected[k]).max()) for k in expected)
    assert 0 < error <= fedavg_bound(trainers, config, rounds, 0.05), error

    assert "tally_coordinator_rounds_committed_total 3.0" in metrics
    assert 'tally_coordinator_checkins_total{outcome="task"} 30.0' in metrics
    assert "tally_coordinator_devices_selected_total 30.0" in metrics
    assert 'tally_coordinator_cohort_sums_total{outcome="accepted"} 6.0' in metrics
    assert "tally_coordinator_aggregators_up 2.0" in metrics
    assert "tally_coordinator_round_duration_seconds_count 3.0" in metrics
    assert "tally_coordinator_model_served_bytes_total" in metrics


async def until_true(predicate: Callable[[], bool], timeout: float = 10.0) -> None:
    """Wait for a condition of the in-process coordinator (polled; bounded)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.01)


def test_check_ins_during_aggregation_are_seated_when_the_next_round_opens(tmp_path):
    """Devices that check in while a round aggregates are held and become the next round's
    selection the moment it opens, without checking in again; a device whose hold ends leaves;
    the last round holds nobody."""
    contribute = fedavg_contribution(FedAvgConfig(local_epochs=1))

    async def main():
        async with stack(tmp_path, aggregators=1) as s:
            first = await s.devices(5, prefix="first")
            later = await s.devices(5, prefix="next")
            leaver = (await s.devices(1, prefix="leaver"))[0]
            job_id = await s.submit(spec_yaml("overlap", rounds=2, cohort=5))
            watch = asyncio.create_task(s.until_done(job_id))
            runner = s.service.jobs.runner(job_id)
            release, all_in = asyncio.Event(), asyncio.Event()
            round_one: set[str] = set()

            async def before(device, task):
                if task.round == 1:  # round 1 aggregates until the test releases it
                    round_one.add(device.device_id)
                    if len(round_one) == len(first):
                        all_in.set()
                    await release.wait()

            done = asyncio.Event()
            loops = [asyncio.create_task(d.loop(contribute, done, before)) for d in first]
            await all_in.wait()
            left = await leaver.check_in_once(timeout=1.5)  # held 0.5 s, then its hold ends
            held = [asyncio.create_task(d.check_in_once(timeout=30)) for d in later]
            await until_true(lambda: runner.holds.waiting is not None and len(runner.holds.waiting.held) == len(later))
            release.set()
            replies = await asyncio.gather(*held)  # the one check-in each made, during round 1
            in_last_round = await leaver.check_in_once(timeout=30)
            await asyncio.gather(*(d.participate(r.task, contribute) for d, r in zip(later, replies)
                                   if r.HasField("task")))
            events = await watch
            done.set()
            await asyncio.gather(*loops)
            metrics = scrape(s.service.metrics_port)
        return left, replies, in_last_round, events, metrics

    left, replies, in_last_round, events, metrics = run(main())
    assert left.retry_after.reason == "next selection not open yet"
    assert all(r.HasField("task") and r.task.round == 2 for r in replies), replies
    assert sorted(r.task.device_index for r in replies) == [1, 2, 3, 4, 5]  # the whole cohort
    assert in_last_round.retry_after.reason == "selection closed"
    assert events[-1].state == SUCCEEDED
    commits = [e for e in events if e.phase == common_pb2.ROUND_PHASE_COMMITTED]
    assert [(e.round, e.metrics["update.contributors"]) for e in commits] == [(1, 5), (2, 5)]
    assert "tally_coordinator_devices_seated_early_total 5.0" in metrics


def test_a_device_whose_hold_ends_as_its_cohort_forms_comes_back_at_once_for_its_task(tmp_path):
    """Held devices answer before their caller's deadline. One whose hold ends after the selection
    closed with it (sessions still opening) keeps its seat: it is told to come back at once, and
    pace steering, which would send it behind the whole population, leaves that answer alone."""

    async def main():
        async with stack(tmp_path, aggregators=1, checkin_rate=0.5) as s:
            devices = await s.devices(5)
            gate = s.aggregators[0].open_gate = asyncio.Event()
            job_id = await s.submit(spec_yaml("late-hold", rounds=1, cohort=5))
            runner = s.service.jobs.runner(job_id)
            await until_true(lambda: runner.planner is not None)
            replies = await asyncio.gather(*(d.check_in_once(timeout=2.0) for d in devices))
            opening = runner.planner.phase
            gate.set()
            again = await asyncio.gather(*(d.check_in_once(timeout=5.0) for d in devices))
            await s.admin.CancelJob(admin_pb2.CancelJobRequest(job_id=job_id), metadata=s.admin_md, timeout=5)
        return replies, opening, again

    replies, opening, again = run(main())
    assert opening is Phase.OPENING  # every hold ended while the session was opening
    assert [(r.retry_after.reason, r.retry_after.seconds) for r in replies] == [
        ("seated: come back for the task", MIN_RETRY_S)] * 5
    assert sorted(r.task.device_index for r in again) == [1, 2, 3, 4, 5]


async def held_for_round_two(s: Stack, first: list[Device], later: list[Device], **job) -> tuple[str, asyncio.Event, list]:
    """A two-round job whose round 1 aggregates (its devices wait for the returned event) while
    each of ``later`` is held for round 2 by one check-in (the returned tasks answer them)."""
    contribute = fedavg_contribution(FedAvgConfig(local_epochs=1))
    job_id = await s.submit(spec_yaml("overlap", rounds=2, cohort=len(first), **job))
    runner = s.service.jobs.runner(job_id)
    release, all_in = asyncio.Event(), asyncio.Event()
    round_one: set[str] = set()

    async def before(device, task):
        round_one.add(device.device_id)
        if len(round_one) == len(first):
            all_in.set()
        await release.wait()

    for d in first:
        asyncio.create_task(d.loop(contribute, release, before))
    await all_in.wait()
    held = [asyncio.create_task(d.check_in_once(timeout=30)) for d in later]
    await until_true(lambda: runner.holds.waiting is not None and len(runner.holds.waiting.held) == len(later))
    return job_id, release, held


def test_devices_held_for_a_jobs_next_round_are_let_go_when_another_jobs_selection_opens(tmp_path):
    async def main():
        async with stack(tmp_path, aggregators=1, checkin_rate=0.5) as s:
            first, later = await s.devices(5, prefix="first"), await s.devices(5, prefix="next")
            _, release, held = await held_for_round_two(s, first, later)
            job_b = await s.submit(spec_yaml("newer", rounds=1, cohort=5))
            replies = await asyncio.gather(*held)
            release.set()
        return job_b, replies

    job_b, replies = run(main())
    assert [(r.retry_after.reason, r.retry_after.seconds) for r in replies] == [
        (f"job {job_b} is selecting", MIN_RETRY_S)] * 5  # at once: pace steering (0.5/s) left them alone


def test_devices_held_during_an_attempt_that_fails_are_seated_by_its_retry(tmp_path):
    async def main():
        async with stack(tmp_path, aggregators=2) as s:
            first, later = await s.devices(5, prefix="first"), await s.devices(5, prefix="next")
            _, release, held = await held_for_round_two(s, first, later)
            serving = next(a for a in s.aggregators if a.sessions)
            await serving.stop()  # attempt 1 of round 1 fails while the five are held
            replies = await asyncio.gather(*held)
            release.set()
        return replies

    replies = run(main())
    assert all(r.HasField("task") and r.task.round == 1 for r in replies), replies
    assert {r.task.task_id.split("-")[0] for r in replies} == {"r1a2"}  # round 1's second attempt


def test_a_job_that_ends_answers_its_held_devices_and_holds_no_more(tmp_path):
    async def main():
        async with stack(tmp_path, aggregators=1) as s:
            first, later = await s.devices(5, prefix="first"), await s.devices(5, prefix="next")
            job_id, release, held = await held_for_round_two(s, first, later[:4])  # room for one more
            gate = s.aggregators[0].close_gate = asyncio.Event()  # the job's last act waits here
            cancel = asyncio.ensure_future(s.admin.CancelJob(
                admin_pb2.CancelJobRequest(job_id=job_id), metadata=s.admin_md, timeout=10))
            replies = await asyncio.gather(*held)
            during_close = await later[4].check_in_once(timeout=30)
            gate.set()
            await cancel
            release.set()
        return replies, during_close

    replies, during_close = run(main())
    assert [r.retry_after.reason for r in replies] == ["job is not running"] * 4
    assert during_close.HasField("retry_after") and during_close.retry_after.reason != "next selection not open yet"


@dataclass
class StandInRunner:
    """What ``ActiveJobs.check_in`` asks of a job, scripted: its answer, whether its selection is open
    or about to open, whether it would hold the device for its next selection."""

    seq: int
    selecting: bool
    room: bool
    population: str = "default"
    held: list[str] = field(default_factory=list)

    def offer(self, device_id: str, now: float) -> Retry:
        return Retry(MIN_RETRY_S, "next round starting" if self.selecting else "selection closed")

    def hold_for_next(self, device_id: str) -> bool:
        return self.room

    async def hold(self, device_id: str, hold_s: float) -> str:
        self.held.append(device_id)
        return f"held by job {self.seq}"


@pytest.mark.parametrize("other_selecting", [True, False])
def test_a_job_about_to_select_comes_before_holding_a_device_for_another_jobs_next_round(other_selecting):
    """A device turned away by every job is held for an aggregating job's next selection only if
    no other job of its population is selecting or about to: that job would miss it while held."""
    jobs = ActiveJobs(None, None, None, CoordinatorMetrics(), time.monotonic)
    aggregating = StandInRunner(seq=1, selecting=False, room=True)
    jobs.runners = {"a": aggregating, "b": StandInRunner(seq=2, selecting=other_selecting, room=False)}
    claims = DeviceClaims("dev", "default", issued_at=0.0, expires_at=60.0, token_id="t")
    answer = asyncio.run(jobs.check_in(claims, caller_timeout_s=30))
    if other_selecting:
        assert isinstance(answer, Retry) and answer.seconds == MIN_RETRY_S and aggregating.held == []
    else:
        assert answer == "held by job 1" and aggregating.held == ["dev"]


def test_two_step_rounds_broadcast_the_first_sum_of_every_cohort(tmp_path, twostep):
    losses = {f"dev{i}": 0.1 * (i + 1) for i in range(10)}

    def contribute(device, step, broadcast):
        if step == "stats":
            return {"loss": losses[device.device_id], "count": 1}
        dim = 64 * 4 + 4 + 4 * 10 + 10
        scale = float(broadcast["mean_loss"]) * (1 + int(device.device_id[3:])) / 100
        return {"delta": np.full(dim, scale), "weight": 1}

    async def main():
        async with stack(tmp_path, aggregators=2) as s:
            devices = await s.devices(10, trainers=False)
            job_id = await s.submit(
                "name: two\nalgorithm: twostep\nrounds: 1\ncohort_size: 10\nover_selection: 1.0\nmin_cohort: 5\n"
                "model: {inputs: 64, classes: 10, hidden: 4}\n"
            )
            tasks = await asyncio.gather(*(d.task() for d in devices))
            assert all([s.sum_id for s in t.session.sums] == ["stats", "update"] for t in tasks)
            assert all(len(t.step.broadcast) == 0 and t.step.sum_id == "stats" for t in tasks)
            # Nine devices send their first sum; the second step's broadcast must wait for all.
            for d, t in zip(devices[:9], tasks[:9]):
                await d.send(t, t.step, contribute(d, "stats", {}))
            early = await devices[0].stub.GetStep(
                coordinator_pb2.GetStepRequest(job_id=job_id, round=1, task_id=tasks[0].task_id, sum_id="update"),
                metadata=devices[0].md, timeout=5,
            )
            assert early.HasField("retry_after") and "'stats' of every cohort" in early.retry_after.reason
            # Then the last one, and everyone runs the second step.
            watch = asyncio.create_task(s.until_done(job_id))
            await devices[9].send(tasks[9], tasks[9].step, contribute(devices[9], "stats", {}))
            broadcasts = []
            for d, t in zip(devices, tasks):
                step = await d.step(t, "update")
                broadcasts.append(tensors_from_proto(step.broadcast))
                await d.send(t, step, contribute(d, "update", broadcasts[-1]))
            events = await watch
            model, rows = committed_model(s.service.store, job_id)
        return broadcasts, events, model, rows

    broadcasts, events, model, rows = run(main())
    mean_loss = sum(losses.values()) / 10
    assert all(abs(float(b["mean_loss"]) - mean_loss) <= 10 * 2.0 ** -FRAC_BITS for b in broadcasts)
    assert events[-1].state == SUCCEEDED and rows[0].metrics["stats.contributors"] == 10
    initial = get_params(mlp(64, 10, 4))
    shift = mean_loss * np.mean([(1 + i) / 100 for i in range(10)])
    for k in initial:
        assert np.abs(model[k] - (initial[k] + shift)).max() <= 1e-5


def test_large_model_downloads_in_chunks_and_exports_to_onnx(tmp_path):
    config = FedAvgConfig(local_epochs=1)
    hidden = 20_000  # 1.5 M parameters: a 6 MB model, above gRPC's default 4 MiB message limit

    async def main():
        async with stack(tmp_path, aggregators=1) as s:
            devices = await s.devices(5)
            job_id = await s.submit(spec_yaml("big", cohort=5, hidden=hidden))
            tasks = await asyncio.gather(*(d.task() for d in devices))
            first = tasks[0]
            blob, chunks = await devices[0].download(first.model_digest)
            tail, resumed = await devices[0].download(first.model_digest, offset=len(blob) // 2 + 7)
            errors = {}
            for name, request in {
                "unknown": coordinator_pb2.DownloadModelRequest(digest="0" * 64),
                "malformed": coordinator_pb2.DownloadModelRequest(digest="xyz"),
                "no digest": coordinator_pb2.DownloadModelRequest(model_version="v0"),
                "negative": coordinator_pb2.DownloadModelRequest(digest=first.model_digest, offset=-1),
                "beyond": coordinator_pb2.DownloadModelRequest(digest=first.model_digest, offset=len(blob) + 1),
                "no version": coordinator_pb2.DownloadModelRequest(model_version="v9.onnx"),
                "bad name": coordinator_pb2.DownloadModelRequest(model_version="best.onnx"),
                "mismatch": coordinator_pb2.DownloadModelRequest(model_version="latest.onnx", digest="0" * 64),
                "other job": coordinator_pb2.DownloadModelRequest(model_version="someone-else/v0.onnx"),
            }.items():
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    [c async for c in devices[0].stub.DownloadModel(request, metadata=devices[0].md, timeout=5)]
                errors[name] = err.value.code()
            watch = asyncio.create_task(s.until_done(job_id))
            await asyncio.gather(*(d.participate(t, fedavg_contribution(config)) for d, t in zip(devices, tasks)))
            events = await watch
            latest, _ = await devices[0].download(version="latest.onnx")
            by_name, _ = await devices[0].download(version=f"{job_id}/v1.onnx")
            initial_onnx, _ = await devices[0].download(version="v0.onnx")
            model, _ = committed_model(s.service.store, job_id)
        return blob, chunks, tail, resumed, errors, events, latest, by_name, initial_onnx, model, first

    blob, chunks, tail, resumed, errors, events, latest, by_name, initial_onnx, model, first = run(main())
    assert len(blob) > 4 << 20 and hashlib.sha256(blob).hexdigest() == first.model_digest
    assert len(chunks) == -(-len(blob) // first.chunk_size) and all(len(c.data) <= first.chunk_size for c in chunks)
    assert [c.offset for c in chunks] == [i * first.chunk_size for i in range(len(chunks))]
    assert all(c.total_size == len(blob) and c.digest == first.model_digest for c in chunks)
    assert tail == blob[len(blob) // 2 + 7:] and resumed[0].offset == len(blob) // 2 + 7
    assert errors == {
        "unknown": grpc.StatusCode.NOT_FOUND, "malformed": grpc.StatusCode.INVALID_ARGUMENT,
        "no digest": grpc.StatusCode.INVALID_ARGUMENT, "negative": grpc.StatusCode.INVALID_ARGUMENT,
        "beyond": grpc.StatusCode.OUT_OF_RANGE, "no version": grpc.StatusCode.NOT_FOUND,
        "bad name": grpc.StatusCode.NOT_FOUND, "mismatch": grpc.StatusCode.FAILED_PRECONDITION,
        "other job": grpc.StatusCode.NOT_FOUND,
    }
    assert events[-1].state == SUCCEEDED
    assert latest == by_name and latest != initial_onnx
    net = mlp(64, 10, hidden)
    set_params(net, model)
    x = np.random.default_rng(0).normal(size=(4, 64)).astype(np.float32)
    onnx_out = ort.InferenceSession(latest).run(None, {"input": x})[0]
    with torch.no_grad():
        assert np.abs(onnx_out - net(torch.from_numpy(x)).numpy()).max() < 1e-4


async def status_of(call) -> tuple[grpc.StatusCode, str]:
    """The gRPC status a call ends with (OK when it succeeds)."""
    try:
        await call
    except grpc.aio.AioRpcError as exc:
        return exc.code(), exc.details()
    return grpc.StatusCode.OK, ""


def test_device_calls_without_a_valid_token_or_with_bad_input_get_clear_statuses(tmp_path):
    async def main():
        async with stack(tmp_path, aggregators=1) as s:
            stub, pb = s.device_stub, coordinator_pb2
            device = (await s.devices(1))[0]
            forged = bearer_metadata(device.token[:-4] + "AAAA")
            unauthenticated = [
                stub.CheckIn(pb.CheckInRequest(), timeout=5),
                stub.CheckIn(pb.CheckInRequest(), metadata=forged, timeout=5),
                stub.RoundStatus(pb.RoundStatusRequest(job_id="x"), timeout=5),
                stub.GetStep(pb.GetStepRequest(job_id="x"), timeout=5),
                stub.DownloadModel(pb.DownloadModelRequest(digest="0" * 64), timeout=5).read(),
            ]
            codes = [await status_of(call) for call in unauthenticated]
            assert all(code == grpc.StatusCode.UNAUTHENTICATED for code, _ in codes), codes
            assert "signature invalid" in codes[1][1]
            code, _ = await status_of(stub.Register(pb.RegisterRequest(population="p"), timeout=5))
            assert code == grpc.StatusCode.INVALID_ARGUMENT
            for call in (stub.RoundStatus(pb.RoundStatusRequest(job_id="x"), metadata=device.md, timeout=5),
                         stub.GetStep(pb.GetStepRequest(job_id="x", round=1), metadata=device.md, timeout=5)):
                assert (await status_of(call))[0] == grpc.StatusCode.NOT_FOUND
            idle = await device.check_in_once()
            assert idle.retry_after.reason.startswith("no running job") and 0.2 <= idle.retry_after.seconds <= 60

            # A held check-in answers before the device's own deadline instead of timing out.
            await s.submit(spec_yaml("waiting", population="nobody"))
            impatient = (await s.devices(1, trainers=False, prefix="impatient", population="nobody"))[0]
            while True:
                started = time.monotonic()
                held = await impatient.check_in_once(timeout=1.5)
                if held.retry_after.reason != "next round starting":  # the job was still starting
                    break
            assert held.retry_after.reason == "selection still open" and 0.3 < time.monotonic() - started < 1.5

            reply = await health_pb2_grpc.HealthStub(s.channel).Check(
                health_pb2.HealthCheckRequest(service="tally.v1.Coordinator"), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
            reflected = reflection_pb2_grpc.ServerReflectionStub(s.channel).ServerReflectionInfo(
                iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5)
            services = {svc.name async for answer in reflected for svc in answer.list_services_response.service}
            assert {"tally.v1.Coordinator", "tally.v1.Admin", "grpc.health.v1.Health"} <= services

    run(main())


def test_admin_api_needs_its_token_and_validates_submit_list_cancel_watch(tmp_path):
    async def main():
        async with stack(tmp_path, aggregators=1) as s:
            admin, md = s.admin, s.admin_md
            device = (await s.devices(1))[0]
            assert stat.S_IMODE((s.state_dir / "admin.token").stat().st_mode) == 0o600
            for metadata in (None, device.md):  # no token; a device's token
                code, _ = await status_of(admin.ListJobs(admin_pb2.ListJobsRequest(), metadata=metadata, timeout=5))
                assert code == grpc.StatusCode.UNAUTHENTICATED

            bad = "name: x\nalgorithm: nope\nrounds: 0\ncohort_size: 10\nbogus: 1\n"
            call = admin.SubmitJob(admin_pb2.SubmitJobRequest(spec_yaml=bad), metadata=md, timeout=5)
            code, details = await status_of(call)
            assert code == grpc.StatusCode.INVALID_ARGUMENT
            assert all(w in details for w in ("unknown keys ['bogus']", "algorithm: 'nope'", "rounds: must be"))
            for call in (admin.SubmitJob(admin_pb2.SubmitJobRequest(spec_yaml="a: [1"), metadata=md, timeout=5),
                         admin.SubmitJob(admin_pb2.SubmitJobRequest(), metadata=md, timeout=5),
                         admin.ListJobs(admin_pb2.ListJobsRequest(page_token="x"), metadata=md, timeout=5)):
                assert (await status_of(call))[0] == grpc.StatusCode.INVALID_ARGUMENT
            code, _ = await status_of(admin.GetJob(admin_pb2.GetJobRequest(job_id="nope"), metadata=md, timeout=5))
            assert code == grpc.StatusCode.NOT_FOUND

            request = admin_pb2.SubmitJobRequest()  # the same spec as a struct: numbers arrive as doubles
            request.spec_struct.update({"name": "structured", "algorithm": "fedavg", "rounds": 2,
                                        "cohort_size": 5, "population": "nobody", "retries": 0})
            structured = await admin.SubmitJob(request, metadata=md, timeout=5)
            assert structured.algorithm == "fedavg" and "rounds: 2" in structured.spec_yaml
            second = await s.submit(spec_yaml("second", population="nobody"))
            page = await admin.ListJobs(admin_pb2.ListJobsRequest(page_size=1), metadata=md, timeout=5)
            rest = await admin.ListJobs(
                admin_pb2.ListJobsRequest(page_size=1, page_token=page.next_page_token), metadata=md, timeout=5)
            assert [j.job_id for j in page.jobs] == [structured.job_id] and [j.job_id for j in rest.jobs] == [second]
            assert rest.next_page_token == ""

            watch = asyncio.create_task(s.until_done(structured.job_id))
            cancelled = await admin.CancelJob(
                admin_pb2.CancelJobRequest(job_id=structured.job_id, reason="test"), metadata=md, timeout=5)
            assert cancelled.state == CANCELLED and "test" in cancelled.message
            assert (await watch)[-1].state == CANCELLED  # the watch stream ends with the job
            for job_id, expected in ((structured.job_id, grpc.StatusCode.FAILED_PRECONDITION),
                                     ("nope", grpc.StatusCode.NOT_FOUND)):
                call = admin.CancelJob(admin_pb2.CancelJobRequest(job_id=job_id), metadata=md, timeout=5)
                assert (await status_of(call))[0] == expected
            active = [common_pb2.JOB_STATE_PENDING, common_pb2.JOB_STATE_RUNNING]
            running = await admin.ListJobs(admin_pb2.ListJobsRequest(states=active), metadata=md, timeout=5)
            assert [j.job_id for j in running.jobs] == [second]

    run(main())


def test_restarted_coordinator_resumes_at_the_next_round(tmp_path):
    config = FedAvgConfig(local_epochs=1)
    rounds = 3

    async def main():
        async with stack(tmp_path, aggregators=1) as s:
            devices = await s.devices(6)
            # The interrupted attempt's devices may not be seated again in round 2, not even by a
            # restarted coordinator: six spares with the same data take round 2 and then stop,
            # so every round still sums the same six contributions.
            spares = await s.devices(6, prefix="spare")
            job_id = await s.submit(spec_yaml("resume", rounds=rounds, cohort=6))
            release = asyncio.Event()
            held = []
            all_held = asyncio.Event()
            spare_done = {d.device_id: asyncio.Event() for d in spares}
            seated: dict[tuple[int, str], set[str]] = defaultdict(set)  # (round, attempt key) -> devices

            async def before(device, task):
                seated[task.round, task.task_id.split(".")[0]].add(device.device_id)
                if device.device_id in spare_done:
                    spare_done[device.device_id].set()  # its loop ends after this task
                elif task.round == 2 and not release.is_set():
                    held.append(device.device_id)
                    if len(held) == len(devices):
                        all_held.set()
                    await release.wait()

            done = asyncio.Event()
            loops = [asyncio.create_task(d.loop(fedavg_contribution(config), done, before)) for d in devices]
            await all_held.wait()  # round 1 committed; round 2's sessions open and waiting
            await s.restart()
            mid = s.service.store.job(job_id)
            loops += [
                asyncio.create_task(d.loop(fedavg_contribution(config), spare_done[d.device_id], before))
                for d in spares
            ]
            release.set()
            events = await s.until_done(job_id)
            done.set()
            await asyncio.gather(*loops)
            model, rows = committed_model(s.service.store, job_id)
            versions = [s.service.store.model_version(job_id, r) for r in range(rounds + 1)]
            closed = [sess.closed for sess in s.aggregators[0].sessions.values()]
        return mid, events, model, rows, versions, closed, seated

    mid, events, model, rows, versions, closed, seated = run(main())
    round_two = [devices for (round_, _), devices in seated.items() if round_ == 2]
    assert sorted(sorted(d) for d in round_two) == [
        [f"dev{i}" for i in range(6)], [f"spare{i}" for i in range(6)]
    ]
    assert mid.committed_round == 1 and mid.state == "RUNNING"
    assert events[-1].state == SUCCEEDED
    committed = [(r.round, r.attempt) for r in rows if r.state == "committed"]
    assert [r for r, _ in committed] == [1, 2, 3]  # none lost, none repeated
    interrupted = [r for r in rows if r.state == "failed"]
    assert [(r.round, r.message) for r in interrupted] == [(2, "interrupted: coordinator stopped")]
    assert all(v is not None and v.state_digest and v.onnx_digest for v in versions)
    assert sum(c is not None for c in closed) >= 1  # the interrupted session was closed
    trainers = [FixedTrainer(i, 40 + 10 * i) for i in range(6)]
    expected = reference_model(get_params(mlp(64, 10, 8)), trainers, rounds, config)
    error = max(float(np.abs(model[k].astype(np.float64) - expected[k]).max()) for k in expected)
    assert error <= fedavg_bound(trainers, config, rounds, 0.05), error


@pytest.mark.parametrize("failure", ["killed", "aborted"])
def test_failed_cohort_round_is_retried_and_the_job_goes_on(tmp_path, failure):
    config = FedAvgConfig(local_epochs=1)

    async def main():
        async with stack(tmp_path, aggregators=2) as s:
            # Twice the cohort: a retry never seats a device the failed attempt seated.
            devices = await s.devices(20)
            job_id = await s.submit(spec_yaml("failover", rounds=2))
            victim = s.aggregators[1]
            ready = asyncio.Event()

            async def fail():
                await victim.opened.wait()
                await s.aggregators[0].opened.wait()
                if failure == "killed":
                    await victim.stop()  # mid-round: its AwaitResult breaks, its health check fails
                else:
                    victim.aborts.append("too few survivors: 4 < 5")  # once; then it works again
                ready.set()

            async def before(device, task):
                await ready.wait()

            failer = asyncio.create_task(fail())
            events = await run_devices(devices, fedavg_contribution(config), s.until_done(job_id), before)
            await failer
            metrics = scrape(s.service.metrics_port)
            _, rows = committed_model(s.service.store, job_id)
        return events, rows, metrics

    events, rows, metrics = run(main())
    assert events[-1].state == SUCCEEDED
    failed = [r for r in rows if r.state == "failed"]
    assert len(failed) == 1 and failed[0].round == 1 and "aggregator agg1" in failed[0].message
    assert [r.round for r in rows if r.state == "committed"] == [1, 2]
    # The retry backed off before it began (issue 25: retries ran back to back, the budget spent in 5 s).
    [retry] = [r for r in rows if r.round == 1 and r.attempt == failed[0].attempt + 1]
    assert retry.started_at - failed[0].finished_at >= RETRY_BACKOFF_FIRST_S
    assert any(e.phase == common_pb2.ROUND_PHASE_FAILED and "agg1" in e.message for e in events)
    assert "tally_coordinator_rounds_retried_total 1.0" in metrics
    cohorts = [r.metrics["cohorts"] for r in rows if r.state == "committed"]
    if failure == "killed":
        assert cohorts == [1, 1] and "tally_coordinator_aggregators_up 1.0" in metrics  # all on agg0
    else:
        assert "session aborted: too few survivors: 4 < 5" in failed[0].message
        assert cohorts == [2, 2] and 'tally_coordinator_cohort_sums_total{outcome="aborted"} 1.0' in metrics


def test_exhausted_retries_fail_the_job_with_the_reason(tmp_path):
    async def main():
        async with stack(tmp_path, aggregators=2) as s:
            for fake in s.aggregators:
                fake.abort_reason = "too few survivors: 3 < 5"
            devices = await s.devices(20)  # the retry's cohort is other devices
            aborting = await s.submit(spec_yaml("aborts", extra="retries: 1\n"))
            events = await run_devices(devices, fedavg_contribution(FedAvgConfig()), s.until_done(aborting))
            extra = "retries: 1\ndeadlines: {checkin: 0.2}\n"
            lonely = await s.submit(spec_yaml("lonely", population="empty", extra=extra))
            lonely_events = await s.until_done(lonely)
            jobs = [await s.job(aborting), await s.job(lonely)]
            metrics = scrape(s.service.metrics_port)
        return events, lonely_events, jobs, metrics

    events, lonely_events, jobs, metrics = run(main())
    assert [j.state for j in jobs] == [FAILED, FAILED]
    assert "retry budget 1 spent" in jobs[0].message and "too few survivors: 3 < 5" in jobs[0].message
    assert events[-1].state == FAILED and "too few survivors" in events[-1].message
    assert "only 0 of the 5 devices needed checked in" in jobs[1].message
    assert lonely_events[-1].state == FAILED
    assert "tally_coordinator_rounds_failed_total 2.0" in metrics
    assert 'tally_coordinator_cohort_sums_total{outcome="aborted"}' in metrics


def test_round_deadline_bounds_a_silent_aggregator(tmp_path):
    deadlines = "deadlines: {download: 0.1, advertise_keys: 0.1, share_keys: 0.1, masked_input: 0.2, consistency_check: 0.1, unmask: 0.1}\n"

    async def main():
        async with stack(tmp_path, aggregators=1) as s:
            s.aggregators[0].hang = True
            devices = await s.devices(5)
            job_id = await s.submit(spec_yaml("silent", cohort=5, extra="retries: 0\n" + deadlines))
            started = time.monotonic()
            events = await run_devices(devices, fedavg_contribution(FedAvgConfig()), s.until_done(job_id))
            elapsed = time.monotonic() - started
            closed = [sess.closed for sess in s.aggregators[0].sessions.values()]
        return events, elapsed, closed

    events, elapsed, closed = run(main())
    assert events[-1].state == FAILED
    assert "DEADLINE_EXCEEDED" in events[-1].message or "before the round deadline" in events[-1].message
    assert elapsed < 10 and closed and all(closed)


def test_tls_to_devices_and_mutual_tls_to_aggregators_from_tally_certs(tmp_path):
    """`tally coordinator --tls-dir <certs>/coordinator`: devices reach it over TLS, and it
    presents its own certificate to an aggregator that demands mutual TLS; without a client
    certificate (an explicit aggregator_tls of CA only) the aggregator refuses it."""
    pki = tmp_path / "pki"
    certs.write_deployment(pki)
    own = pki / "coordinator"
    parser = argparse.ArgumentParser(prog="tally")
    coordinator_cli.register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["coordinator", "--state-dir", str(tmp_path / "state"), "--tls-dir", str(own)])
    tls = tls_config_from_args(args)
    assert tls.cert == own / "coordinator.pem" and tls.ca == own / "ca.pem"

    async def main():
        fake = FakeAggregatorControl("agg0", TicketVerifier(load_or_create_ticket_key(own).public_key()))
        await fake.start(TLSConfig.from_dir(pki / "aggregator-1", "aggregator", require_client_auth=True),
                         host="localhost")
        service = CoordinatorService(
            "127.0.0.1:0", tls, tmp_path / "state", [("agg0", fake.address)], secrets_dir=own,
        )
        port = await service.start()
        try:
            healthy = await service.jobs.pool.healthy()
            channel = grpc.aio.secure_channel(
                f"localhost:{port}", channel_credentials(TLSConfig.from_dir(pki / "device", None)),
                options=channel_options(),
            )
            async with channel:
                stub = coordinator_pb2_grpc.CoordinatorStub(channel)
                reply = await stub.Register(provisioned_request(service, "d", "p"), timeout=5)
                metadata = bearer_metadata(reply.token)
                answer = await stub.CheckIn(coordinator_pb2.CheckInRequest(), metadata=metadata, timeout=5)
            without_client_cert = CoordinatorService(
                "127.0.0.1:0", tls, tmp_path / "other", [("agg0", fake.address)], secrets_dir=own,
                aggregator_tls=TLSConfig(ca=tls.ca),
            )
            await without_client_cert.start()
            refused = await without_client_cert.jobs.pool.healthy()
            await without_client_cert.stop(grace=0)
        finally:
            await service.stop(grace=0)
            await fake.stop()
        return healthy, answer, refused

    healthy, answer, refused = run(main())
    assert healthy == ["agg0"] and refused == []  # mutual TLS: no client certificate, no aggregator
    assert answer.HasField("retry_after")


def test_cli_help_and_job_commands(tmp_path, capsys):
    parser = argparse.ArgumentParser(prog="tally")
    sub = parser.add_subparsers(dest="command", required=True)
    coordinator_cli.register(sub)
    for argv in (["coordinator"], ["job"], ["job", "submit"], ["job", "status"], ["job", "list"],
                 ["job", "cancel"], ["job", "watch"]):
        with pytest.raises(SystemExit) as exit_:
            parser.parse_args([*argv, "--help"])
        assert exit_.value.code == 0
    assert "--aggregator ID=HOST:PORT" in capsys.readouterr().out
    spec = tmp_path / "job.yaml"
    spec.write_text(spec_yaml("cli", population="nobody"))

    def cli(*argv: str) -> tuple[int, str]:
        args = parser.parse_args(argv)
        code = args.run(args)
        return code, capsys.readouterr().out  # stderr may hold other tests' log noise

    async def main():
        async with stack(tmp_path, aggregators=1) as s:
            common = ("--coordinator", f"127.0.0.1:{s.service.port}", "--state-dir", str(s.state_dir), "--insecure")
            code, out = await asyncio.to_thread(cli, "job", "submit", str(spec), *common)
            job_id = out.strip()
            results = [
                (code, out),
                await asyncio.to_thread(cli, "job", "status", job_id, *common),
                await asyncio.to_thread(cli, "job", "list", *common),
                await asyncio.to_thread(cli, "job", "cancel", job_id, "--reason", "done here", *common),
                await asyncio.to_thread(cli, "job", "watch", job_id, *common),
                await asyncio.to_thread(cli, "job", "status", "nope", *common),
            ]
        return job_id, results

    job_id, results = run(main())
    (submit_code, _), (status_code, status), (list_code, listing), (cancel_code, cancel) = results[:4]
    (watch_code, watch), (missing_code, _) = results[4:]
    assert submit_code == status_code == list_code == cancel_code == 0
    assert job_id.startswith("cli-") and job_id in status and job_id in listing
    assert "PENDING" in status or "RUNNING" in status
    assert "CANCELLED" in cancel and "done here" in cancel
    assert watch_code == 1 and "CANCELLED" in watch
    assert missing_code == 1


def test_reveal_opt_in_lives_at_the_top_level_and_is_refused_through_the_services():
    base = "name: r\nalgorithm: aaggff_s\nrounds: 1\ncohort_size: 8\nmin_cohort: 5\n"
    with pytest.raises(jobspec.JobSpecError, match="top level"):
        jobspec.parse(base + "config: {num_clients: 8, reveal: [response]}\n")
    opted_in = jobspec.parse(base + "config: {num_clients: 8}\nreveal: [response]\n")
    assert opted_in.reveal == ("response",) and opted_in.config["reveal"] == ["response"]
    assert jobspec.parse(opted_in.to_yaml()) == opted_in  # a resumed job parses the same
    with pytest.raises(jobspec.JobSpecError, match="nothing is: the server sees only sums"):
        jobspec.parse("name: f\nalgorithm: fedavg\nrounds: 1\ncohort_size: 8\nmin_cohort: 5\nreveal: [update]\n")
    accepted = jobspec.parse(base + "config: {num_clients: 8, solver: separable}\n")
    assert accepted.reveal == () and "reveal" not in accepted.config


def test_reveal_collector_builds_the_rows_as_the_simulator_and_refuses_what_does_not_fit():
    """``RevealCollector`` gives ``apply`` what ``tally.sim.rounds.reveal_values`` gives it (rows by
    ascending silo id, each through the schema's fixed point); a wrong field or shape is a
    ValueError (INVALID_ARGUMENT), a task outside the round RevealOutOfPhase (FAILED_PRECONDITION)."""
    import numpy as np

    from coordinator.reveals import RevealCollector, RevealOutOfPhase
    from tally import algorithms
    from tally.sim.rounds import reveal_values

    server, _ = algorithms.make("aaggff_s", {"num_clients": 4, "reveal": ["response"]})
    step = server.steps(server.init({"w": np.zeros(3)}))[1]
    payloads = {2: 0.25, 0: -0.5, 3: 1.0}
    collector = RevealCollector(step, ["a", "b", "c"])
    for task, (silo, r) in zip("abc", payloads.items()):
        collector.add(task, silo, {"response": np.float64(r), "count": np.int64(1)})
    assert collector.complete.is_set()
    expected, _ = reveal_values(0, step, {d: {"response": np.float64(r), "count": np.int64(1)}
                                          for d, r in payloads.items()}, ["response"], np.random.default_rng(0))
    total = collector.total()
    assert set(total) == set(expected)
    for name in total:
        np.testing.assert_allclose(total[name], expected[name], atol=2.0 ** -17)
    with pytest.raises(ValueError, match="shape"):
        collector.add("a", 2, {"response": np.zeros(2), "count": np.int64(1)})
    with pytest.raises(ValueError, match="fields"):
        collector.add("a", 2, {"response": np.float64(0.0)})
    with pytest.raises(RevealOutOfPhase):
        collector.add("z", 1, {"response": np.float64(0.0), "count": np.int64(1)})


def test_task_reports_keep_an_example_and_only_real_failures_are_warnings(tmp_path, caplog):
    """Issue 25, items 2 and 7: each reason keeps the first device's own words (what `job status`
    shows), and a planned dropout is logged as routine while a device that could not do its task
    is a warning (a fleet's dropouts used to be 110 of 163 coordinator log lines, all warnings)."""
    from coordinator.planner import Seat
    from coordinator.task_reports import TaskReportBook
    from tally.wire.v1 import coordinator_pb2

    caplog.set_level("INFO", logger="tally.coordinator.reports")
    store = Store(tmp_path)
    book = TaskReportBook(store, "job")
    seats = [Seat(f"d{i}", 0, i + 1, f"task-{i}") for i in range(3)]
    book.issue(1, seats)
    Outcome = coordinator_pb2.TaskReport.Outcome
    reports = [("d0", Outcome.DROPPED, "dropped", ""), ("d1", Outcome.ABORTED, "model_mismatch", "shape (8,) vs (16,)"),
               ("d2", Outcome.ABORTED, "model_mismatch", "another")]
    for (device, outcome, reason, detail), seat in zip(reports, seats):
        book.record(device, coordinator_pb2.TaskReport(task_id=seat.task_id, round=1, outcome=outcome,
                                                       reason=reason, detail=detail))
    assert store.task_report_summary("job", 1) == {("dropped", "dropped"): (1, ""),
                                                    ("aborted", "model_mismatch"): (2, "shape (8,) vs (16,)")}
    levels = [(r.fields["device_id"], r.levelname) for r in caplog.records if r.getMessage() == "device task report"]
    assert levels == [("d0", "INFO"), ("d1", "WARNING"), ("d2", "WARNING")]


def test_a_restarted_coordinator_matches_reports_of_tasks_issued_before_it_stopped(tmp_path):
    """Issue 25, item 5: reports on tasks an earlier coordinator handed out were all unmatched
    after a restart (the issued tasks lived in memory), so their devices' seats stayed taken and
    the retried round seated 10 devices instead of 52. The store's seats now vouch for them: each
    such task is counted once, only for its own device, and "sent no input" frees its seat."""
    from coordinator.planner import Seat
    from coordinator.task_reports import Recorded, TaskReportBook
    from tally.wire.v1 import coordinator_pb2

    store = Store(tmp_path)
    store.add_seated("job", 1, [("d0", "task-0"), ("d1", "task-1"), ("d2", "task-2")])
    book = TaskReportBook(store, "job")  # a fresh book: nothing issued by this process
    Outcome = coordinator_pb2.TaskReport.Outcome

    def report(device: str, task: str, sent_input: bool) -> Recorded:
        return book.record(device, coordinator_pb2.TaskReport(
            task_id=task, round=1, outcome=Outcome.DROPPED, reason="dropped", sent_input=sent_input))

    assert report("d0", "task-0", sent_input=False) is Recorded.RELEASED
    assert report("d0", "task-0", sent_input=False) is Recorded.UNMATCHED  # once
    assert report("d1", "task-2", sent_input=False) is Recorded.UNMATCHED  # another device's task
    assert report("d1", "task-1", sent_input=True) is Recorded.COUNTED
    assert report("d1", "task-1", sent_input=True) is Recorded.UNMATCHED
    assert store.seated("job", 1) == frozenset({"d1", "d2"})
    assert store.task_report_counts("job", 1) == {("dropped", "dropped"): 2}
    # A task this process issued is counted once too, though its seat outlives the report.
    store.add_seated("job", 1, [("d3", "task-3")])
    book.issue(1, [Seat("d3", 0, 4, "task-3")])
    assert report("d3", "task-3", sent_input=True) is Recorded.COUNTED
    assert report("d3", "task-3", sent_input=True) is Recorded.UNMATCHED
    assert store.task_report_counts("job", 1) == {("dropped", "dropped"): 3}


@pytest.mark.parametrize("ledger", [{f"job-{i}": 1 for i in range(17)}, {"job": 0}, {"job": -3}])
def test_a_check_in_with_a_malformed_input_ledger_is_refused_naming_it(tmp_path, ledger):
    async def main():
        async with stack(tmp_path, aggregators=1) as s:
            device = (await s.devices(1))[0]
            request = coordinator_pb2.CheckInRequest(input_ledger=coordinator_pb2.InputLedger(latest_round=ledger))
            return await status_of(device.stub.CheckIn(request, metadata=device.md, timeout=5))

    code, details = run(main())
    assert code == grpc.StatusCode.INVALID_ARGUMENT and details.startswith("input_ledger: at most 16 jobs"), details
