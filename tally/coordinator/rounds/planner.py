"""The decisions of one round attempt, without I/O.

``RoundPlanner`` is fed events (check-ins, withdrawals, clock ticks, cohort sums, failures) and
answers with decisions; ``tally.coordinator.rounds.runner`` does the talking (gRPC, storage, the algorithm).
Keeping the rules here makes each of them a unit test: selection with over-selection, window
extensions charged to the retry budget, the split into cohorts, the privacy floor on cohort sums,
and the all-or-nothing treatment of an attempt.

An attempt goes SELECTION -> OPENING -> AGGREGATION (one step after the other) -> DONE, or to
FAILED from anywhere. **A failed attempt is discarded whole**: cohort sums already received for
it, even for completed steps, are dropped with it and the round restarts from the state it began
with, so a round is never applied from a subset of its cohorts.

Two rules stop a privacy attack on the cohorts themselves:

- **Cohorts are a uniformly random partition of the selection**, drawn once the selection closes
  from the operating system's CSPRNG: arriving together (as sybils can) says nothing about
  landing together, so k sybils share a victim's cohort only as often as chance allows.
- **A retry of a round never seats a device that may have sent an input in an earlier attempt.**
  Two sums over cohorts that differ by one device isolate that device's input; sums over
  disjoint sets of devices cannot be differenced into anything finer than one of them. A failed
  attempt's sums cannot be assumed unseen: sums that reached the coordinator are only dropped,
  and the aggregator computes every sum itself, so a malicious one can unmask a cohort, report an
  abort (or fewer contributors than it used), then in the retry of the same cohort pretend the
  victim dropped out: sum(C) - sum(C - {v}) = x_v, with no sybil needed. The coordinator cannot
  tell which sums an aggregator computed, so it assumes the worst of every device that could
  have sent an input: all devices seated in an attempt whose sessions opened (``excluded``,
  recorded before any task is handed out and kept across restarts) are turned away for the
  rest of the round, unless the seat is released because its device cannot have sent an input:
  its task never reached it (released when the attempt fails), or it reported that it sent none
  (``tally.coordinator.rounds.task_reports``), or the durable input ledger it states at each check-in shows
  no input in the round (how a restarted device, its reports lost, is seated again), provided it
  is the ledger the device stated when it was seated: a ledger created since (a wiped state
  directory) knows nothing of that seat. A device can only release its own seat, and lying
  exposes only itself. The device enforces the rule too:
  one that sent an input in a round refuses to send another in it, whatever the coordinator asks
  (``tally.client.input_ledger``). So any two sums of a round are over equal or disjoint sets of
  the devices that sent inputs.
  The price is liveness where inputs were sent: a retry after a failure past MaskedInput needs
  devices that sent none, so a population no larger than one selection cannot retry such a
  round. A failure before MaskedInput (a cohort below threshold in ShareKeys, an aggregator lost
  early) costs nothing once the devices report, and a ``plain`` job (benchmarks only) excludes
  nobody: its aggregator sees every input anyway.
"""

from __future__ import annotations

import enum
import functools
import math
import random
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from tally.algorithms.base import StepSpec
from tally.codec import CodecError
from tally.coordinator.rounds.come_back import Retry
from tally.coordinator.spec.jobspec import JobSpec
from tally.secagg import SumResult
from tally.secagg.phases import Phase as SecAggPhase

# Pace steering bounds: never tell a device to come back sooner or later than this.
MIN_RETRY_S = 0.2
MAX_RETRY_S = 60.0
# Until a job has committed a round, the guess of how long a round takes.
FIRST_ROUND_GUESS_S = 5.0
# Slack on top of the phase deadlines when bounding a whole attempt: processing between phases.
ROUND_MARGIN_S = 1.0
ROUND_MARGIN_FRACTION = 0.1


class Phase(enum.Enum):
    SELECTION = "selection"
    OPENING = "opening"
    AGGREGATION = "aggregation"
    DONE = "done"
    FAILED = "failed"


# -- what a check-in gets ------------------------------------------------------------------------


@dataclass(frozen=True)
class Seat:
    device_id: str
    cohort: int  # position in the attempt's cohort list
    index: int  # 1-based device index within the cohort
    task_id: str
    # The id of the input ledger the device stated when it was seated ("" for none): only a
    # statement of that ledger may release the seat (``tally.client.input_ledger``).
    ledger_id: str = ""


@dataclass(frozen=True)
class Hold:
    """Selected: the task follows once the cohorts' sessions are open."""

    device_id: str


@dataclass(frozen=True)
class Deliver:
    seat: Seat


# -- what a tick asks for ------------------------------------------------------------------------


@dataclass(frozen=True)
class FormCohorts:
    devices: tuple[str, ...]


@dataclass(frozen=True)
class Extended:
    """Too few check-ins at the deadline: the window was reopened, using one retry."""

    reason: str


@dataclass(frozen=True)
class Failed:
    reason: str


@dataclass(frozen=True)
class CohortPlan:
    aggregator_id: str
    devices: tuple[str, ...]  # device_index i is devices[i - 1]


class NoCapacity(Exception):
    """No valid split of the selected devices onto the healthy aggregators."""


class CohortRejected(Exception):
    """A cohort sum the coordinator refuses (below the privacy floor, malformed, duplicate)."""


# -- pure helpers --------------------------------------------------------------------------------


def clamp_retry(seconds: float) -> float:
    return min(MAX_RETRY_S, max(MIN_RETRY_S, seconds))


def pace(expected_s: float, elapsed_s: float) -> float:
    """Seconds until the next selection window is likely to open: what is left of a round that
    usually takes ``expected_s``, but never less than a tenth of it, so an overrunning round does
    not make the fleet poll at the minimum interval."""
    return clamp_retry(max(expected_s - elapsed_s, 0.1 * expected_s))


def attempt_bound_s(spec: JobSpec, n_steps: int) -> float:
    """Longest an attempt may take once its cohorts are formed: download, key exchange, then every
    step's masked input (with local computation), consistency check and unmask."""
    d = spec.deadlines
    per_step = d[SecAggPhase.MASKED_INPUT] + d[SecAggPhase.UNMASK]
    if spec.secure.checks_consistency:
        per_step += d[SecAggPhase.CONSISTENCY_CHECK]
    total = d["download"] + d[SecAggPhase.ADVERTISE_KEYS] + d[SecAggPhase.SHARE_KEYS] + n_steps * per_step
    return total * (1 + ROUND_MARGIN_FRACTION) + ROUND_MARGIN_S


def split_cohorts(
    devices: Sequence[str], aggregators: Sequence[str], min_cohort: int, max_cohort: int
) -> list[CohortPlan]:
    """Balanced cohorts of ``min_cohort..max_cohort`` devices, one per healthy aggregator when
    there are enough devices (more per aggregator only when ``max_cohort`` forces it).

    Devices that cannot be placed without breaking a bound are left out (e.g. 15 devices with
    min = max = 10). Raises ``NoCapacity`` when no cohort can be formed at all.
    """
    if not aggregators:
        raise NoCapacity("no healthy aggregator")
    if min_cohort > max_cohort:
        raise ValueError("min_cohort exceeds max_cohort")
    n = len(devices)
    most = n // min_cohort  # more cohorts than this would put one below the privacy floor
    if most == 0:
        raise NoCapacity(f"{n} devices cannot form a cohort of at least {min_cohort}")
    fewest = math.ceil(n / max_cohort)
    if fewest > most:
        count, n = most, most * max_cohort
    else:
        count = max(fewest, min(len(aggregators), most))
    size, extra = divmod(n, count)
    plans, start = [], 0
    for c in range(count):
        end = start + size + (1 if c < extra else 0)
        plans.append(CohortPlan(aggregators[c % len(aggregators)], tuple(devices[start:end])))
        start = end
    return plans


# -- selection -----------------------------------------------------------------------------------


class Selection:
    """Check-ins of one attempt: accepted until ``target`` devices or the window's end.

    At the end of the window with fewer than ``min_devices``, the window reopens while
    ``extensions`` last (each one is a retry of the round); then the selection gives up.
    """

    def __init__(
        self,
        target: int,
        min_devices: int,
        window_s: float,
        extensions: int,
        now: float,
        excluded: frozenset[str] = frozenset(),
    ) -> None:
        self.target, self.min_devices, self.window_s = target, min_devices, window_s
        self.excluded = set(excluded)
        self.extensions_left = extensions
        self.extensions_used = 0
        self.closes_at = now + window_s
        self.seated: dict[str, str] = {}  # device -> the ledger id it stated when seated
        self.closed = False
        # Excluded devices that checked in anyway: a selection short of devices says how many it
        # turned away, so a round that ran out of devices it may seat explains itself.
        self.turned_away: set[str] = set()

    @property
    def full(self) -> bool:
        return len(self.seated) >= self.target

    def offer(self, device_id: str, ledger_id: str = "") -> bool:
        if device_id in self.seated:
            return True
        if device_id in self.excluded:
            self.turned_away.add(device_id)
            return False
        if self.closed or self.full:
            return False
        self.seated[device_id] = ledger_id
        return True

    def leave_out(self, device_ids: Iterable[str]) -> None:
        """Drop devices from a closed selection before its cohorts are formed (revoked since
        they were seated: no roster may name them)."""
        for device_id in device_ids:
            self.seated.pop(device_id, None)

    def withdraw(self, device_id: str) -> None:
        if not self.closed:
            self.seated.pop(device_id, None)

    def progress(self, population: str, now: float) -> str:
        """How far the selection is, for people (``tally job status`` and ``watch``): a job whose
        population has no devices showed only ``RUNNING (SELECTION)`` for minutes (issue 39)."""
        allowed = self.extensions_used + self.extensions_left
        return (f"selection: {len(self.seated)}/{self.target} devices of population {population!r} checked in "
                f"(deadline extended {self.extensions_used} of {allowed}); at least {self.min_devices} needed, "
                f"window closes in {max(self.closes_at - now, 0.0):.0f} s")

    def due(self, now: float) -> FormCohorts | Extended | Failed | None:
        if self.closed:
            return None
        if not self.full and now < self.closes_at:
            return None
        if len(self.seated) >= self.min_devices:
            self.closed = True
            return FormCohorts(tuple(self.seated))
        reason = (
            f"only {len(self.seated)} of the {self.min_devices} devices needed checked in within "
            f"{self.window_s:g} s"
        )
        if self.turned_away:
            reason += (
                f"; {len(self.turned_away)} more checked in but were seated in an earlier attempt "
                "of this round, which does not seat them again unless their seats are released"
            )
        if self.extensions_left > 0:
            self.extensions_left -= 1
            self.extensions_used += 1
            self.closes_at = now + self.window_s
            return Extended(reason)
        self.closed = True
        return Failed(reason)


class WaitingRoom:
    """Check-ins held while an attempt aggregates, to be the next selection's first arrivals.

    Without it a selection opens empty when the previous round commits and waits for a paced
    population to come back: 10 s of a 40 s round for 1,100 seats at 100 check-ins per second
    (issue 8's fleet). Held here during the aggregation, they are seated the moment the next
    attempt opens. At most one selection's worth is held, and only devices still waiting: one
    whose hold ended leaves, as it would leave a selection.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        # In arrival order (the selection seats them in that order), with the ledger id each stated.
        self.held: dict[str, str] = {}

    def offer(self, device_id: str, ledger_id: str = "") -> bool:
        if device_id not in self.held:
            if len(self.held) >= self.capacity:
                return False
            self.held[device_id] = ledger_id
        return True

    def withdraw(self, device_id: str) -> None:
        self.held.pop(device_id, None)

    def empty(self) -> list[str]:
        """Let every held device go; the ones that were held."""
        held, self.held = list(self.held), {}
        return held


# -- sums ----------------------------------------------------------------------------------------


class StepSums:
    """The cohort sums of one step. The step's total exists only once every cohort's sum is in:
    each is decoded with the schema at its cohort's ring width, then they are added."""

    def __init__(self, step: StepSpec, cohorts: int, min_contributors: int) -> None:
        self.step, self.cohorts, self.min_contributors = step, cohorts, min_contributors
        self._decoded: dict[int, dict[str, np.ndarray]] = {}
        self.contributors = 0
        self.dropped = 0

    @property
    def complete(self) -> bool:
        return len(self._decoded) == self.cohorts

    def add(self, cohort: int, result: SumResult, bits: int) -> None:
        if not 0 <= cohort < self.cohorts:
            raise CohortRejected(f"no cohort {cohort}")
        if cohort in self._decoded:
            raise CohortRejected(f"cohort {cohort} already delivered sum {self.step.name!r}")
        if result.sum_id != self.step.name:
            raise CohortRejected(
                f"cohort {cohort} delivered sum {result.sum_id!r}, expected {self.step.name!r}"
            )
        if len(result.contributors) < self.min_contributors:
            raise CohortRejected(
                f"cohort {cohort}: sum {self.step.name!r} covers {len(result.contributors)} devices, "
                f"below the privacy floor of {self.min_contributors}"
            )
        try:
            self._decoded[cohort] = self.step.schema.decode_sum(
                result.total, bits, contributors=len(result.contributors)
            )
        except CodecError as exc:
            raise CohortRejected(f"cohort {cohort}: sum {self.step.name!r} is malformed: {exc}") from None
        self.contributors += len(result.contributors)
        self.dropped += len(result.dropped)

    def total(self) -> dict[str, np.ndarray]:
        if not self.complete:
            raise RuntimeError(f"sum {self.step.name!r} is missing cohorts")
        decoded = list(self._decoded.values())
        return {f.name: functools.reduce(np.add, (d[f.name] for d in decoded)) for f in self.step.schema.fields}


# -- the attempt ---------------------------------------------------------------------------------


class RoundPlanner:
    """One attempt of one round: who is selected, how cohorts are formed, when each step's total
    is complete, what a device asking for a step gets."""

    def __init__(
        self,
        spec: JobSpec,
        steps: Sequence[StepSpec],
        now: float,
        *,
        extensions: int,
        attempt_key: str,
        expected_round_s: float = FIRST_ROUND_GUESS_S,
        rng: random.Random | None = None,
        excluded: frozenset[str] = frozenset(),
        convicted: frozenset[str] = frozenset(),
        cohort_rng: random.Random | None = None,
    ) -> None:
        """``rng`` jitters pace steering; ``cohort_rng`` draws the cohorts (the OS CSPRNG unless a
        test fixes it); ``excluded``: devices seated in an earlier attempt of this round, which
        this attempt never selects (see the module docstring); ``convicted``: devices proven to
        have dealt bad shares in this job, never selected again and never readmitted."""
        self.convicted = convicted
        self.spec, self.steps = spec, list(steps)
        self.attempt_key = attempt_key
        self.started_at = now
        self.expected_round_s = expected_round_s
        self.phase = Phase.SELECTION
        self.selection = Selection(
            spec.selection_target, spec.min_cohort, spec.deadlines["checkin"], extensions, now,
            (frozenset() if spec.secure.plain else excluded) | convicted,
        )
        self.cohorts: list[CohortPlan] = []
        self.seats: dict[str, Seat] = {}
        self._by_task: dict[str, Seat] = {}
        self.delivered: set[str] = set()
        self.deadline = math.inf
        self.step_index = 0  # the step whose sums are being collected
        self.sums: StepSums | None = None
        self.failure: str | None = None
        self._rng = rng or random.Random()
        self._cohort_rng = cohort_rng or random.SystemRandom()

    # -- devices -------------------------------------------------------------------------------

    def check_in(self, device_id: str, now: float, ledger_id: str = "") -> Hold | Deliver | Retry:
        """``ledger_id``: the input ledger the check-in stated, recorded with a new seat."""
        if self.phase is Phase.SELECTION:
            if self.selection.offer(device_id, ledger_id):
                return Hold(device_id)
            if device_id in self.convicted:
                return self.retry(now, "proven to have dealt bad shares in this job")
            if device_id in self.selection.excluded:
                return self.retry(now, "seated in an earlier attempt of this round")
            return self.retry(now, "cohort full")
        if self.phase in (Phase.DONE, Phase.FAILED):  # a new selection follows shortly
            return Retry(MIN_RETRY_S, "round attempt ending")
        seat = self.seats.get(device_id)
        if seat is None:
            return self.retry(now, "selection closed")
        if self.phase is Phase.OPENING:
            return Hold(device_id)
        if device_id in self.delivered:
            return self.retry(now, "already assigned")
        self.delivered.add(device_id)
        return Deliver(seat)

    def readmit(self, device_id: str) -> None:
        """``device_id``'s earlier seat in the round was released: it may be selected again,
        unless it is convicted."""
        if device_id in self.convicted:
            return
        self.selection.excluded.discard(device_id)
        self.selection.turned_away.discard(device_id)

    def seat_of_task(self, task_id: str) -> Seat | None:
        return self._by_task.get(task_id)

    def withdraw(self, device_id: str) -> None:
        """A held check-in ended without its task: free the seat while cohorts are not formed."""
        if self.phase is Phase.SELECTION:
            self.selection.withdraw(device_id)

    def has_seat(self, device_id: str) -> bool:
        """The selection closed with ``device_id`` in it and the attempt goes on: its task will
        be there when it comes back."""
        seated = self.seats or self.selection.seated  # the cohorts, once formed, may leave some out
        return self.selection.closed and self.phase is not Phase.FAILED and device_id in seated

    def mark_delivered(self, device_id: str) -> None:
        self.delivered.add(device_id)

    def retry(self, now: float, reason: str) -> Retry:
        """Pace steering with a little jitter, so a fleet turned away at once does not return at
        once."""
        seconds = pace(self.expected_round_s, now - self.started_at)
        return Retry(clamp_retry(seconds * self._rng.uniform(0.9, 1.1)), reason)

    def step_request(self, device_id: str, task_id: str, sum_id: str, now: float) -> int | Retry:
        """The index of step ``sum_id`` when its broadcast is ready for this task, or a Retry;
        ``LookupError`` for a task or sum this attempt does not have (or another device's task)."""
        seat = self._by_task.get(task_id)
        if seat is None or seat.device_id != device_id:
            raise LookupError(f"no task {task_id!r} for this device in the current round")
        names = [s.name for s in self.steps]
        if sum_id not in names:
            raise LookupError(f"round has no sum {sum_id!r}; sums: {names}")
        wanted = names.index(sum_id)
        if self.phase is Phase.FAILED:
            return self.retry(now, "round attempt failed")
        if self.phase is Phase.DONE or wanted <= self.step_index:
            return wanted
        return Retry(MIN_RETRY_S, f"sum {names[wanted - 1]!r} of every cohort is not in yet")

    # -- clock ---------------------------------------------------------------------------------

    def tick(self, now: float) -> FormCohorts | Extended | Failed | None:
        """The selection's decision at ``now``, if one is due. (Once cohorts are formed, the
        driver bounds every call by ``deadline`` instead.)"""
        if self.phase is not Phase.SELECTION:
            return None
        decision = self.selection.due(now)
        if isinstance(decision, Failed):
            self.fail(decision.reason)
        return decision

    def next_tick_s(self, now: float) -> float:
        """Seconds until ``tick`` has something to decide, unless a check-in fills the selection."""
        return max(0.0, self.selection.closes_at - now)

    # -- cohorts -------------------------------------------------------------------------------

    def form(self, aggregators: Sequence[str], now: float) -> list[CohortPlan]:
        """Split the selected devices over ``aggregators`` (again, after an aggregator failed to
        open its session); ``NoCapacity`` fails the attempt."""
        if self.phase not in (Phase.SELECTION, Phase.OPENING) or not self.selection.closed:
            raise RuntimeError(f"cannot form cohorts in phase {self.phase.value}")
        selected = list(self.selection.seated)
        self._cohort_rng.shuffle(selected)
        try:
            self.cohorts = split_cohorts(
                selected, aggregators, self.spec.min_cohort, self.spec.max_cohort_per_aggregator,
            )
        except NoCapacity as exc:
            self.fail(str(exc))
            raise
        self.seats = {
            device: Seat(device, c, i, f"{self.attempt_key}.{c}.{i}", self.selection.seated[device])
            for c, plan in enumerate(self.cohorts)
            for i, device in enumerate(plan.devices, start=1)
        }
        self._by_task = {seat.task_id: seat for seat in self.seats.values()}
        if self.phase is Phase.SELECTION:
            self.deadline = now + attempt_bound_s(self.spec, len(self.steps))
        self.phase = Phase.OPENING
        return self.cohorts

    def opened(self) -> list[Seat]:
        """Every cohort's session is open: seats can be delivered and step 0 collected."""
        if self.phase is not Phase.OPENING:
            raise RuntimeError(f"sessions opened in phase {self.phase.value}")
        self.phase = Phase.AGGREGATION
        self.sums = StepSums(self.steps[0], len(self.cohorts), self.spec.min_cohort)
        return list(self.seats.values())

    def cohort_sum(self, cohort: int, result: SumResult, bits: int) -> dict[str, np.ndarray] | None:
        """Record one cohort's sum of the current step; the step's total once all are in.
        ``CohortRejected`` fails the attempt."""
        if self.phase is not Phase.AGGREGATION or self.sums is None:
            raise RuntimeError(f"cohort sum in phase {self.phase.value}")
        try:
            self.sums.add(cohort, result, bits)
        except CohortRejected as exc:
            self.fail(str(exc))
            raise
        return self.sums.total() if self.sums.complete else None

    def step_applied(self) -> bool:
        """The current step's total was applied; True when another step follows."""
        if self.phase is not Phase.AGGREGATION:
            raise RuntimeError(f"step applied in phase {self.phase.value}")
        self.step_index += 1
        if self.step_index == len(self.steps):
            self.phase = Phase.DONE
            return False
        self.sums = StepSums(self.steps[self.step_index], len(self.cohorts), self.spec.min_cohort)
        return True

    def fail(self, reason: str) -> None:
        """Discard the attempt: everything collected so far is dropped with it (the first reason
        is kept)."""
        if self.phase is not Phase.FAILED:
            self.phase = Phase.FAILED
            self.failure = reason
            self.sums = None

    def step_metrics(self) -> Mapping[str, float]:
        if self.sums is None:
            return {}
        name = self.sums.step.name
        return {f"{name}.contributors": self.sums.contributors, f"{name}.dropped": self.sums.dropped}
