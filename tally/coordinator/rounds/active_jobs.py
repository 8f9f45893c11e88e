"""The jobs one coordinator is running: a ``JobRunner`` per active job, and the answers the device
and admin APIs need from them (who gets a task, where a model is, how to cancel)."""

from __future__ import annotations

import asyncio
import logging
import random
import secrets
from collections.abc import Callable, Iterable

from tally import logs
from tally.coordinator.metrics import CoordinatorMetrics
from tally.coordinator.rounds.aggregators import AggregatorPool
from tally.coordinator.rounds.checkin_holds import CheckInResult
from tally.coordinator.rounds.come_back import Retry, idle_retry
from tally.coordinator.rounds.declared_algorithms import DeclaredAlgorithms, Installed
from tally.coordinator.rounds.planner import Hold
from tally.coordinator.rounds.runner import JobRunner, RunnerContext
from tally.coordinator.rounds.task_reports import outcome_name
from tally.coordinator.spec.jobspec import JobSpec, parse
from tally.coordinator.state.events import TERMINAL_STATES, EventHub
from tally.coordinator.state.store import Store
from tally.security import DeviceClaims, TicketSigner
from tally.wire.task_reports import reason_label
from tally.wire.v1 import coordinator_pb2

log = logging.getLogger(__name__)

# A held check-in answers this long before the caller's deadline.
HOLD_MARGIN_S = 1.0


class ActiveJobs:
    """Every active job of one coordinator, and the answers the APIs need from them."""

    def __init__(
        self,
        store: Store,
        pool: AggregatorPool,
        signer: TicketSigner,
        metrics: CoordinatorMetrics,
        clock: Callable[[], float],
        *,
        checkin_hold_s: float = 20.0,
        checkin_rate: float | None = None,
        rng: random.Random | None = None,
    ) -> None:
        self.store, self.pool, self.clock = store, pool, clock
        self.events = EventHub(store, clock)
        self.checkin_hold_s, self.checkin_rate = checkin_hold_s, checkin_rate
        self._ctx = RunnerContext(store, pool, signer, metrics, self.events, clock, rng or random.Random(),
                                  self._selection_opened, DeclaredAlgorithms(clock))
        self.runners: dict[str, JobRunner] = {}

    async def start(self) -> None:
        """Resume every job a previous coordinator left PENDING or RUNNING; one that cannot be
        resumed (its algorithm is no longer registered, say) fails with the reason."""
        for record in self.store.jobs(("PENDING", "RUNNING")):
            try:
                self._launch(record.seq, record.job_id, record.committed_round, parse(record.spec_yaml),
                             resumed=True)
            except (ValueError, TypeError) as exc:  # JobSpecError is a ValueError
                message = f"cannot resume: {exc}"
                self.store.set_job_state(record.job_id, "FAILED", self.clock(), message)
                self.events.publish(
                    record.job_id, round=record.committed_round, state="FAILED", message=message
                )

    async def stop(self) -> None:
        runners = list(self.runners.values())
        for runner in runners:
            if runner.task is not None:
                runner.task.cancel()
        await asyncio.gather(*(r.task for r in runners if r.task is not None), return_exceptions=True)
        self.events.close()

    def _launch(self, seq: int, job_id: str, committed: int, spec: JobSpec, *, resumed: bool = False) -> JobRunner:
        runner = JobRunner(self._ctx, seq, job_id, committed, spec, self._runner_done, resumed=resumed)
        self.runners[job_id] = runner
        runner.task = asyncio.get_running_loop().create_task(runner.run(), name=f"job {job_id}")
        return runner

    def _runner_done(self, runner: JobRunner) -> None:
        if self.runners.get(runner.job_id) is runner:
            del self.runners[runner.job_id]

    # -- admin ---------------------------------------------------------------------------------

    def submit(self, spec: JobSpec) -> str:
        job_id = f"{spec.name}-{secrets.token_hex(4)}"
        record = self.store.create_job(
            job_id, spec.name, spec.algorithm, spec.population, spec.to_yaml(), self.clock()
        )
        self.events.publish(job_id, round=0, state="PENDING", message="submitted")
        logs.event(log, "job submitted", job_id=job_id, algorithm=spec.algorithm, rounds=spec.rounds)
        if spec.secure.plain:
            self._ctx.metrics.plain_jobs.inc()
            logs.event(log, "job uses plain sums: the aggregator sees every device's contribution; "
                       "for benchmarks only", level=logging.WARNING, job_id=job_id)
        self._warn_if_paced_below(spec, job_id)
        self._launch(record.seq, job_id, 0, spec)
        return job_id

    def _warn_if_paced_below(self, spec: JobSpec, job_id: str) -> None:
        """A selected device is held at most ``checkin_hold_s``; under pace steering only
        ``rate x hold`` devices arrive in that time, so a larger selection never fills and closes
        at its deadline with whoever is held then (measured: 206 of 1,100 seats at 100/s, 2 s)."""
        arriving = self.checkin_rate * self.checkin_hold_s if self.checkin_rate else None
        if arriving is not None and spec.selection_target > arriving:
            logs.event(log, "selection cannot fill under pace steering: raise --checkin-rate or "
                       "--checkin-hold", level=logging.WARNING, job_id=job_id,
                       seats=spec.selection_target, arriving_within_hold=int(arriving))

    async def cancel(self, job_id: str, reason: str) -> None:
        """Stop a PENDING or RUNNING job (``LookupError``/``ValueError`` when it is unknown or done)."""
        record = self.store.job(job_id)
        if record is None:
            raise LookupError(f"no job {job_id!r}")
        if record.state in TERMINAL_STATES:
            raise ValueError(f"job {job_id} already {record.state.lower()}")
        runner = self.runners.get(job_id)
        message = f"cancelled: {reason}" if reason else "cancelled"
        if runner is None or runner.task is None:
            self.store.set_job_state(job_id, "CANCELLED", self.clock(), message)
            self.events.publish(job_id, round=record.committed_round, state="CANCELLED", message=message)
            return
        runner.cancel_reason = message
        runner.task.cancel()
        await asyncio.gather(runner.task, return_exceptions=True)

    # -- devices -------------------------------------------------------------------------------

    def record_reports(self, claims: DeviceClaims, reports: Iterable[coordinator_pb2.TaskReport]) -> None:
        """Count what a check-in says of the device's earlier tasks (``tally.coordinator.rounds.task_reports``)."""
        for report in reports:
            runner = self.runners.get(report.job_id)
            matched = (runner is not None and runner.population == claims.population
                       and runner.report(claims.device_id, report))
            outcome = outcome_name(report) if matched else "unmatched"
            reason = reason_label(report.reason) if matched else ""
            self._ctx.metrics.task_reports.labels(outcome, reason).inc()

    def revoked(self, device_id: str) -> None:
        """An operator revoked ``device_id``: a check-in of it held by any job ends now, giving
        its place back (``DeviceService`` refuses it), so no task reaches it."""
        for runner in self.runners.values():
            runner.holds.revoke(device_id)

    def record_ledger(self, claims: DeviceClaims, ledger: coordinator_pb2.InputLedger) -> None:
        """What a device's durable ledger says of its inputs, for each running job of its
        population (``JobRunner.ledger_says``)."""
        for runner in self.runners.values():
            if runner.population == claims.population:
                runner.ledger_says(claims.device_id, ledger)

    def record_declared(self, claims: DeviceClaims, declared: coordinator_pb2.Capabilities) -> Installed:
        """What the device says it can run (``declared_algorithms``), for this check-in's seating
        and the jobs' counts of able devices."""
        return self._ctx.declared.record(claims.device_id, claims.population, declared)

    def able_devices(self, runner: JobRunner) -> tuple[int, int]:
        """(devices of the job's population able to run it, devices of it that checked in)."""
        return self._ctx.declared.count(runner.population, runner.requirement)

    def record_budget_spent(self, claims: DeviceClaims, job_ids: Iterable[str]) -> None:
        """The device's own privacy budget is spent for these jobs (``JobRunner.budget_spent``);
        jobs of other populations, or not running here, are ignored."""
        for job_id in job_ids:
            runner = self.runners.get(job_id)
            if runner is not None and runner.population == claims.population:
                runner.budget_spent(claims.device_id)

    async def check_in(
        self, claims: DeviceClaims, caller_timeout_s: float | None = None, ledger_id: str = "",
        installed: Installed | None = None,
    ) -> CheckInResult:
        """A task from the first job of the device's population that selects it and that it can
        run, else the soonest come-back time. ``ledger_id``: the input ledger the check-in stated,
        recorded with a seat it gets (``JobRunner.ledger_says``); ``installed``: what the device
        declared (None: not checked, for callers inside the coordinator).

        A selected device is held while the selection fills, at most ``checkin_hold_s`` and never
        past the caller's own deadline: a check-in that timed out on the device side would lose
        its seat without the device learning when to come back."""
        hold_s = self.checkin_hold_s
        if caller_timeout_s is not None:
            hold_s = max(0.0, min(hold_s, caller_timeout_s - HOLD_MARGIN_S))
        now = self.clock()
        retries: list[Retry] = []
        candidates = sorted((r for r in self.runners.values() if r.population == claims.population
                             and (installed is None or r.runs_on(installed))), key=lambda r: r.seq)
        for runner in candidates:
            decision = runner.offer(claims.device_id, now, ledger_id)
            if isinstance(decision, Retry):
                retries.append(decision)
            elif isinstance(decision, Hold):
                return await runner.hold(claims.device_id, hold_s)
            else:
                return decision
        if not retries:
            return idle_retry(claims.population)
        # No selection wants it now. A job aggregating may hold it for its next selection, unless
        # another job's selection is open or about to open: that one may take it on its return.
        selecting = [r for r in candidates if r.selecting]
        for runner in candidates:
            if all(r is runner for r in selecting) and runner.hold_for_next(claims.device_id, ledger_id):
                return await runner.hold(claims.device_id, hold_s)
        return min(retries, key=lambda r: r.seconds)

    def _selection_opened(self, selecting: JobRunner) -> None:
        """Devices held for other jobs' next rounds may take part now: let them come back."""
        for runner in self.runners.values():
            if runner is not selecting and runner.population == selecting.population:
                runner.release_waiting(f"job {selecting.job_id} is selecting")

    def runner(self, job_id: str) -> JobRunner | None:
        return self.runners.get(job_id)

    def resolve_onnx(self, name: str, population: str) -> str:
        """Digest of ``[<job_id>/]latest.onnx`` or ``[<job_id>/]v<round>.onnx``; without a job id,
        the newest job of the device's population that has a model. Jobs of other populations
        are not found: a device sees its own population's models only."""
        job_id, _, file = name.rpartition("/")
        stem = file.removesuffix(".onnx")
        if stem != "latest" and not (stem.startswith("v") and stem[1:].isdigit()):
            raise LookupError(f"unknown model version {name!r}; use latest.onnx or v<round>.onnx")
        if job_id:
            job = self.store.job(job_id)
            if job is None or job.population != population:
                raise LookupError(f"no job {job_id!r} in population {population!r}")
        else:
            candidates = [
                j for j in reversed(self.store.jobs()) if j.population == population
                and self.store.model_version(j.job_id) is not None
            ]
            if not candidates:
                raise LookupError(f"no model for population {population!r} yet")
            job_id = candidates[0].job_id
        version = self.store.model_version(job_id, None if stem == "latest" else int(stem[1:]))
        if version is None:
            raise LookupError(f"job {job_id!r} has no model version {stem!r}")
        if version.onnx_digest is None:
            raise LookupError(f"model {job_id}/v{version.round} has no ONNX export")
        return version.onnx_digest
