"""What a round attempt's devices ask between sums: the next step (``GetStep``) and, for a reveal
step, their payload in the clear (``Reveal``).

A step's broadcast exists only once the previous step's sum has been applied, so the answers are
built as the round loop applies each sum and kept here for the devices that ask later; a personal
step's broadcast is built per silo at the question, from the state kept for it. One
``StepAnswers`` serves one attempt: a retry starts from the round's first step again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence
from typing import Any

from tally import logs
from tally.algorithms.base import ServerAlgorithm, StepSpec
from tally.coordinator.metrics import CoordinatorMetrics
from tally.coordinator.rounds.failures import AttemptFailed
from tally.coordinator.rounds.planner import Retry, RoundPlanner
from tally.coordinator.rounds.reveals import RevealCollector, RevealOutOfPhase
from tally.coordinator.spec.jobspec import JobSpec
from tally.coordinator.state.store import Store
from tally.wire.sums import schema_to_proto
from tally.wire.tensors import tensors_from_proto, tensors_to_proto
from tally.wire.v1 import coordinator_pb2

log = logging.getLogger(__name__)


def step_proto(step: StepSpec, broadcast: dict[str, Any] | None = None) -> coordinator_pb2.Step:
    out = coordinator_pb2.Step(
        name=step.name, sum_id=step.name, schema=schema_to_proto(step.name, step.schema),
        reveal=bool(step.reveal), personal=step.personal,
    )
    if broadcast is not None:
        out.broadcast.extend(tensors_to_proto(broadcast))
    return out


class StepAnswers:
    """The steps of one attempt as devices ask for them. ``silo_limit``: devices are addressed by
    a stable silo id in [0, silo_limit) when a step is personal or a reveal (None otherwise)."""

    def __init__(
        self,
        job_id: str,
        round_: int,
        spec: JobSpec,
        server: ServerAlgorithm,
        planner: RoundPlanner,
        store: Store,
        metrics: CoordinatorMetrics,
        silo_limit: int | None,
    ) -> None:
        self.job_id, self.round, self.spec, self.server, self.planner = job_id, round_, spec, server, planner
        self._store, self._metrics, self._silo_limit = store, metrics, silo_limit
        steps = planner.steps
        self.protos: list[coordinator_pb2.Step | None] = [step_proto(steps[0])] + [None] * (len(steps) - 1)
        self._states: dict[int, Any] = {}  # the state a personal step's broadcasts are built from
        self._reveals: dict[int, RevealCollector] = {}  # step index -> the reveal being collected

    def applied(self, k: int, state: Any) -> None:
        """Step ``k``'s sum is applied, leaving ``state``: the following step's broadcast can be
        built (for a personal step, per silo at each question)."""
        steps = self.planner.steps
        if k + 1 >= len(steps):
            return
        following = steps[k + 1]
        if following.personal:
            self._states[k + 1] = state
            self.protos[k + 1] = step_proto(following)
        else:
            self.protos[k + 1] = step_proto(following, self.server.broadcast(state, following.name))

    def reveals_of(self, step_name: str) -> Sequence[str]:
        """The values step ``step_name`` of this round reveals (none for a summed or unknown step)."""
        return next((s.reveal for s in self.planner.steps if s.name == step_name), ())

    def get_step(self, device_id: str, task_id: str, sum_id: str, now: float) -> coordinator_pb2.Step | Retry:
        planner = self.planner
        names = [s.name for s in planner.steps]
        if sum_id in names:
            # A reveal step this task still owes comes first: the device learns of it here.
            for k in range(planner.step_index, names.index(sum_id)):
                reveal = self._reveals.get(k)
                if planner.steps[k].reveal and not (reveal is not None and reveal.revealed(task_id)):
                    sum_id = names[k]
                    break
        answer = planner.step_request(device_id, task_id, sum_id, now)
        if isinstance(answer, Retry):
            return answer
        step = self.protos[answer]
        if step is None:  # cannot happen: a step is ready only after its broadcast was built
            raise LookupError(f"sum {sum_id!r} has no broadcast yet")
        if not step.personal:
            return step
        personal = coordinator_pb2.Step()
        personal.CopyFrom(step)
        personal.broadcast.extend(
            tensors_to_proto(self.server.broadcast_to(self._states[answer], step.name, self._silo(device_id)))
        )
        return personal

    def reveal(self, device_id: str, task_id: str, step_name: str, values: list) -> None:
        """A device's payload for reveal step ``step_name``, once the job is known to have opted
        in: ``RevealOutOfPhase`` when that step is not being collected; ``LookupError`` for
        another device's or an unknown task; ``ValueError`` for a payload that does not fit."""
        planner = self.planner
        found = next(((k, s) for k, s in enumerate(planner.steps) if s.name == step_name), None)
        if found is None or not found[1].reveal:
            raise ValueError(f"{step_name!r} is not a reveal step of this round")
        seat = planner.seat_of_task(task_id)
        if seat is None or seat.device_id != device_id:
            raise LookupError(f"no task {task_id!r} for this device in the current round")
        collector = self._reveals.get(found[0])
        if collector is None:
            raise RevealOutOfPhase(f"step {step_name!r} is not being collected now")
        collector.add(task_id, self._silo(device_id), tensors_from_proto(values))

    def _silo(self, device_id: str) -> int:
        silo = self._store.silo(self.job_id, device_id, self._silo_limit or 0)
        if silo is None:
            raise LookupError(f"device {device_id!r} has no silo id in job {self.job_id}")
        return silo

    async def collect_reveals(self, k: int, step: StepSpec, timeout: float) -> dict[str, Any]:
        """Every device's payload of reveal step ``k``, until all are in or ``timeout``; logged
        and counted, as the opt-in requires."""
        collector = RevealCollector(step, [seat.task_id for seat in self.planner.seats.values()])
        self._reveals[k] = collector
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(collector.complete.wait(), timeout)
        del self._reveals[k]
        count = len(collector.rows)
        if count < self.spec.min_cohort:
            raise AttemptFailed(
                f"reveal {step.name!r}: {count} device(s) answered, below min_cohort {self.spec.min_cohort}"
            )
        names = step.reveal
        self._metrics.revealed_values.labels(job_id=self.job_id, step=step.name).inc(count * len(names))
        logs.event(log, "per-device values revealed (job opt-in)", job_id=self.job_id, round=self.round,
                   step=step.name, devices=count, values=list(names))
        return collector.total()
