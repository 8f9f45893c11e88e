"""A round attempt's secure-sum sessions: one per cohort, each on an aggregator.

Opening, awaiting and closing the sessions is the coordinator's whole conversation with the
aggregators, kept apart from the round loop so that its rules stay in one place: an aggregator
that fails to open is left out and the cohorts formed again over the others; each session is
bound to a signed ticket and a roster of enrolled identity keys; a cohort sum is checked against
its session's configuration and the privacy floor before it counts; and whatever happens to the
attempt, every session opened for it is closed.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import logging
import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from tally import logs
from tally.algorithms.base import StepSpec
from tally.codec.fingerprint import ring_fingerprint, sum_key
from tally.coordinator.metrics import CoordinatorMetrics
from tally.coordinator.rounds.aggregators import AggregatorCallFailed, AggregatorPool
from tally.coordinator.rounds.failures import AttemptFailed
from tally.coordinator.rounds.planner import CohortPlan, CohortRejected, NoCapacity, RoundPlanner
from tally.coordinator.spec.jobspec import JobSpec
from tally.coordinator.state.events import EventHub
from tally.coordinator.state.store import CohortSumRecord, Store
from tally.secagg import SessionConfig, SessionRef
from tally.secagg.messages import SessionAborted, SumResult
from tally.secagg.phases import DEADLINED
from tally.security import SessionTicket, TicketSigner, config_digest
from tally.wire.fields import WireError
from tally.wire.protocol import session_config_bytes, to_proto
from tally.wire.sums import cohort_sum_from_proto, schema_to_proto
from tally.wire.v1 import aggregator_pb2, secagg_pb2

log = logging.getLogger(__name__)

OPEN_TIMEOUT_S = 10.0
CLOSE_TIMEOUT_S = 2.0
# When no aggregator answers at cohort formation: how long an attempt waits for one, and how often
# it asks.
NO_AGGREGATOR_WAIT_S = 20.0
AGGREGATOR_POLL_S = 0.5


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


def phase_deadlines(spec: JobSpec) -> secagg_pb2.PhaseDeadlines:
    return secagg_pb2.PhaseDeadlines(**{p.deadline_field: spec.deadlines[p] for p in DEADLINED})


class CohortSessions:
    """The sessions of one job's current attempt (``opened``), on the pool's aggregators."""

    def __init__(
        self,
        job_id: str,
        spec: JobSpec,
        store: Store,
        pool: AggregatorPool,
        signer: TicketSigner,
        metrics: CoordinatorMetrics,
        events: EventHub,
        clock: Callable[[], float],
    ) -> None:
        self.job_id, self.spec = job_id, spec
        self._store, self._pool, self._signer = store, pool, signer
        self._metrics, self._events, self._clock = metrics, events, clock
        self.deadlines = phase_deadlines(spec)
        self.opened: list[OpenedSession] = []

    async def open(self, planner: RoundPlanner, round_: int, attempt: int, steps: Sequence[StepSpec]) -> None:
        """One session per cohort; an aggregator that fails to open is left out and the cohorts
        are formed again over the others."""
        excluded: dict[str, str] = {}  # aggregator -> why it could not open a session
        while True:
            healthy = await self._pool.healthy(exclude=sorted(excluded))
            if not healthy and not excluded:
                healthy = await self._await_aggregator(planner, round_)
            try:
                plans = planner.form(healthy, self._clock())
            except NoCapacity as exc:
                # Every aggregator that could not be used, and why: down at its check, or failed to open.
                not_used = {**self._pool.unusable(), **excluded}
                why = "; ".join(f"{ident}: {reason}" for ident, reason in not_used.items())
                raise AttemptFailed(f"cannot form cohorts: {exc}" + (f"; aggregators not used: {why}" if why else "")
                                    ) from None
            session_ids = [secrets.token_hex(8) for _ in plans]
            # Recorded before any is opened: a fenced write, so a replica that no longer leads opens
            # none, and its successor finds (and closes) every session it may have opened.
            self._store.set_attempt_sessions(self.job_id, round_, attempt, [
                {"aggregator_id": plan.aggregator_id, "session_id": session_id}
                for plan, session_id in zip(plans, session_ids, strict=True)])
            opened = await asyncio.gather(
                *(self._open_one(c, plan, session_id, round_, steps, planner.deadline)
                  for c, (plan, session_id) in enumerate(zip(plans, session_ids, strict=True))),
                return_exceptions=True,
            )
            self.opened = [s for s in opened if isinstance(s, OpenedSession)]
            errors = [e for e in opened if isinstance(e, BaseException)]
            if not errors:
                break
            for error in errors:
                if not isinstance(error, AggregatorCallFailed):
                    raise error  # the attempt's handler closes the sessions that did open
                excluded[error.aggregator_id] = error.reason
            logs.event(log, "reforming cohorts without failed aggregators", logging.WARNING,
                       job_id=self.job_id, excluded=excluded)
            await self.close("cohorts reformed")
        self._store.set_attempt_sessions(
            self.job_id, round_, attempt,
            [{"aggregator_id": s.aggregator_id, "session_id": s.session_id} for s in self.opened],
        )

    async def _await_aggregator(self, planner: RoundPlanner, round_: int) -> list[str]:
        """No aggregator answers: wait a while for one to come back (a restarted process, a
        rescheduled pod) rather than fail the attempt at once; failing at once let a retry budget
        burn down in under a second while every aggregator restarted (found by the fault
        campaign, seed 21, both aggregators killed in consecutive rounds)."""
        until = min(self._clock() + NO_AGGREGATOR_WAIT_S, planner.deadline)
        logs.event(log, "no aggregator answers; waiting for one", logging.WARNING, job_id=self.job_id,
                   round=round_, seconds=round(until - self._clock(), 1))
        while self._clock() < until:
            await asyncio.sleep(AGGREGATOR_POLL_S)
            if healthy := await self._pool.healthy():
                return healthy
        return []

    async def _open_one(
        self, cohort: int, plan: CohortPlan, session_id: str, round_: int, steps: Sequence[StepSpec],
        deadline: float,
    ) -> OpenedSession:
        spec = self.spec
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
        ticket = self._signer.sign(SessionTicket(
            self.job_id, round_, session_id, tuple(s.name for s in summed), len(plan.devices),
            config_digest(session_config_bytes(config)), plan.aggregator_id, deadline,
            leader_epoch=self._store.epoch or 0,
        ))
        request = aggregator_pb2.OpenSessionRequest(
            session_ticket=ticket, config=to_proto(config),
            schemas=[schema_to_proto(s.name, s.schema) for s in summed], deadlines=self.deadlines,
            devices=[
                aggregator_pb2.DeviceGrant(device_index=i, token_sha256=hashlib.sha256(t.encode()).digest())
                for i, t in tokens.items()
            ],
        )
        reply = await self._pool.open_session(plan.aggregator_id, request, OPEN_TIMEOUT_S)
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
        keys = self._store.devices.identities(plan.devices)
        missing = [d for d in plan.devices if d not in keys]
        if missing:
            raise AttemptFailed(f"devices without an enrolled identity key: {missing[:5]}")
        return [keys[d] for d in plan.devices]

    async def collect(self, planner: RoundPlanner, step: StepSpec, round_: int, attempt: int) -> dict[str, Any]:
        """The total of ``step`` over every cohort, once each session has handed back its sum."""

        async def one(session: OpenedSession) -> tuple[OpenedSession, aggregator_pb2.CohortSum]:
            timeout = planner.deadline - self._clock()
            result = await self._pool.await_result(
                session.aggregator_id, session.session_id, step.name, timeout
            )
            return session, result

        pending = [asyncio.create_task(one(s)) for s in self.opened]
        try:
            remaining = max(planner.deadline - self._clock(), 0.0)
            for next_done in asyncio.as_completed(pending, timeout=remaining):
                try:
                    session, proto = await next_done
                except AggregatorCallFailed as exc:
                    self._metrics.cohort_sums.labels(outcome="failed").inc()
                    raise AttemptFailed(str(exc)) from None
                total = self._accept(planner, session, step, proto, round_, attempt)
                if total is not None:
                    return total
        except TimeoutError:
            raise AttemptFailed(f"sum {step.name!r} not complete before the round deadline") from None
        finally:
            for task in pending:
                task.cancel()
        raise AttemptFailed(f"sum {step.name!r}: a cohort returned nothing")

    def _accept(
        self, planner: RoundPlanner, session: OpenedSession, step: StepSpec, proto: aggregator_pb2.CohortSum,
        round_: int, attempt: int,
    ) -> dict[str, Any] | None:
        self._metrics.cohort_sum_bytes.inc(proto.ByteSize())
        counter = self._metrics.cohort_sums
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
        self._report_excluded(session, step, result, round_)
        fingerprint = ring_fingerprint(result.total, spec.bits, sum_key(session.session_id, step.name))
        self._store.add_cohort_sum(self.job_id, round_, attempt, CohortSumRecord(
            session.session_id, step.name, session.cohort, spec.bits, tuple(result.contributors), fingerprint))
        return total

    def _report_excluded(self, session: OpenedSession, step: StepSpec, result: SumResult, round_: int) -> None:
        """Name each device its session excluded, once (every sum of the session lists it)."""
        if step.name != session.config.sums[0].sum_id:
            return
        for index, reason in result.excluded:
            device = session.devices[index - 1] if 0 < index <= len(session.devices) else f"index {index}"
            message = f"device {device} excluded from cohort {session.cohort}'s session {session.session_id}: {reason}"
            if index in result.convicted and 0 < index <= len(session.devices):
                self._store.convict(self.job_id, device, reason)
                message += " (proven: it sits in no later selection of this job)"
            self._metrics.devices_excluded.inc()
            self._events.publish(self.job_id, round=round_, state="RUNNING", phase="AGGREGATION",
                                 step=step.name, message=message)
            logs.event(log, "device excluded", logging.WARNING, job_id=self.job_id, round=round_,
                       device_id=device, session_id=session.session_id, reason=reason)

    async def close(self, reason: str) -> None:
        sessions, self.opened = self.opened, []
        await asyncio.gather(
            *(self._pool.close_session(s.aggregator_id, s.session_id, reason, CLOSE_TIMEOUT_S) for s in sessions)
        )

    async def close_recorded(self, sessions: Sequence[dict[str, str]], reason: str) -> None:
        """Close sessions a stopped coordinator recorded for an attempt it left open."""
        for s in sessions:
            await self._pool.close_session(s["aggregator_id"], s["session_id"], reason, CLOSE_TIMEOUT_S)
