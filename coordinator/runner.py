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

Everything runs on one event loop, so runner, planner and API handlers never interleave inside
a method; only blob writes and ONNX export go to worker threads.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import json
import logging
import random
import secrets
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from coordinator import registry
from coordinator.aggregators import AggregatorCallFailed, AggregatorPool
from coordinator.events import EventHub
from coordinator.jobspec import JobSpec
from coordinator.metrics import CoordinatorMetrics
from coordinator.onnx_export import export_model
from coordinator.planner import (
    FIRST_ROUND_GUESS_S,
    MIN_RETRY_S,
    CohortPlan,
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
    WaitingRoom,
    pace,
)
from coordinator.reveals import RevealCollector, RevealOutOfPhase
from coordinator.state_codec import UnsupportedState, state_from_bytes, state_to_bytes
from coordinator.store import CohortSumRecord, ModelVersion, RoundRecord, Store
from coordinator.task_reports import Recorded, TaskReportBook
from tally import logs, modelio
from tally.algorithms.base import StepSpec
from tally.codec.fingerprint import ring_fingerprint, sum_key
from tally.privacy import metrics as privacy_metrics
from tally.privacy.spec import private_job_server
from tally.security import SessionTicket, TicketSigner, config_digest
from tally.secagg import SessionConfig, SessionRef
from tally.secagg.messages import SessionAborted, SumResult
from tally.wire.convert import (
    WireError,
    cohort_sum_from_proto,
    schema_to_proto,
    session_config_bytes,
    tensors_from_proto,
    tensors_to_proto,
    to_proto,
)
from tally.wire.v1 import aggregator_pb2, coordinator_pb2, secagg_pb2

log = logging.getLogger("tally.coordinator")

CHUNK_SIZE = 1 << 20
OPEN_TIMEOUT_S = 10.0
CLOSE_TIMEOUT_S = 2.0
# When no aggregator answers at cohort formation: how long an attempt waits for one, and how often
# it asks.
NO_AGGREGATOR_WAIT_S = 20.0
AGGREGATOR_POLL_S = 0.5
# Weight of the newest round in the running estimate of a round's duration (pace steering).
DURATION_SMOOTHING = 0.5
# After a failed attempt, the next one waits 1 s, then 2, 4, ... at most 30 s: a transient cause
# (an aggregator restarting, a burst of dropouts) gets time to pass instead of the whole retry
# budget being spent in seconds.
RETRY_BACKOFF_FIRST_S = 1.0
RETRY_BACKOFF_MAX_S = 30.0
INTERRUPTED = "interrupted: coordinator stopped"  # how a restart closes the attempts it cut short

CheckInResult = coordinator_pb2.TaskAssignment | Retry


# Task failures that fail the same way on every retry: the job stops at once with them.
PERMANENT_REASONS = frozenset({"model_mismatch", "training_error", "invalid_task"})

class AttemptFailed(Exception):
    """The current attempt is discarded; the round may be retried."""


class JobFailed(Exception):
    """The job cannot go on; the message says why."""


@dataclass
class OpenedSession:
    cohort: int
    aggregator_id: str
    session_id: str
    address: str
    config: SessionConfig
    ticket: bytes
    tokens: dict[int, str]  # device index -> session token
    devices: tuple[str, ...]  # device ids, by index - 1


@dataclass
class RoundBlob:
    """What a round's devices download: the first step's broadcast."""

    version: str
    digest: str
    size: int


def phase_deadlines(spec: JobSpec) -> secagg_pb2.PhaseDeadlines:
    d = spec.deadlines
    return secagg_pb2.PhaseDeadlines(
        advertise_keys_seconds=d["advertise_keys"], share_keys_seconds=d["share_keys"],
        masked_input_seconds=d["masked_input"], consistency_check_seconds=d["consistency_check"],
        unmask_seconds=d["unmask"],
    )


def step_proto(step: StepSpec, broadcast: dict[str, Any] | None = None) -> coordinator_pb2.Step:
    out = coordinator_pb2.Step(
        name=step.name, sum_id=step.name, schema=schema_to_proto(step.name, step.schema),
        reveal=bool(step.reveal), personal=step.personal,
    )
    if broadcast is not None:
        out.broadcast.extend(tensors_to_proto(broadcast))
    return out


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
    # Called as a job's selection opens: the engine lets the devices other jobs of the population
    # hold for their next rounds go to it.
    selection_opened: Callable[[JobRunner], None] = lambda runner: None


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
        # A job with a privacy: section releases noisy sums only (tally/privacy).
        self.server = private_job_server(registry.make_server(spec.algorithm, spec.config), spec)
        self.ledger = getattr(self.server, "ledger", None)
        if self.ledger is not None:
            privacy_metrics.publish(job_id, self.ledger)
        self.committed = committed
        self.round = committed + 1
        self.attempt = 0
        self.phase, self.step = "", ""
        self.planner: RoundPlanner | None = None
        self.tasks: dict[str, coordinator_pb2.TaskAssignment] = {}
        self.reports = TaskReportBook(ctx.store, job_id)
        self.step_protos: list[coordinator_pb2.Step | None] = []
        # The state a personal step's broadcasts are built from, per step index.
        self.step_states: dict[int, Any] = {}
        self.reveals: dict[int, RevealCollector] = {}  # step index -> the reveal being collected
        # Devices are addressed by a stable silo id in [0, silo_limit) when a step is personal or
        # a reveal (AAggFF-S's opt-in path); None for sums-only algorithms.
        self.silo_limit: int | None = None
        self.waiters: dict[str, asyncio.Future[CheckInResult]] = {}
        # Check-ins held while an attempt aggregates, for the next attempt's selection.
        self.waiting: WaitingRoom | None = None
        self.wake = asyncio.Event()
        self.sessions: list[OpenedSession] = []
        self.expected_round_s = FIRST_ROUND_GUESS_S  # pace steering's estimate
        self.timed_rounds = 0
        self.round_started_at = ctx.clock()
        self.cancel_reason: str | None = None
        self.next_attempt_at = 0.0  # while a failed attempt's retry backs off (clock time)
        self.task: asyncio.Task[None] | None = None
        self._options = json.dumps(dict(spec.config), sort_keys=True)
        self._adaptation = spec.adaptation.option().to_json() if spec.adaptation is not None else ""
        self._deadlines = phase_deadlines(spec)

    @property
    def population(self) -> str:
        return self.spec.population

    # -- device-facing ------------------------------------------------------------------------

    def report(self, device_id: str, report: coordinator_pb2.TaskReport) -> bool:
        """A device's report on one of its tasks; False when it is not one (nothing counted)."""
        recorded = self.reports.record(device_id, report)
        if recorded is Recorded.RELEASED:
            self.ctx.metrics.seats_released.labels(cause="report").inc()
            if report.round == self.round and self.planner is not None:
                self.planner.readmit(device_id)
        return recorded is not Recorded.UNMATCHED

    def ledger_says(self, device_id: str, latest_round: int | None) -> None:
        """A device's durable ledger names ``latest_round`` as the last round it sent this job an
        input in (None: never). Before the current round, none of its seats in this round carried
        one, so they are released like a report's (``coordinator.task_reports``): this is how a
        device restarted with its reports lost is seated again in a round it sent nothing to."""
        planner = self.planner
        if planner is None or device_id not in planner.selection.excluded:
            return
        if latest_round is not None and latest_round >= self.round:
            return
        released = self.ctx.store.release_device(self.job_id, self.round, device_id)
        self.ctx.metrics.seats_released.labels(cause="ledger").inc(released)
        planner.readmit(device_id)
        logs.event(log, "seat released: the device's ledger shows no input in this round", logging.DEBUG,
                   job_id=self.job_id, round=self.round, device_id=device_id, seats=released)

    def offer(self, device_id: str, now: float) -> Hold | coordinator_pb2.TaskAssignment | Retry:
        planner = self.planner
        if now < self.next_attempt_at:
            return Retry(self.next_attempt_at - now, "round attempt failed; the next one backs off")
        if planner is None:  # between rounds: the next selection opens as soon as the commit is done
            return Retry(MIN_RETRY_S, "next round starting")
        if self._silos_full(device_id):
            return planner.retry(now, f"all {self.silo_limit} silos of the job are taken")
        decision = planner.check_in(device_id, now)
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
        return planner.phase is Phase.DONE and self.round < self.spec.rounds

    def hold_for_next(self, device_id: str) -> bool:
        """Whether ``device_id``, turned away by ``offer`` while an attempt aggregates, is held
        for the next attempt's selection instead (then ``hold`` it). The engine asks only after
        every job's ``offer`` declined, so an open selection of another job is served first."""
        room = self.waiting
        if room is None or (self.planner is not None and device_id in self.planner.seats):
            return False
        return not self._silos_full(device_id) and room.offer(device_id)

    def release_waiting(self, reason: str) -> None:
        """Answer the devices held for this job's next selection (another job's selection of
        their population opened): they come back at once, unpaced, and it may seat them."""
        room = self.waiting
        if room is None:
            return
        for device_id in room.empty():
            self._answer(device_id, Retry(MIN_RETRY_S, reason, at_once=True))

    def _answer(self, device_id: str, answer: Retry) -> None:
        """End ``device_id``'s held check-in, if it is still waiting, with ``answer``."""
        future = self.waiters.pop(device_id, None)
        if future is not None and not future.done():
            future.set_result(answer)

    def _silos_full(self, device_id: str) -> bool:
        """Every silo id of the job is taken, none by ``device_id`` (only jobs with silos)."""
        return self.silo_limit is not None and self.ctx.store.silo(self.job_id, device_id, self.silo_limit) is None

    async def hold(self, device_id: str, hold_s: float) -> CheckInResult:
        """Wait for a held device's task; free its seat if the wait ends first."""
        previous = self.waiters.get(device_id)
        if previous is not None and not previous.done():
            previous.set_result(Retry(MIN_RETRY_S, "superseded by a newer check-in"))
        future: asyncio.Future[CheckInResult] = asyncio.get_running_loop().create_future()
        self.waiters[device_id] = future
        try:
            return await asyncio.wait_for(asyncio.shield(future), timeout=hold_s)
        except TimeoutError:
            if future.done():
                return future.result()
            return self._hold_ended(device_id)
        except asyncio.CancelledError:
            self._withdraw(device_id)
            raise
        finally:
            if self.waiters.get(device_id) is future:
                del self.waiters[device_id]

    def _hold_ended(self, device_id: str) -> Retry:
        """A hold ran out: free the device's place, unless the selection already closed with it
        (the cohorts are being formed, as happens to a device held since the last aggregation):
        then its task is on the way and it comes back for it at once, unpaced."""
        if self.planner is not None and self.planner.has_seat(device_id):
            return Retry(MIN_RETRY_S, "seated: come back for the task", at_once=True)
        waited_for_next = self._withdraw(device_id)
        return Retry(MIN_RETRY_S, "next selection not open yet" if waited_for_next else "selection still open")

    def _withdraw(self, device_id: str) -> bool:
        """Free whatever seat a held check-in had; True if it was waiting for the next attempt."""
        room = self.waiting
        if room is not None and device_id in room.held:
            room.withdraw(device_id)
            return True
        if self.planner is not None:
            self.planner.withdraw(device_id)
        return False

    def get_step(
        self, device_id: str, round_: int, task_id: str, sum_id: str, now: float
    ) -> coordinator_pb2.Step | Retry:
        if round_ != self.round or self.planner is None:
            raise LookupError(
                f"round {round_} of job {self.job_id} is not in progress (round {self.round} is)"
            )
        planner = self.planner
        names = [s.name for s in planner.steps]
        if sum_id in names:
            # A reveal step this task still owes comes first: the device learns of it here.
            for k in range(planner.step_index, names.index(sum_id)):
                reveal = self.reveals.get(k)
                if planner.steps[k].reveal and not (reveal is not None and reveal.revealed(task_id)):
                    sum_id = names[k]
                    break
        answer = planner.step_request(device_id, task_id, sum_id, now)
        if isinstance(answer, Retry):
            return answer
        step = self.step_protos[answer]
        if step is None:  # cannot happen: a step is ready only after its broadcast was built
            raise LookupError(f"sum {sum_id!r} has no broadcast yet")
        if step.personal:
            silo = self.ctx.store.silo(self.job_id, device_id, self.silo_limit or 0)
            if silo is None:
                raise LookupError(f"device {device_id!r} has no silo id in job {self.job_id}")
            personal = coordinator_pb2.Step()
            personal.CopyFrom(step)
            personal.broadcast.extend(
                tensors_to_proto(self.server.broadcast_to(self.step_states[answer], step.name, silo))
            )
            return personal
        return step

    def reveal(self, device_id: str, round_: int, task_id: str, step_name: str, values: list) -> None:
        """A device's payload for a reveal step, in the clear. ``PermissionError`` unless the job
        opted in to every value the step reveals; ``RevealOutOfPhase`` when that step is not being
        collected; ``LookupError`` for another device's or an unknown task; ``ValueError`` for a
        payload that does not fit the step."""
        planner = self.planner
        steps = {s.name: (k, s) for k, s in enumerate(planner.steps)} if planner is not None else {}
        found = steps.get(step_name)
        wanted = found[1].reveal if found is not None else ()
        if not self.spec.reveal or not set(wanted) <= set(self.spec.reveal):
            raise PermissionError(
                f"job {self.job_id} did not opt in to reveal {list(wanted) or 'anything'} "
                f"(its reveal list is {list(self.spec.reveal)}): the coordinator receives only sums"
            )
        if round_ != self.round or planner is None:
            raise RevealOutOfPhase(f"round {round_} of job {self.job_id} is not in progress")
        if found is None or not wanted:
            raise ValueError(f"{step_name!r} is not a reveal step of this round")
        seat = planner.seat_of_task(task_id)
        if seat is None or seat.device_id != device_id:
            raise LookupError(f"no task {task_id!r} for this device in the current round")
        collector = self.reveals.get(found[0])
        if collector is None:
            raise RevealOutOfPhase(f"step {step_name!r} is not being collected now")
        silo = self.ctx.store.silo(self.job_id, device_id, self.silo_limit or 0)
        if silo is None:
            raise LookupError(f"device {device_id!r} has no silo id in job {self.job_id}")
        collector.add(task_id, silo, tensors_from_proto(values))

    def next_check_in_s(self, now: float) -> float:
        if self.planner is not None and self.phase == "SELECTION":
            return MIN_RETRY_S
        return pace(self.expected_round_s, now - self.round_started_at)

    # -- lifecycle ----------------------------------------------------------------------------

    async def run(self) -> None:
        ctx = self.ctx
        try:
            state, interrupted = await self._restore()
            ctx.store.set_job_state(self.job_id, "RUNNING", ctx.clock())
            ctx.events.publish(self.job_id, round=self.committed, state="RUNNING",
                               message=self._resumed(interrupted) if self.resumed else "running")
            while self.committed < self.spec.rounds:  # the last commit marks the job SUCCEEDED
                state = await self._round(state)
            logs.event(log, "job succeeded", job_id=self.job_id, rounds=self.committed)
        except asyncio.CancelledError:
            if self.cancel_reason is None:
                raise  # the coordinator is stopping: the job stays RUNNING and resumes later
            self._finish("CANCELLED", self.cancel_reason)
        except JobFailed as exc:
            ctx.metrics.rounds_failed.inc()
            self._finish("FAILED", str(exc))
        except Exception as exc:  # an algorithm or store bug must fail the job, not the service
            log.exception("job runner crashed", extra={"fields": {"job_id": self.job_id}})
            self._finish("FAILED", f"internal error: {type(exc).__name__}: {exc}")
        finally:
            self.waiting = None  # nobody is held for a round that will not come
            self._release_waiters("job is not running")
            await self._close_sessions("job stopped")
            with contextlib.suppress(KeyError):  # no gauge when the job ended before a round
                ctx.metrics.current_round.remove(self.job_id)
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
            for s in attempt.sessions:
                await self.ctx.pool.close_session(
                    s["aggregator_id"], s["session_id"], "coordinator restarted", CLOSE_TIMEOUT_S
                )
            store.finish_attempt(
                self.job_id, attempt.round, attempt.attempt, self.ctx.clock(),
                INTERRUPTED,
            )
        if self.ledger is not None:  # the epsilon spent before a restart is still spent
            for record in store.rounds(self.job_id):
                if record.state == "committed":
                    self.ledger.replay(record.round, record.metrics)
        version = store.model_version(self.job_id)
        if version is None:
            state = self.server.init(registry.initial_model(self.spec.model))
            store.add_model_version(await self._checkpoint(0, state))
            return state, interrupted
        if version.round != self.committed:
            raise JobFailed(
                f"store is inconsistent: latest model is round {version.round}, "
                f"committed round {self.committed}"
            )
        template = self.server.init(modelio.deserialize(store.read_blob(version.model_digest)))
        if version.state_digest is None:
            return template, interrupted
        return state_from_bytes(store.read_blob(version.state_digest), template), interrupted

    async def _checkpoint(self, round_: int, state: Any) -> ModelVersion:
        """Model, algorithm state and ONNX export as blobs (in a worker thread)."""

        def write() -> ModelVersion:
            store = self.ctx.store
            model = self.server.model(state)
            model_digest = store.put_blob(modelio.serialize(model), "model")
            try:
                state_digest: str | None = store.put_blob(state_to_bytes(state), "state")
            except UnsupportedState as exc:
                logs.event(log, "algorithm state not checkpointed; a restart resumes from the model only",
                           logging.WARNING, job_id=self.job_id, reason=str(exc))
                state_digest = None
            try:
                onnx_digest: str | None = store.put_blob(export_model(model, self.spec.model), "onnx")
            except (ValueError, RuntimeError) as exc:
                logs.event(log, "no ONNX export", logging.WARNING, job_id=self.job_id, round=round_,
                           reason=str(exc))
                onnx_digest = None
            now = self.ctx.clock()
            return ModelVersion(self.job_id, round_, model_digest, state_digest, onnx_digest, now)

        return await asyncio.to_thread(write)

    # -- rounds -------------------------------------------------------------------------------

    async def _round(self, state: Any) -> Any:
        ctx, spec = self.ctx, self.spec
        self.round = round_ = self.committed + 1
        self.round_started_at = ctx.clock()
        ctx.metrics.current_round.labels(job_id=self.job_id).set(round_)
        steps = self.server.steps(state)
        if any(s.personal or s.reveal for s in steps):
            self.silo_limit = int(self.server.config.num_clients)
        first = modelio.serialize(self.server.broadcast(state, steps[0].name))
        digest = await asyncio.to_thread(ctx.store.put_blob, first, "broadcast")
        blob = RoundBlob(f"{self.job_id}/v{self.committed}", digest, len(first))
        failures = 0
        while True:
            attempt = ctx.store.start_attempt(self.job_id, round_, ctx.clock())
            try:
                new_state, metrics = await self._attempt(
                    round_, attempt, state, steps, blob, spec.retries - failures
                )
                break
            except AttemptFailed as exc:
                failures += self._extensions_used() + 1
                self._end_attempt(round_, attempt, str(exc))
                permanent = self._permanent_cause(round_)
                if permanent is not None:
                    raise JobFailed(f"round {round_} attempt {attempt} failed: {exc}; {permanent}: no retry "
                                    "can fix that, so the job stops here") from None
                if failures > spec.retries:
                    raise JobFailed(
                        f"round {round_} failed after {attempt} attempt(s), retry budget "
                        f"{spec.retries} spent: {exc}"
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
        match the job's, its training raises, the task is invalid). None otherwise."""
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
            self.spec, steps, ctx.clock(), extensions=budget,
            attempt_key=f"r{round_}a{attempt}-{secrets.token_hex(4)}",
            expected_round_s=self.expected_round_s, rng=ctx.rng,
            excluded=ctx.store.seated(self.job_id, round_),
        )
        self.planner, self.tasks, self.sessions = planner, {}, []
        self._seat_waiting(planner)
        ctx.selection_opened(self)
        self.step_protos = [step_proto(steps[0])] + [None] * (len(steps) - 1)
        self.step_states, self.reveals = {}, {}
        self._set_phase(
            "SELECTION", "",
            f"round {round_} attempt {attempt}: selecting {self.spec.selection_target} devices",
        )
        try:
            with ctx.metrics.phase_duration.labels(phase="selection").time():
                await self._select(planner)
                await self._open_sessions(planner, round_, attempt, steps)
                self._deliver(planner, round_, blob)
            if round_ < self.spec.rounds:  # the next round's selection can start filling now
                self.waiting = WaitingRoom(self.spec.selection_target)
            metrics = {
                "selected": float(len(planner.seats)),
                "cohorts": float(len(planner.cohorts)),
                "attempt": float(attempt),
            }
            for k, step in enumerate(steps):
                state = await self._run_step(planner, k, step, state, metrics)
            await self._close_sessions("round complete")
            return state, metrics
        except AttemptFailed as exc:
            planner.fail(str(exc))
            # A seat whose task never reached its device cannot be in any sum of the round.
            released = ctx.store.release_seats(self.job_id, round_, [
                (s.device_id, s.task_id) for s in planner.seats.values()
                if s.device_id not in planner.delivered
            ])
            ctx.metrics.seats_released.labels(cause="undelivered").inc(released)
            self._release_waiters(f"round attempt failed: {exc}", keep=self.waiting)
            await self._close_sessions(f"round attempt failed: {exc}")
            raise

    def _set_phase(
        self, phase: str, step: str, message: str = "", metrics: Mapping[str, float] | None = None
    ) -> None:
        self.phase, self.step = phase, step
        self.ctx.events.publish(
            self.job_id, round=self.round, phase=phase, step=step, state="RUNNING", message=message,
            metrics=metrics,
        )

    async def _select(self, planner: RoundPlanner) -> None:
        ctx = self.ctx
        while True:
            decision = planner.tick(ctx.clock())
            if isinstance(decision, FormCohorts):
                return
            if isinstance(decision, Failed):
                raise AttemptFailed(decision.reason)
            if isinstance(decision, Extended):
                ctx.metrics.rounds_retried.inc()
                self._set_phase("SELECTION", "", f"{decision.reason}; waiting another window (uses a retry)")
            self.wake.clear()
            try:
                timeout = max(planner.next_tick_s(ctx.clock()), 0.01)
                await asyncio.wait_for(self.wake.wait(), timeout=timeout)
            except TimeoutError:
                pass

    async def _await_aggregator(self, planner: RoundPlanner) -> list[str]:
        """No aggregator answers: wait a while for one to come back (a restarted process, a
        rescheduled pod) rather than fail the attempt at once; failing at once let a retry budget
        burn down in under a second while every aggregator restarted (found by the fault
        campaign, seed 21, both aggregators killed in consecutive rounds)."""
        ctx = self.ctx
        until = min(ctx.clock() + NO_AGGREGATOR_WAIT_S, planner.deadline)
        logs.event(log, "no aggregator answers; waiting for one", logging.WARNING, job_id=self.job_id,
                   round=self.round, seconds=round(until - ctx.clock(), 1))
        while ctx.clock() < until:
            await asyncio.sleep(AGGREGATOR_POLL_S)
            if healthy := await ctx.pool.healthy():
                return healthy
        return []

    async def _open_sessions(
        self, planner: RoundPlanner, round_: int, attempt: int, steps: list[StepSpec]
    ) -> None:
        """One session per cohort; an aggregator that fails to open is left out and the cohorts
        are formed again over the others."""
        ctx = self.ctx
        excluded: dict[str, str] = {}  # aggregator -> why it could not open a session
        while True:
            healthy = await ctx.pool.healthy(exclude=sorted(excluded))
            if not healthy and not excluded:
                healthy = await self._await_aggregator(planner)
            try:
                plans = planner.form(healthy, ctx.clock())
            except NoCapacity as exc:
                why = "".join(f"; {reason}" for reason in excluded.values())
                raise AttemptFailed(f"cannot form cohorts: {exc}{why}") from None
            opened = await asyncio.gather(
                *(self._open_one(c, plan, round_, steps, planner.deadline) for c, plan in enumerate(plans)),
                return_exceptions=True,
            )
            self.sessions = [s for s in opened if isinstance(s, OpenedSession)]
            errors = [e for e in opened if isinstance(e, BaseException)]
            if not errors:
                break
            for error in errors:
                if not isinstance(error, AggregatorCallFailed):
                    raise error  # the attempt's handler closes the sessions that did open
                excluded[error.aggregator_id] = str(error)
            logs.event(log, "reforming cohorts without failed aggregators", logging.WARNING,
                       job_id=self.job_id, excluded=excluded)
            await self._close_sessions("cohorts reformed")
        ctx.store.set_attempt_sessions(
            self.job_id, round_, attempt,
            [{"aggregator_id": s.aggregator_id, "session_id": s.session_id} for s in self.sessions],
        )
        ctx.metrics.devices_selected.inc(len(planner.seats))

    async def _open_one(
        self, cohort: int, plan: CohortPlan, round_: int, steps: list[StepSpec], deadline: float
    ) -> OpenedSession:
        spec = self.spec
        session_id = secrets.token_hex(8)
        summed = [s for s in steps if not s.reveal]  # reveal steps go to the coordinator
        try:
            config = SessionConfig.plan(
                SessionRef(self.job_id, round_, session_id), [(s.name, s.schema) for s in summed],
                len(plan.devices), spec.secure.threat(), consistency_check=spec.secure.checks_consistency,
                plain=spec.secure.plain, identities=self._roster(plan),
            )
            # The privacy floor: the aggregator must abort rather than reveal a sum of fewer.
            config = dataclasses.replace(config, min_survivors=max(config.params.t, spec.min_cohort))
        except ValueError as exc:
            raise AttemptFailed(
                f"cohort of {len(plan.devices)} devices cannot be configured: {exc}"
            ) from None
        tokens = {i: secrets.token_urlsafe(24) for i in range(1, len(plan.devices) + 1)}
        ticket = self.ctx.signer.sign(SessionTicket(
            self.job_id, round_, session_id, tuple(s.name for s in summed), len(plan.devices),
            config_digest(session_config_bytes(config)), plan.aggregator_id, deadline,
        ))
        request = aggregator_pb2.OpenSessionRequest(
            session_ticket=ticket, config=to_proto(config),
            schemas=[schema_to_proto(s.name, s.schema) for s in summed], deadlines=self._deadlines,
            devices=[
                aggregator_pb2.DeviceGrant(device_index=i, token_sha256=hashlib.sha256(t.encode()).digest())
                for i, t in tokens.items()
            ],
        )
        reply = await self.ctx.pool.open_session(plan.aggregator_id, request, OPEN_TIMEOUT_S)
        if reply.session_id and reply.session_id != session_id:
            raise AggregatorCallFailed(
                plan.aggregator_id, f"answered session {reply.session_id!r} for {session_id!r}"
            )
        if not reply.address:
            raise AggregatorCallFailed(plan.aggregator_id, "OpenSession returned no address")
        return OpenedSession(cohort, plan.aggregator_id, session_id, reply.address, config, ticket, tokens,
                             tuple(plan.devices))

    def _roster(self, plan: CohortPlan) -> list[bytes]:
        """Each seat's enrolled identity key: the config carries it, the ticket signs it, and
        devices check their neighbours' keys against it."""
        keys = self.ctx.store.device_identities(plan.devices)
        missing = [d for d in plan.devices if d not in keys]
        if missing:
            raise AttemptFailed(f"devices without an enrolled identity key: {missing[:5]}")
        return [keys[d] for d in plan.devices]

    def _deliver(self, planner: RoundPlanner, round_: int, blob: RoundBlob) -> None:
        # Before any task goes out: from here on a seat may become an input in a sum.
        self.ctx.store.add_seated(
            self.job_id, round_, [(s.device_id, s.task_id) for s in planner.seats.values()])
        self.reports.issue(round_, planner.seats.values())
        by_cohort = {s.cohort: s for s in self.sessions}
        for seat in planner.seats.values():
            session = by_cohort[seat.cohort]
            self.tasks[seat.device_id] = coordinator_pb2.TaskAssignment(
                job_id=self.job_id, round=round_, task_id=seat.task_id, algorithm=self.spec.algorithm,
                step=self.step_protos[0], model_version=blob.version, model_digest=blob.digest,
                model_size=blob.size, chunk_size=CHUNK_SIZE, aggregator_address=session.address,
                session_ticket=session.ticket, device_index=seat.index,
                session_token=session.tokens[seat.index], session=to_proto(session.config),
                deadlines=self._deadlines, algorithm_options=self._options, adaptation=self._adaptation,
            )
        for seat in planner.opened():
            future = self.waiters.get(seat.device_id)
            if future is not None and not future.done():
                future.set_result(self.tasks[seat.device_id])
                planner.mark_delivered(seat.device_id)

    async def _run_step(
        self, planner: RoundPlanner, k: int, step: StepSpec, state: Any, metrics: dict[str, float]
    ) -> Any:
        self._set_phase(
            "AGGREGATION", step.name,
            f"collecting sum {step.name!r} from {len(self.sessions)} cohort(s)",
        )
        phases = self.ctx.metrics.phase_duration
        with phases.labels(phase="aggregation").time():
            total = await (self._collect_reveals(planner, k, step) if step.reveal else self._collect(planner, step))
        if self.ledger is not None:  # decoded here, so spent here, whatever happens to the attempt
            self.server.account(self.round, step.name, int(planner.sums.contributors))
        # Scalar fields of the total (FedAvg's summed weight and examples) are aggregates too:
        # worth reporting, and no more revealing than the sum the server half receives (unless the
        # job is private: a central-DP total is noised only inside the server half).
        step_metrics = {
            **planner.step_metrics(),
            **{f"{step.name}.{name}": float(v) for name, v in total.items()
               if np.ndim(v) == 0 and self.ledger is None},
        }
        metrics.update(step_metrics)
        self._set_phase("UPDATE", step.name, metrics=step_metrics)
        try:
            with phases.labels(phase="update").time():
                state = self.server.apply(state, step.name, total)
            following = planner.steps[k + 1] if k + 1 < len(planner.steps) else None
            if following is not None and following.personal:
                self.step_states[k + 1] = state
                self.step_protos[k + 1] = step_proto(following)
            elif following is not None:
                self.step_protos[k + 1] = step_proto(following, self.server.broadcast(state, following.name))
        except (ValueError, ArithmeticError) as exc:
            raise AttemptFailed(f"{self.spec.algorithm} could not apply sum {step.name!r}: {exc}") from None
        planner.step_applied()
        return state

    async def _collect_reveals(self, planner: RoundPlanner, k: int, step: StepSpec) -> dict[str, Any]:
        """Every device's payload of reveal step ``k``, until all are in or the masked-input
        deadline; logged and counted, as the opt-in requires."""
        collector = RevealCollector(step, [seat.task_id for seat in planner.seats.values()])
        self.reveals[k] = collector
        timeout = min(self.spec.deadlines["masked_input"], max(planner.deadline - self.ctx.clock(), 0.0))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(collector.complete.wait(), timeout)
        del self.reveals[k]
        count = len(collector.rows)
        if count < self.spec.min_cohort:
            raise AttemptFailed(
                f"reveal {step.name!r}: {count} device(s) answered, below min_cohort {self.spec.min_cohort}"
            )
        names = step.reveal
        self.ctx.metrics.revealed_values.labels(job_id=self.job_id, step=step.name).inc(count * len(names))
        logs.event(log, "per-device values revealed (job opt-in)", job_id=self.job_id, round=self.round,
                   step=step.name, devices=count, values=list(names))
        return collector.total()

    async def _collect(self, planner: RoundPlanner, step: StepSpec) -> dict[str, Any]:
        ctx = self.ctx

        async def one(session: OpenedSession) -> tuple[OpenedSession, aggregator_pb2.CohortSum]:
            timeout = planner.deadline - ctx.clock()
            result = await ctx.pool.await_result(
                session.aggregator_id, session.session_id, step.name, timeout
            )
            return session, result

        pending = [asyncio.create_task(one(s)) for s in self.sessions]
        try:
            remaining = max(planner.deadline - ctx.clock(), 0.0)
            for next_done in asyncio.as_completed(pending, timeout=remaining):
                try:
                    session, proto = await next_done
                except AggregatorCallFailed as exc:
                    ctx.metrics.cohort_sums.labels(outcome="failed").inc()
                    raise AttemptFailed(str(exc)) from None
                total = self._accept(planner, session, step, proto)
                if total is not None:
                    return total
        except TimeoutError:
            raise AttemptFailed(f"sum {step.name!r} not complete before the round deadline") from None
        finally:
            for task in pending:
                task.cancel()
        raise AttemptFailed(f"sum {step.name!r}: a cohort returned nothing")

    def _accept(
        self, planner: RoundPlanner, session: OpenedSession, step: StepSpec, proto: aggregator_pb2.CohortSum
    ) -> dict[str, Any] | None:
        self.ctx.metrics.cohort_sum_bytes.inc(proto.ByteSize())
        counter = self.ctx.metrics.cohort_sums
        where = f"cohort {session.cohort} on aggregator {session.aggregator_id}"
        try:
            result = cohort_sum_from_proto(proto)
        except WireError as exc:
            counter.labels(outcome="rejected").inc()
            raise AttemptFailed(f"{where}: malformed sum: {exc}") from None
        if isinstance(result, SessionAborted):
            counter.labels(outcome="aborted").inc()
            raise AttemptFailed(f"{where}: session aborted: {result.reason}")
        spec = session.config.sum_spec(step.name)
        if (proto.sum_id, proto.bits, proto.dim) != (step.name, spec.bits, spec.dim):
            counter.labels(outcome="rejected").inc()
            raise AttemptFailed(
                f"{where}: sum {proto.sum_id!r} at {proto.bits} bits x {proto.dim} does not match the "
                f"session's {step.name!r} at {spec.bits} bits x {spec.dim}"
            )
        try:
            total = planner.cohort_sum(session.cohort, result, spec.bits)
        except CohortRejected as exc:
            counter.labels(outcome="rejected").inc()
            raise AttemptFailed(f"{where}: {exc}") from None
        counter.labels(outcome="accepted").inc()
        self._report_excluded(session, step, result)
        fingerprint = ring_fingerprint(result.total, spec.bits, sum_key(session.session_id, step.name))
        self.ctx.store.add_cohort_sum(self.job_id, self.round, self.attempt, CohortSumRecord(
            session.session_id, step.name, session.cohort, spec.bits, tuple(result.contributors), fingerprint))
        return total

    def _report_excluded(self, session: OpenedSession, step: StepSpec, result: SumResult) -> None:
        """Name each device its session excluded, once (every sum of the session lists it)."""
        if step.name != session.config.sums[0].sum_id:
            return
        for index, reason in result.excluded:
            device = session.devices[index - 1] if 0 < index <= len(session.devices) else f"index {index}"
            message = f"device {device} excluded from cohort {session.cohort}'s session {session.session_id}: {reason}"
            self.ctx.metrics.devices_excluded.inc()
            self.ctx.events.publish(self.job_id, round=self.round, state="RUNNING", phase="AGGREGATION",
                                    step=step.name, message=message)
            logs.event(log, "device excluded", logging.WARNING, job_id=self.job_id, round=self.round,
                       device_id=device, session_id=session.session_id, reason=reason)

    async def _commit(self, round_: int, attempt: int, state: Any, metrics: dict[str, float]) -> None:
        ctx = self.ctx
        duration = ctx.clock() - self.round_started_at
        metrics["duration_seconds"] = duration
        if self.ledger is not None:
            metrics.update(self.ledger.commit())
        final = round_ == self.spec.rounds
        with ctx.metrics.commit_lag.time():
            version = await self._checkpoint(round_, state)
            ctx.store.commit_round(version, attempt, metrics, final=final)
        self.committed = round_
        self.planner = None
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
            message=f"round {round_} of {self.spec.rounds} committed", metrics=metrics,
        )
        logs.event(log, "round committed", job_id=self.job_id, round=round_, attempt=attempt, metrics=metrics)

    def _release_waiters(self, reason: str, keep: WaitingRoom | None = None) -> None:
        """Answer every held check-in but those waiting in ``keep`` for the next attempt."""
        kept = keep.held if keep is not None else {}
        for device_id in [d for d in self.waiters if d not in kept]:
            self._answer(device_id, Retry(MIN_RETRY_S, reason))

    def _seat_waiting(self, planner: RoundPlanner) -> None:
        """The devices held while the previous attempt aggregated are this selection's first
        arrivals (those it may not seat, being seated in an earlier attempt of the round, are
        answered at once)."""
        room, self.waiting = self.waiting, None
        if room is None:
            return
        turned_away = [d for d in room.held if not planner.selection.offer(d)]
        for device_id in turned_away:
            self._answer(device_id, planner.retry(self.ctx.clock(), "seated in an earlier attempt of this round"))
        self.ctx.metrics.devices_seated_early.inc(len(room.held) - len(turned_away))
        logs.event(log, "selection opens with devices held during the last aggregation",
                   job_id=self.job_id, round=self.round, seated=len(room.held) - len(turned_away),
                   turned_away=len(turned_away))

    async def _close_sessions(self, reason: str) -> None:
        sessions, self.sessions = self.sessions, []
        close = self.ctx.pool.close_session
        await asyncio.gather(
            *(close(s.aggregator_id, s.session_id, reason, CLOSE_TIMEOUT_S) for s in sessions)
        )
