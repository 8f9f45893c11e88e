"""The coordinator's decisions without a server: the round planner, cohort sums, the state codec,
the store, job specs, the check-in arbitration between jobs, reveals and task reports."""

from __future__ import annotations

import asyncio
import sqlite3
import time
from dataclasses import dataclass, field

import numpy as np
import pytest

from support.coordinator import STEP, TwoStepState, planner_spec
from tally.algorithms.base import StepSpec
from tally.algorithms.fedavg import FedAvgServer, FedAvgState
from tally.codec import PayloadSchema, ring_dtype, ring_mask, to_ring
from tally.coordinator.metrics import CoordinatorMetrics
from tally.coordinator.rounds.active_jobs import ActiveJobs
from tally.coordinator.rounds.aggregators import aio_channel, parse_aggregator
from tally.coordinator.rounds.planner import (
    MIN_RETRY_S,
    CohortRejected,
    Deliver,
    Extended,
    Failed,
    FormCohorts,
    Hold,
    NoCapacity,
    Phase,
    Retry,
    RoundPlanner,
    StepSums,
    WaitingRoom,
    split_cohorts,
)
from tally.coordinator.spec import jobspec
from tally.coordinator.state.enrolled_devices import EnrolmentRefused
from tally.coordinator.state.state_codec import UnsupportedState, state_from_bytes, state_to_bytes
from tally.coordinator.state.store import Store
from tally.models.mlp import mlp
from tally.models.params import get_params
from tally.secagg import SumResult
from tally.security import (
    DeviceClaims,
    TLSConfig,
    channel_options,
)


def _planner(spec=None, steps=(STEP,), extensions=0, now=0.0) -> RoundPlanner:
    return RoundPlanner(spec or planner_spec(), list(steps), now, extensions=extensions, attempt_key="k")


def test_selection_takes_the_over_selected_target_then_turns_devices_away():
    planner = _planner(planner_spec(cohort_size=10, over_selection=1.3))
    assert planner.spec.selection_target == 13
    assert all(isinstance(planner.check_in(f"d{i}", 0.1), Hold) for i in range(13))
    late = planner.check_in("late", 0.2)
    assert isinstance(late, Retry) and late.reason == "cohort full" and 0.2 <= late.seconds <= 60
    decision = planner.tick(0.3)  # full before the deadline: no need to wait
    assert isinstance(decision, FormCohorts) and len(decision.devices) == 13


def test_a_device_proven_to_deal_bad_shares_is_never_seated_again_in_the_job():
    """Issue 38 problem 1: a dealer an aggregator convicted sits in no later selection of the job,
    even when its ledger or a report releases its seat (it truly sent no input: it was excluded
    before any), so it cannot cost a retry's honest inputs either."""
    planner = RoundPlanner(planner_spec(), [STEP], 0.0, extensions=0, attempt_key="k",
                           excluded=frozenset({"cheat"}), convicted=frozenset({"cheat"}))
    refused = planner.check_in("cheat", 0.1)
    assert isinstance(refused, Retry) and refused.reason == "proven to have dealt bad shares in this job"
    planner.readmit("cheat")  # what a released seat does for anyone else
    assert isinstance(planner.check_in("cheat", 0.2), Retry)
    assert isinstance(planner.check_in("honest", 0.2), Hold)


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
    spy = CommitSpy(store._database.conn)
    monkeypatch.setattr(store._database, "conn", spy)
    store.devices.enrol("dev-1", "pop", b"k" * 32, 1.0, 1.0)
    store.count_task_report("job", 1, "completed", "")
    store.add_seated("job", 1, [("dev-1", "t1"), ("dev-2", "t2")])
    assert spy.levels == [1, 1, 2]  # NORMAL, NORMAL, FULL: one transaction for all seats
    with pytest.raises(EnrolmentRefused):
        store.devices.enrol("dev-1", "pop", b"x" * 32, 2.0, 2.0)  # the id is bound to another key
    assert spy.db.execute("PRAGMA synchronous").fetchone()[0] == 2
    monkeypatch.undo()
    store.close()
    reopened = Store(tmp_path)
    assert reopened.devices.identities(["dev-1"]) == {"dev-1": b"k" * 32}
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
        jobspec.parse("name: t\nalgorithm: twostep\nrounds: 1\ncohort_size: 10\noptions: {x: 1}\n")


@dataclass
class StandInRunner:
    """What ``ActiveJobs.check_in`` asks of a job, scripted: its answer, whether its selection is open
    or about to open, whether it would hold the device for its next selection."""

    seq: int
    selecting: bool
    room: bool
    population: str = "default"
    held: list[str] = field(default_factory=list)

    def offer(self, device_id: str, now: float, ledger_id: str = "") -> Retry:
        return Retry(MIN_RETRY_S, "next round starting" if self.selecting else "selection closed")

    def hold_for_next(self, device_id: str, ledger_id: str = "") -> bool:
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


def test_reveal_opt_in_lives_at_the_top_level_and_is_refused_through_the_services():
    base = "name: r\nalgorithm: aaggff_s\nrounds: 1\ncohort_size: 8\nmin_cohort: 5\n"
    with pytest.raises(jobspec.JobSpecError, match="top level"):
        jobspec.parse(base + "options: {num_clients: 8, reveal: [response]}\n")
    opted_in = jobspec.parse(base + "options: {num_clients: 8}\nreveal: [response]\n")
    assert opted_in.reveal == ("response",) and opted_in.options["reveal"] == ["response"]
    assert jobspec.parse(opted_in.to_yaml()) == opted_in  # a resumed job parses the same
    with pytest.raises(jobspec.JobSpecError, match="nothing is: the server sees only sums"):
        jobspec.parse("name: f\nalgorithm: fedavg\nrounds: 1\ncohort_size: 8\nmin_cohort: 5\nreveal: [update]\n")
    accepted = jobspec.parse(base + "options: {num_clients: 8, solver: separable}\n")
    assert accepted.reveal == () and "reveal" not in accepted.options


def test_reveal_collector_builds_the_rows_as_the_simulator_and_refuses_what_does_not_fit():
    """``RevealCollector`` gives ``apply`` what ``tally.sim.rounds.reveal_values`` gives it (rows by
    ascending silo id, each through the schema's fixed point); a wrong field or shape is a
    ValueError (INVALID_ARGUMENT), a task outside the round RevealOutOfPhase (FAILED_PRECONDITION)."""
    import numpy as np

    from tally import algorithms
    from tally.coordinator.rounds.reveals import RevealCollector, RevealOutOfPhase
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
    from tally.coordinator.rounds.planner import Seat
    from tally.coordinator.rounds.task_reports import TaskReportBook
    from tally.wire.v1 import coordinator_pb2

    caplog.set_level("INFO", logger="tally.coordinator.rounds.task_reports")
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
    from tally.coordinator.rounds.planner import Seat
    from tally.coordinator.rounds.task_reports import Recorded, TaskReportBook
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


def test_a_state_directory_from_before_revocation_opens_and_its_revoked_devices_are_indexed(tmp_path):
    """An earlier version's devices table has no revoked_at: the store adds it, then the partial
    index every device-serving process reads revocations through (not the other way round)."""
    tmp_path.mkdir(exist_ok=True)
    old = sqlite3.connect(tmp_path / "coordinator.db")
    old.execute("CREATE TABLE devices (device_id TEXT PRIMARY KEY, population TEXT NOT NULL, "
                "identity_public BLOB NOT NULL UNIQUE, enrolled_at REAL NOT NULL, registered_at REAL NOT NULL)")
    old.execute("INSERT INTO devices VALUES ('dev-1', 'pop', x'01', 1.0, 1.0)")
    old.commit()
    old.close()
    store = Store(tmp_path)
    assert store.devices.revoke("dev-1", 2.0) and store.devices.is_revoked("dev-1")
    plan = store._db.execute("EXPLAIN QUERY PLAN SELECT device_id FROM devices WHERE revoked_at IS NOT NULL").fetchall()
    assert any("devices_revoked" in row[-1] for row in plan), plan
    store.close()
