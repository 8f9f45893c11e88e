"""One job's rounds: ``JobRunner`` drives them through ``RoundPlanner`` and does the I/O.

A round, as the runner drives it:

1. the server half's steps and first broadcast are fixed; the broadcast is stored as a blob
   devices download (``model_digest`` of their task);
2. check-ins are held while the selection fills (``RoundPlanner`` decides who is in); those
   that arrived while the previous attempt aggregated were held for it (``WaitingRoom``) and
   are its first arrivals, so a selection need not start empty after each commit;
3. aggregators are health-checked, the selected devices split into cohorts, and one session per
   cohort is opened with a signed ticket carrying every sum of the round;
4. each step's cohort sums are awaited, decoded and added, and the server half applies the total;
   the next step's broadcast then becomes available to ``GetStep``;
   a reveal step (only in a job whose top-level ``reveal:`` opted in, DESIGN.md section 1) is
   not in the sessions: each device sends its payload with ``Reveal`` and the server half gets
   the rows by stable silo id; a personal step's broadcast is built per silo at ``GetStep``;
5. the new state is checkpointed and the round committed.

Any failure of an attempt (an aggregator down, a session aborted, a sum rejected, the deadline)
closes the attempt's sessions and discards it whole; the round is retried with a new selection
while the job's retry budget lasts, then the job fails with the reason.

The runner is the round loop and the devices' way into it; the rest of a round has a module of
its own: ``tally.coordinator.rounds.checkin_holds`` (held check-ins),
``tally.coordinator.rounds.step_answers`` (``GetStep`` and ``Reveal`` between sums),
``tally.coordinator.rounds.cohort_sessions`` (the aggregator sessions) and
``tally.coordinator.rounds.checkpoints`` (model versions, and the state a restart continues from).

Everything runs on one event loop, so runner, planner and API handlers never interleave inside
a method; only blob writes and ONNX export go to worker threads.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import random
import secrets
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tally import logs, modelio
from tally.algorithms.base import StepSpec
from tally.coordinator.metrics import CoordinatorMetrics
from tally.coordinator.rounds.aggregators import AggregatorPool
from tally.coordinator.rounds.checkin_holds import CheckInHolds, CheckInResult
from tally.coordinator.rounds.checkpoints import Checkpoints
from tally.coordinator.rounds.cohort_sessions import CohortSessions
from tally.coordinator.rounds.declared_algorithms import DeclaredAlgorithms, Installed, required
from tally.coordinator.rounds.failures import AttemptFailed, JobFailed
from tally.coordinator.rounds.planner import (
    FIRST_ROUND_GUESS_S,
    MIN_RETRY_S,
    Deliver,
    Extended,
    Failed,
    FormCohorts,
    Hold,
    Phase,
    Retry,
    RoundPlanner,
    pace,
)
from tally.coordinator.rounds.reveals import RevealOutOfPhase
from tally.coordinator.rounds.step_answers import StepAnswers
from tally.coordinator.rounds.task_reports import Recorded, TaskReportBook
from tally.coordinator.spec import catalogue
from tally.coordinator.spec.evaluation_spec import evaluated_job_server, schedule_of
from tally.coordinator.spec.jobspec import JobSpec
from tally.coordinator.state.events import EventHub
from tally.coordinator.state.store import LeadershipLost, RoundRecord, Store
from tally.evaluation.plan import PREFIX as METRIC_PREFIX
from tally.evaluation.summary import EVALUATION_ONLY
from tally.privacy import metrics as privacy_metrics
from tally.privacy.spec import private_job_server
from tally.secagg.phases import Phase as SecAggPhase
from tally.security import TicketSigner
from tally.wire.protocol import to_proto
from tally.wire.v1 import coordinator_pb2

log = logging.getLogger(__name__)

CHUNK_SIZE = 1 << 20
# Weight of the newest round in the running estimate of a round's duration (pace steering).
DURATION_SMOOTHING = 0.5
# After a failed attempt, the next one waits 1 s, then 2, 4, ... at most 30 s: a transient cause
# (an aggregator restarting, a burst of dropouts) gets time to pass instead of the whole retry
# budget being spent in seconds.
RETRY_BACKOFF_FIRST_S = 1.0
RETRY_BACKOFF_MAX_S = 30.0
# How often, at most, a selection's progress is published while devices check in.
SELECTION_PROGRESS_S = 2.0
INTERRUPTED = "interrupted: coordinator stopped"  # how a restart closes the attempts it cut short

# Task failures that fail the same way on every retry: the job stops at once with them.
PERMANENT_REASONS = frozenset({"model_mismatch", "training_error", "invalid_task", "metric_unavailable",
                               "algorithm_version", "model_version", "trainer_capability"})


@dataclass
class RoundBlob:
    """What a round's devices download: the first step's broadcast."""

    version: str
    digest: str
    size: int


@dataclass(frozen=True)
class RunnerContext:
    """What a runner uses of the coordinator around it."""

    store: Store
    pool: AggregatorPool
    signer: TicketSigner
    metrics: CoordinatorMetrics
    events: EventHub
    clock: Callable[[], float]
    rng: random.Random
    # Called as a job's selection opens: ``ActiveJobs`` lets the devices other jobs of the population
    # hold for their next rounds go to it.
    selection_opened: Callable[[JobRunner], None] = lambda runner: None
    # What the devices that checked in declared they can run (``declared_algorithms``).
    declared: DeclaredAlgorithms = field(default_factory=DeclaredAlgorithms)


class JobRunner:
    """Drives one job's rounds until it succeeds, fails or is cancelled; ``on_done`` is called
    when it stops, whatever the reason."""

    def __init__(
        self,
        ctx: RunnerContext,
        seq: int,
        job_id: str,
        committed: int,
        spec: JobSpec,
        on_done: Callable[[JobRunner], None],
        *,
        resumed: bool = False,
    ) -> None:
        """``resumed``: a restarted coordinator picks the job up (logged, and an event says so)."""
        self.ctx, self.seq, self.job_id, self.spec = ctx, seq, job_id, spec
        self._on_done = on_done
        self.resumed = resumed
        # Its rounds: the training ones, and those that only evaluate (``evaluation.final/separate``).
        self.schedule = schedule_of(spec)
        # A job with a privacy: section releases noisy sums only (tally/privacy).
        # It measures model quality on the devices (tally/evaluation) unless its evaluation is off.
        self.server = private_job_server(
            evaluated_job_server(catalogue.make_server(spec.algorithm, spec.options), spec), spec,
            rounds=self.schedule.total)
        # What a device must have installed to be seated (``declared_algorithms``).
        self.requirement = required(spec.algorithm, spec.model.kind)
        self.ledger = getattr(self.server, "ledger", None)
        if self.ledger is not None:
            privacy_metrics.publish(job_id, self.ledger)
        self.committed = committed
        self.round = committed + 1
        self.attempt = 0
        self.phase, self.step = "", ""
        self.planner: RoundPlanner | None = None
        self.answers: StepAnswers | None = None  # the current attempt's, with the planner
        self.tasks: dict[str, coordinator_pb2.TaskAssignment] = {}
        self.reports = TaskReportBook(ctx.store, job_id)
        # Devices are addressed by a stable silo id in [0, silo_limit) when a step is personal or
        # a reveal (AAggFF-S's opt-in path); None for sums-only algorithms.
        self.silo_limit: int | None = None
        self.holds = CheckInHolds(lambda: self.planner, self._silos_full)
        self.wake = asyncio.Event()
        self.sessions = CohortSessions(job_id, spec, ctx.store, ctx.pool, ctx.signer, ctx.metrics, ctx.events,
                                       ctx.clock)
        self.checkpoints = Checkpoints(job_id, spec, self.server, ctx.store, ctx.clock)
        self.expected_round_s = FIRST_ROUND_GUESS_S  # pace steering's estimate
        self.timed_rounds = 0
        self.round_started_at = ctx.clock()
        self.cancel_reason: str | None = None
        # Devices that stated their own privacy budget is spent for this job: never selected again
        # (``tally.client.privacy_ledger``); too many, and the job fails saying so. Kept in the
        # store: a device states it at its check-ins, not once per coordinator.
        self.out_of_budget: set[str] = set(ctx.store.out_of_budget(job_id))
        self.fail_reason: str | None = None
        self.next_attempt_at = 0.0  # while a failed attempt's retry backs off (clock time)
        self.task: asyncio.Task[None] | None = None
        self._options = json.dumps(dict(spec.options), sort_keys=True)
        self._adaptation = spec.adaptation.option().to_json() if spec.adaptation is not None else ""

    @property
    def population(self) -> str:
        return self.spec.population

    @property
    def algorithm_version(self) -> str:
        return self.requirement.algorithm_version

    def runs_on(self, installed: Installed) -> bool:
        """Whether a device with ``installed`` can be seated: it has the job's algorithm and model
        kind at the versions this coordinator runs, and its trainer offers what the algorithm needs."""
        return self.requirement.met_by(installed)

    # -- device-facing ------------------------------------------------------------------------

    def report(self, device_id: str, report: coordinator_pb2.TaskReport) -> bool:
        """A device's report on one of its tasks; False when it is not one (nothing counted)."""
        recorded = self.reports.record(device_id, report)
        if recorded is Recorded.RELEASED:
            self.ctx.metrics.seats_released.labels(cause="report").inc()
            if report.round == self.round and self.planner is not None:
                self.planner.readmit(device_id)
        return recorded is not Recorded.UNMATCHED

    def ledger_says(self, device_id: str, ledger: coordinator_pb2.InputLedger) -> None:
        """A device's durable ledger names the last round it sent this job an input in (absent:
        never, since the ledger was created). Before the current round, its seat in this round
        carried none, so it is released like a report's (``tally.coordinator.rounds.task_reports``):
        this is how a device restarted with its reports lost is seated again in a round it sent
        nothing to. Only a seat recorded with this ledger's id is released: a ledger created
        after the seat (a wiped state directory) cannot know what was sent from it."""
        planner = self.planner
        if planner is None or device_id not in planner.selection.excluded:
            return
        latest_round = ledger.latest_round.get(self.job_id)
        if latest_round is not None and latest_round >= self.round:
            return
        released = self.ctx.store.release_device(self.job_id, self.round, device_id, ledger.ledger_id)
        if not released:
            return
        self.ctx.metrics.seats_released.labels(cause="ledger").inc(released)
        planner.readmit(device_id)
        logs.event(log, "seat released: the device's ledger shows no input in this round", logging.DEBUG,
                   job_id=self.job_id, round=self.round, device_id=device_id, seats=released)

    def budget_spent(self, device_id: str) -> None:
        """``device_id`` refuses this job's releases: its own privacy budget is spent. When fewer
        of the population's devices than ``min_cohort`` remain eligible no round can be private
        to anyone any more, so the job fails now rather than at its deadlines."""
        if device_id in self.out_of_budget:
            return
        self.ctx.store.add_out_of_budget(self.job_id, device_id)
        self.out_of_budget.add(device_id)
        self.ctx.metrics.devices_out_of_budget.labels(self.job_id).set(len(self.out_of_budget))
        logs.event(log, "device out of privacy budget", job_id=self.job_id, device_id=device_id,
                   out_of_budget=len(self.out_of_budget))
        reason = self._out_of_eligible_devices()
        if reason is not None and self.fail_reason is None and self.task is not None:
            self.fail_reason = reason
            self.task.cancel()

    def _out_of_eligible_devices(self) -> str | None:
        """Why the job cannot go on (fewer than ``min_cohort`` devices of its population have
        budget left for it), or None while enough have."""
        population = self.ctx.store.devices.population_size(self.population)
        eligible = population - len(self.out_of_budget)
        if eligible >= self.spec.min_cohort:
            return None
        return (f"out of eligible devices: {len(self.out_of_budget)} of the {population} devices of population "
                f"{self.population!r} have spent their own privacy budget for this job, {eligible} remain, "
                f"fewer than min_cohort {self.spec.min_cohort}")

    def offer(
        self, device_id: str, now: float, ledger_id: str = ""
    ) -> Hold | coordinator_pb2.TaskAssignment | Retry:
        """``ledger_id``: the input ledger the check-in stated ("" for none), kept with a seat."""
        planner = self.planner
        if device_id in self.out_of_budget:
            return Retry(self.next_check_in_s(now), "the device's privacy budget is spent for this job")
        if now < self.next_attempt_at:
            return Retry(self.next_attempt_at - now, "round attempt failed; the next one backs off")
        if planner is None:  # between rounds: the next selection opens as soon as the commit is done
            return Retry(MIN_RETRY_S, "next round starting")
        if self._silos_full(device_id):
            return planner.retry(now, f"all {self.silo_limit} silos of the job are taken")
        decision = planner.check_in(device_id, now, ledger_id)
        if isinstance(decision, Deliver):
            return self.tasks[device_id]
        if isinstance(decision, Hold) and planner.selection.full:
            self.wake.set()
        return decision

    @property
    def selecting(self) -> bool:
        """In a selection, or between attempts with one about to open: a check-in turned away
        now may be seated by this job within moments."""
        planner = self.planner
        if planner is None or planner.phase in (Phase.SELECTION, Phase.FAILED):
            return True
        return planner.phase is Phase.DONE and self.round < self.schedule.total

    def hold_for_next(self, device_id: str, ledger_id: str = "") -> bool:
        """Whether ``device_id``, turned away by ``offer`` while an attempt aggregates, is held
        for the next attempt's selection instead (then ``hold`` it). ``ActiveJobs`` asks only after
        every job's ``offer`` declined, so an open selection of another job is served first."""
        return self.holds.hold_for_next(device_id, ledger_id)

    def release_waiting(self, reason: str) -> None:
        """Answer the devices held for this job's next selection (another job's selection of
        their population opened): they come back at once, unpaced, and it may seat them."""
        self.holds.release_waiting(reason)

    def _silos_full(self, device_id: str) -> bool:
        """Every silo id of the job is taken, none by ``device_id`` (only jobs with silos)."""
        return self.silo_limit is not None and self.ctx.store.silo(self.job_id, device_id, self.silo_limit) is None

    async def hold(self, device_id: str, hold_s: float) -> CheckInResult:
        """Wait for a held device's task; free its seat if the wait ends first."""
        return await self.holds.hold(device_id, hold_s)

    def get_step(
        self, device_id: str, round_: int, task_id: str, sum_id: str, now: float
    ) -> coordinator_pb2.Step | Retry:
        if round_ != self.round or self.answers is None:
            raise LookupError(
                f"round {round_} of job {self.job_id} is not in progress (round {self.round} is)"
            )
        return self.answers.get_step(device_id, task_id, sum_id, now)

    def reveal(self, device_id: str, round_: int, task_id: str, step_name: str, values: list) -> None:
        """A device's payload for a reveal step, in the clear. ``PermissionError`` unless the job
        opted in to every value the step reveals; ``RevealOutOfPhase`` when that step is not being
        collected; ``LookupError`` for another device's or an unknown task; ``ValueError`` for a
        payload that does not fit the step."""
        answers = self.answers
        wanted = answers.reveals_of(step_name) if answers is not None else ()
        if not self.spec.reveal or not set(wanted) <= set(self.spec.reveal):
            raise PermissionError(
                f"job {self.job_id} did not opt in to reveal {list(wanted) or 'anything'} "
                f"(its reveal list is {list(self.spec.reveal)}): the coordinator receives only sums"
            )
        if round_ != self.round or answers is None:
            raise RevealOutOfPhase(f"round {round_} of job {self.job_id} is not in progress")
        answers.reveal(device_id, task_id, step_name, values)

    def next_check_in_s(self, now: float) -> float:
        if self.planner is not None and self.phase == "SELECTION":
            return MIN_RETRY_S
        return pace(self.expected_round_s, now - self.round_started_at)

    # -- lifecycle ----------------------------------------------------------------------------

    async def run(self) -> None:
        ctx = self.ctx
        try:
            if self.out_of_budget:  # counted before a restart
                ctx.metrics.devices_out_of_budget.labels(self.job_id).set(len(self.out_of_budget))
                if (reason := self._out_of_eligible_devices()) is not None:
                    raise JobFailed(reason)
            state, interrupted = await self._restore()
            ctx.store.set_job_state(self.job_id, "RUNNING", ctx.clock())
            ctx.events.publish(self.job_id, round=self.committed, state="RUNNING",
                               message=self._resumed(interrupted) if self.resumed else "running")
            while self.committed < self.schedule.total:  # the last commit marks the job SUCCEEDED
                state = await self._round(state)
            logs.event(log, "job succeeded", job_id=self.job_id, rounds=self.committed)
        except asyncio.CancelledError:
            if self.fail_reason is not None:
                ctx.metrics.rounds_failed.inc()
                self._finish("FAILED", self.fail_reason)
            elif self.cancel_reason is None:
                raise  # the coordinator is stopping: the job stays RUNNING and resumes later
            else:
                self._finish("CANCELLED", self.cancel_reason)
        except LeadershipLost as exc:  # the job is the new leader's now: nothing here may write its end
            logs.event(log, "job left to the new leader", logging.WARNING, job_id=self.job_id, reason=str(exc))
        except JobFailed as exc:
            ctx.metrics.rounds_failed.inc()
            self._finish("FAILED", str(exc))
        except Exception as exc:  # an algorithm or store bug must fail the job, not the service
            log.exception("job runner crashed", extra={"fields": {"job_id": self.job_id}})
            self._finish("FAILED", f"internal error: {type(exc).__name__}: {exc}")
        finally:
            self.holds.close("job is not running")
            await self.sessions.close("job stopped")
            with contextlib.suppress(KeyError):  # no gauge when the job ended before a round
                ctx.metrics.current_round.remove(self.job_id)
            with contextlib.suppress(KeyError):  # none when no device ran out of budget
                ctx.metrics.devices_out_of_budget.remove(self.job_id)
            self._on_done(self)

    def _finish(self, state: str, message: str) -> None:
        store, now = self.ctx.store, self.ctx.clock()
        for attempt in store.running_attempts(self.job_id):
            store.finish_attempt(self.job_id, attempt.round, attempt.attempt, now, message)
        store.set_job_state(self.job_id, state, now, message)
        self.ctx.events.publish(
            self.job_id, round=self.round, phase=self.phase, step=self.step, state=state, message=message
        )
        logs.event(log, f"job {state.lower()}", job_id=self.job_id, reason=message)

    def _resumed(self, interrupted: list[RoundRecord]) -> str:
        """The job event and log line of a restart: where the job goes on, and what it cut short."""
        cut = "; ".join(f"round {a.round} attempt {a.attempt} interrupted ({len(a.sessions)} session(s) closed)"
                        for a in interrupted)
        message = f"resumed by a restarted coordinator after round {self.committed}" + (f"; {cut}" if cut else "")
        logs.event(log, "job resumed", logging.WARNING if interrupted else logging.INFO, job_id=self.job_id,
                   committed_round=self.committed, interrupted_attempts=[a.attempt for a in interrupted],
                   detail=message)
        return message

    async def _restore(self) -> tuple[Any, list[RoundRecord]]:
        """The state to continue from (the last committed checkpoint, or a fresh model) and the
        attempts a stopped coordinator left open, now closed as interrupted."""
        store = self.ctx.store
        interrupted = store.running_attempts(self.job_id)  # left open by a stopped coordinator
        for attempt in interrupted:
            await self.sessions.close_recorded(attempt.sessions, "coordinator restarted")
            store.finish_attempt(self.job_id, attempt.round, attempt.attempt, self.ctx.clock(), INTERRUPTED)
        if self.ledger is not None:  # the epsilon spent before a restart is still spent
            for record in store.rounds(self.job_id):
                if record.state == "committed":
                    self.ledger.replay(record.round, record.metrics)
        return await self.checkpoints.restore(self.committed), interrupted

    # -- rounds -------------------------------------------------------------------------------

    async def _round(self, state: Any) -> Any:
        ctx, spec = self.ctx, self.spec
        self.round = round_ = self.committed + 1
        self.round_started_at = ctx.clock()
        ctx.metrics.current_round.labels(job_id=self.job_id).set(round_)
        evaluate_round = getattr(self.server, "evaluate_round", None)  # a job without evaluation has none
        if evaluate_round is not None and spec.evaluation is not None:
            schedule = self.schedule
            evaluate_round(spec.evaluation.due(schedule.training_round(round_), spec.rounds),
                           only=schedule.only_evaluates(round_))
        steps = self.server.steps(state)
        if any(s.personal or s.reveal for s in steps):
            self.silo_limit = int(self.server.options.num_clients)
        first = modelio.serialize(self.server.broadcast(state, steps[0].name))
        digest = await asyncio.to_thread(ctx.store.put_blob, first, "broadcast")
        blob = RoundBlob(f"{self.job_id}/v{self.committed}", digest, len(first))
        failures = extensions = 0  # the retry budget spends one on each of both
        while True:
            attempt = ctx.store.start_attempt(self.job_id, round_, ctx.clock())
            try:
                new_state, metrics = await self._attempt(
                    round_, attempt, state, steps, blob, spec.retries - failures
                )
                break
            except AttemptFailed as exc:
                extensions += self._extensions_used()
                failures += self._extensions_used() + 1
                self._end_attempt(round_, attempt, str(exc))
                permanent = self._permanent_cause(round_)
                if permanent is not None:
                    raise JobFailed(f"round {round_} attempt {attempt} failed: {exc}; {permanent}: no retry "
                                    "can fix that, so the job stops here") from None
                if failures > spec.retries:
                    raise JobFailed(
                        f"round {round_} failed after {attempt} attempt(s) and {extensions} extension(s) of a "
                        f"selection window (retries: {spec.retries}, each attempt after the first or extension "
                        f"spends one, none left): {exc}"
                    ) from None
                ctx.metrics.rounds_retried.inc()
                await self._back_off(round_, attempt)
        await self._commit(round_, attempt, new_state, metrics)
        return new_state

    async def _back_off(self, round_: int, failed_attempt: int) -> None:
        """Wait before the round's next attempt, longer after each failed one in this process."""
        failed_here = sum(1 for a in self.ctx.store.rounds(self.job_id, round_) if a.state == "failed"
                          and a.message != INTERRUPTED)
        delay = min(RETRY_BACKOFF_FIRST_S * 2 ** max(failed_here - 1, 0), RETRY_BACKOFF_MAX_S)
        self.next_attempt_at = self.ctx.clock() + delay
        logs.event(log, "next attempt backs off", job_id=self.job_id, round=round_, failed_attempt=failed_attempt,
                   seconds=delay)
        try:
            await asyncio.sleep(delay)
        finally:
            self.next_attempt_at = 0.0

    def _permanent_cause(self, round_: int) -> str | None:
        """What the devices' reports say when a retry cannot help: no device completed its task
        and at least a cohort's worth failed for a reason no retry changes (its model does not
        match the job's, its training raises, the task is invalid), or no device that checked in
        has the job's algorithm and model kind at their versions and the capabilities the algorithm
        needs. None otherwise."""
        none_can = self._none_can_run()
        if none_can is not None:
            return none_can
        summary = self.ctx.store.task_report_summary(self.job_id, round_)
        if any(outcome == "completed" for outcome, _ in summary):
            return None
        failed = {reason: (count, example) for (outcome, reason), (count, example) in summary.items()
                  if reason in PERMANENT_REASONS}
        if sum(count for count, _ in failed.values()) < self.spec.min_cohort:
            return None
        return "devices report " + ", ".join(
            f"{reason} x{count}" + (f" (e.g. {example!r})" if example else "")
            for reason, (count, example) in sorted(failed.items()))

    def _none_can_run(self) -> str | None:
        return self.ctx.declared.none_can_run(self.population, self.requirement)

    def _extensions_used(self) -> int:
        return self.planner.selection.extensions_used if self.planner is not None else 0

    def _end_attempt(self, round_: int, attempt: int, reason: str) -> None:
        ctx = self.ctx
        ctx.store.finish_attempt(self.job_id, round_, attempt, ctx.clock(), reason)
        ctx.events.publish(
            self.job_id, round=round_, phase="FAILED", step=self.step, state="RUNNING",
            message=f"attempt {attempt} failed: {reason}",
        )
        logs.event(log, "round attempt failed", logging.WARNING, job_id=self.job_id, round=round_,
                   attempt=attempt, reason=reason)

    async def _attempt(
        self, round_: int, attempt: int, state: Any, steps: list[StepSpec], blob: RoundBlob, budget: int
    ) -> tuple[Any, dict[str, float]]:
        ctx = self.ctx
        self.attempt = attempt
        planner = RoundPlanner(
            self._round_spec(round_), steps, ctx.clock(), extensions=budget,
            attempt_key=f"r{round_}a{attempt}-{secrets.token_hex(4)}",
            expected_round_s=self.expected_round_s, rng=ctx.rng,
            excluded=ctx.store.seated(self.job_id, round_), convicted=ctx.store.convicted(self.job_id),
        )
        self.planner, self.tasks = planner, {}
        self.answers = StepAnswers(self.job_id, round_, self.spec, self.server, planner, ctx.store, ctx.metrics,
                                   self.silo_limit)
        self._seat_waiting(planner)
        ctx.selection_opened(self)
        self._set_phase(
            "SELECTION", "",
            f"round {round_} attempt {attempt}: selecting {self.spec.selection_target} devices",
        )
        try:
            with ctx.metrics.phase_duration.labels(phase="selection").time():
                await self._select(planner)
                # A device revoked while its check-in was held is named in no roster.
                planner.selection.leave_out([d for d in planner.selection.seated
                                             if ctx.store.devices.is_revoked(d)])
                await self.sessions.open(planner, round_, attempt, steps)
                ctx.metrics.devices_selected.inc(len(planner.seats))
                self._deliver(planner, self.answers, round_, blob)
            if round_ < self.schedule.total:  # the next round's selection can start filling now
                self.holds.open_waiting_room(self._round_spec(round_ + 1).selection_target)
            metrics = {
                "selected": float(len(planner.seats)),
                "cohorts": float(len(planner.cohorts)),
                "attempt": float(attempt),
            }
            for k, step in enumerate(steps):
                state = await self._run_step(planner, self.answers, k, step, state, metrics)
            # The metric sums of the round's last step, as tally/evaluation read them.
            metrics.update(getattr(self.server, "round_quality", {}))
            if self.schedule.only_evaluates(round_):
                metrics[EVALUATION_ONLY] = float(self.schedule.training_round(round_))
            await self.sessions.close("round complete")
            return state, metrics
        except AttemptFailed as exc:
            planner.fail(str(exc))
            # A seat whose task never reached its device cannot be in any sum of the round.
            released = ctx.store.release_seats(self.job_id, round_, [
                (s.device_id, s.task_id) for s in planner.seats.values()
                if s.device_id not in planner.delivered
            ])
            ctx.metrics.seats_released.labels(cause="undelivered").inc(released)
            self.holds.release_selection(f"round attempt failed: {exc}")
            await self.sessions.close(f"round attempt failed: {exc}")
            raise

    def _round_spec(self, round_: int) -> JobSpec:
        """The spec a round selects by: an evaluation-only round's cohort may be sized apart."""
        e = self.spec.evaluation
        if not self.schedule.only_evaluates(round_) or e is None or e.cohort_size is None:
            return self.spec
        return self.spec.model_copy(update={"cohort_size": e.cohort_size})

    def _set_phase(
        self, phase: str, step: str, message: str = "", metrics: Mapping[str, float] | None = None
    ) -> None:
        self.phase, self.step = phase, step
        self.ctx.events.publish(
            self.job_id, round=self.round, phase=phase, step=step, state="RUNNING", message=message,
            metrics=metrics,
        )

    def selection_progress(self) -> str:
        """The selection line of ``tally job status`` while a round selects its devices, else ""."""
        planner = self.planner
        if planner is None or planner.phase is not Phase.SELECTION:
            return ""
        return planner.selection.progress(self.population, self.ctx.clock())

    async def _select(self, planner: RoundPlanner) -> None:
        """Wait for the selection's decision; meanwhile an event says how many devices checked in
        whenever that changed (at most every ``SELECTION_PROGRESS_S``), for ``tally job watch``."""
        ctx = self.ctx
        shown: int | None = None
        while True:
            decision = planner.tick(ctx.clock())
            if isinstance(decision, FormCohorts):
                return
            if isinstance(decision, Failed):
                raise AttemptFailed(decision.reason)
            if isinstance(decision, Extended):
                none_can = self._none_can_run()
                if none_can is not None:  # a longer window cannot help: fail now, not after every retry
                    raise JobFailed(f"round {self.round}: {decision.reason}; {none_can}: no retry can fix that, "
                                    "so the job stops here")
                ctx.metrics.rounds_retried.inc()
                shown = len(planner.selection.seated)
                self._set_phase("SELECTION", "", f"{decision.reason}; the window reopens, spending a retry: "
                                f"{self.selection_progress()}")
            elif shown != len(planner.selection.seated):
                shown = len(planner.selection.seated)
                self._set_phase("SELECTION", "", self.selection_progress())
            self.wake.clear()
            try:
                timeout = min(max(planner.next_tick_s(ctx.clock()), 0.01), SELECTION_PROGRESS_S)
                await asyncio.wait_for(self.wake.wait(), timeout=timeout)
            except TimeoutError:
                pass

    def _deliver(self, planner: RoundPlanner, answers: StepAnswers, round_: int, blob: RoundBlob) -> None:
        # Before any task goes out: from here on a seat may become an input in a sum.
        self.ctx.store.add_seated(
            self.job_id, round_, [(s.device_id, s.task_id) for s in planner.seats.values()],
            {s.device_id: s.ledger_id for s in planner.seats.values()})
        self.reports.issue(round_, planner.seats.values())
        by_cohort = {s.cohort: s for s in self.sessions.opened}
        for seat in planner.seats.values():
            session = by_cohort[seat.cohort]
            self.tasks[seat.device_id] = coordinator_pb2.TaskAssignment(
                job_id=self.job_id, round=round_, task_id=seat.task_id, algorithm=self.spec.algorithm,
                step=answers.protos[0], model_version=blob.version, model_digest=blob.digest,
                model_size=blob.size, chunk_size=CHUNK_SIZE, aggregator_address=session.address,
                session_ticket=session.ticket, device_index=seat.index,
                session_token=session.tokens[seat.index], session=to_proto(session.config),
                deadlines=self.sessions.deadlines, algorithm_options=self._options, adaptation=self._adaptation,
                algorithm_version=self.algorithm_version, model_kind=self.spec.model.kind,
                model_kind_version=self.requirement.model_version,
            )
        self.holds.deliver(planner, self.tasks)

    async def _run_step(
        self, planner: RoundPlanner, answers: StepAnswers, k: int, step: StepSpec, state: Any,
        metrics: dict[str, float],
    ) -> Any:
        self._set_phase(
            "AGGREGATION", step.name,
            f"collecting sum {step.name!r} from {len(self.sessions.opened)} cohort(s)",
        )
        phases = self.ctx.metrics.phase_duration
        with phases.labels(phase="aggregation").time():
            if step.reveal:
                timeout = min(self.spec.deadlines[SecAggPhase.MASKED_INPUT],
                              max(planner.deadline - self.ctx.clock(), 0.0))
                total = await answers.collect_reveals(k, step, timeout)
            else:
                total = await self.sessions.collect(planner, step, self.round, self.attempt)
        if self.ledger is not None:  # decoded here, so spent here, whatever happens to the attempt
            self.server.account(self.round, step.name, int(planner.sums.contributors))
        # Scalar fields of the total (FedAvg's summed weight and examples) are aggregates too:
        # worth reporting, and no more revealing than the sum the server half receives (unless the
        # job is private: a central-DP total is noised only inside the server half).
        step_metrics = {
            **planner.step_metrics(),
            **{f"{step.name}.{name}": float(v) for name, v in total.items()
               if np.ndim(v) == 0 and self.ledger is None and not name.startswith(METRIC_PREFIX)},
        }
        metrics.update(step_metrics)
        self._set_phase("UPDATE", step.name, metrics=step_metrics)
        try:
            with phases.labels(phase="update").time():
                state = self.server.apply(state, step.name, total)
            answers.applied(k, state)
        except (ValueError, ArithmeticError) as exc:
            raise AttemptFailed(f"{self.spec.algorithm} could not apply sum {step.name!r}: {exc}") from None
        planner.step_applied()
        return state

    async def _commit(self, round_: int, attempt: int, state: Any, metrics: dict[str, float]) -> None:
        ctx = self.ctx
        duration = ctx.clock() - self.round_started_at
        metrics["duration_seconds"] = duration
        if self.ledger is not None:
            metrics.update(self.ledger.commit())
        final = round_ == self.schedule.total
        with ctx.metrics.commit_lag.time():
            version = await self.checkpoints.write(round_, state)
            ctx.store.commit_round(version, attempt, metrics, final=final)
        self.committed = round_
        self.planner = self.answers = None
        self.expected_round_s = (
            DURATION_SMOOTHING * duration + (1 - DURATION_SMOOTHING) * self.expected_round_s
            if self.timed_rounds else duration
        )
        self.timed_rounds += 1
        ctx.metrics.rounds_committed.inc()
        ctx.metrics.round_duration.observe(duration)
        self.phase, self.step = "COMMITTED", ""
        ctx.events.publish(
            self.job_id, round=round_, phase="COMMITTED", state="SUCCEEDED" if final else "RUNNING",
            message=f"{self.schedule.describe(round_)} committed", metrics=metrics,
        )
        logs.event(log, "round committed", job_id=self.job_id, round=round_, attempt=attempt, metrics=metrics)

    def _seat_waiting(self, planner: RoundPlanner) -> None:
        """The devices held while the previous attempt aggregated are this selection's first
        arrivals (those it may not seat, being seated in an earlier attempt of the round, are
        answered at once)."""
        counts = self.holds.seat_waiting(planner, self.ctx.clock())
        if counts is None:
            return
        seated, turned_away = counts
        self.ctx.metrics.devices_seated_early.inc(seated)
        logs.event(log, "selection opens with devices held during the last aggregation",
                   job_id=self.job_id, round=self.round, seated=seated, turned_away=turned_away)
