"""A test kit for algorithm packages (``tally new algorithm`` writes tests that use it).

Two ways to run an installed algorithm, each checking that its server half was handed exactly the
sums of what the devices sent, nothing else:

* ``run_in_process``: rounds in this process, every step through the real secure-sum protocol
  (``tally.secagg``) with devices dropping out at random phases. Each total the server half's
  ``apply`` receives is compared with the sum of the contributors' payloads (``assert_exact``):
  counts equal, real values within the fixed point's rounding (under 2^-frac_bits per device).
* ``run_job``: a job spec through the real services on 127.0.0.1 (a coordinator, two aggregators)
  with a fleet of SDK devices that have the algorithm installed; each device fingerprints the input
  it sends, and every committed sum is checked against its contributors' fingerprints
  (``tally.loadtest.sum_audit``). Further fleets may declare other installs (``OtherFleet``: a
  fleet without the algorithm, or with another version), to show who is seated.

Both take the algorithm by the name its package's entry point gives it, so what is tested is what a
coordinator and a device load.
"""

from __future__ import annotations

import asyncio
import contextlib
import tempfile
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from tally.aggregator import AggregatorService
from tally.algorithms import packages
from tally.algorithms.base import Arrays, LocalTrainer, ServerAlgorithm, StepSpec
from tally.codec import Kind
from tally.coordinator.service import CoordinatorService
from tally.datasets.digits import digits
from tally.loadtest import DropoutPlan, Fleet, FleetStats
from tally.loadtest.sum_audit import EXACT, SumAudit, SumCheck, check_committed
from tally.models.mlp import mlp
from tally.models.params import get_params
from tally.security import TLSConfig, bearer_metadata, load_or_create_ticket_key
from tally.security.tls import open_aio_channel
from tally.sim.rounds import RoundLog, SecureSum, run_rounds
from tally.training import TorchTrainer, single_threaded
from tally.wire.v1 import admin_pb2, admin_pb2_grpc, common_pb2

PLAINTEXT = TLSConfig.plaintext()


@dataclass
class ReceivedSum:
    """One total the server half's ``apply`` received, and what the contributors' payloads add up to."""

    round: int
    step: StepSpec
    contributors: list[int]
    received: dict[str, np.ndarray]
    expected: dict[str, np.ndarray]


@dataclass
class InProcessRun:
    state: Any
    logs: list[RoundLog]
    sums: list[ReceivedSum]

    def model(self, server: ServerAlgorithm) -> Arrays:
        return server.model(self.state)


def digits_devices(n: int, hidden: int = 16, seed: int = 0) -> tuple[list[TorchTrainer], Arrays]:
    """``n`` devices holding a label-skewed split of the bundled 8x8 digits, and the initial
    parameters of the model a job names as ``{kind: mlp, inputs: 64, classes: 10, hidden, seed: 0}``."""
    single_threaded()
    split = digits(n, alpha=0.5, seed=seed)

    def model() -> Any:
        return mlp(64, 10, hidden=hidden, seed=0)

    devices = [TorchTrainer(model, X, y, seed=seed + i) for i, (X, y) in enumerate(split.clients)]
    return devices, get_params(model())


class _Recording:
    """A server half whose ``apply`` notes each total before handing it on."""

    def __init__(self, server: ServerAlgorithm, pending: list[ReceivedSum], sums: list[ReceivedSum]) -> None:
        self._server, self._pending, self._sums = server, pending, sums

    def __getattr__(self, name: str) -> Any:
        return getattr(self._server, name)

    def apply(self, state: Any, step: str, total: Mapping[str, np.ndarray]) -> Any:
        summed = self._pending.pop(0)
        summed.received = {name: np.array(value) for name, value in total.items()}
        self._sums.append(summed)
        return self._server.apply(state, step, total)


def run_in_process(algorithm: str, devices: Sequence[LocalTrainer], initial: Arrays, *,
                   options: Mapping[str, Any] | None = None, rounds: int = 2, cohort_size: int | None = None,
                   dropout: float = 0.2, seed: int = 0) -> InProcessRun:
    """``rounds`` rounds of installed ``algorithm`` over ``devices``, each step a real secure sum in
    which a ``dropout`` fraction of the cohort leaves at a random phase."""
    server, client = packages.get(algorithm).make(options)
    pending: list[ReceivedSum] = []
    sums: list[ReceivedSum] = []
    secure = SecureSum(dropout=dropout, seed=seed, job_id=f"test-{algorithm}")

    def summed(round_: int, step: StepSpec, contributions: Mapping[int, Arrays]):
        total, contributors = secure(round_, step, contributions)
        pending.append(ReceivedSum(round_, step, contributors, {},
                                   _expected(step, [contributions[d] for d in contributors])))
        return total, contributors

    state, logs = run_rounds(_Recording(server, pending, sums), client, list(devices), initial, rounds,
                             cohort_size or len(devices), summed, seed=seed)
    return InProcessRun(state, logs, sums)


def _expected(step: StepSpec, payloads: Sequence[Arrays]) -> dict[str, np.ndarray]:
    """What the codec's clipping makes of the payloads, summed exactly (in float64 and int64)."""
    out = {}
    for f in step.schema.fields:
        if f.kind is Kind.REAL:
            out[f.name] = sum((np.clip(np.asarray(p[f.name], np.float64), -f.clip, f.clip) for p in payloads),
                              np.zeros(f.shape))
        else:
            out[f.name] = sum((np.clip(np.asarray(p[f.name], np.int64), 0, int(f.clip)) for p in payloads),
                              np.zeros(f.shape, np.int64))
    return out


def assert_exact(sums: Sequence[ReceivedSum]) -> None:
    """Every total received is the sum of its contributors' payloads: counts equal, real values
    within the fixed point's rounding (each device's value is rounded to 2^-frac_bits once)."""
    assert sums, "no sum reached the server half"
    for s in sums:
        for f in s.step.schema.fields:
            got, want = np.asarray(s.received[f.name]), s.expected[f.name]
            if f.kind is Kind.REAL:
                bound = len(s.contributors) * 2.0 ** -f.frac_bits
                worst = float(np.max(np.abs(got - want), initial=0.0))
                assert worst <= bound, (f"round {s.round} step {s.step.name!r} field {f.name!r}: off by {worst}, "
                                        f"more than {len(s.contributors)} devices' rounding ({bound})")
            else:
                assert np.array_equal(got, want), (f"round {s.round} step {s.step.name!r} count {f.name!r}: "
                                                   f"{got.tolist()} received, {want.tolist()} sent")


@dataclass(frozen=True)
class OtherFleet:
    """A fleet beside the job's own, declaring ``algorithms`` (name -> version) as installed, and
    ``model_kinds`` (name -> version) and ``trainer_capabilities`` when given (None: what this
    environment has and what its trainers offer, as the job's own fleet declares)."""

    devices: Sequence[LocalTrainer]
    algorithms: Mapping[str, str]
    id_prefix: str = "other"
    model_kinds: Mapping[str, str] | None = None
    trainer_capabilities: Sequence[str] | None = None


@dataclass
class JobRun:
    job: admin_pb2.Job
    checks: list[SumCheck]
    stats: FleetStats
    others: list[FleetStats] = field(default_factory=list)

    @property
    def succeeded(self) -> bool:
        return self.job.state == common_pb2.JOB_STATE_SUCCEEDED

    def assert_exact(self) -> None:
        """The job succeeded and every committed sum is its contributors' inputs, added."""
        assert self.succeeded, f"job {self.job.job_id} ended {common_pb2.JobState.Name(self.job.state)}: " \
                               f"{self.job.message}"
        assert self.checks, "no committed sum was checked"
        wrong = [c for c in self.checks if c.outcome != EXACT]
        assert not wrong, f"committed sums not exact: {wrong}"


def run_job(spec_yaml: str, devices: Sequence[LocalTrainer], *, others: Sequence[OtherFleet] = (),
            dropout: float = 0.0, state_dir: Path | None = None, timeout_s: float = 300.0) -> JobRun:
    """Submit ``spec_yaml`` to a coordinator with two aggregators, all in this process on
    127.0.0.1, and run ``devices`` (with this environment's algorithms installed) and ``others``
    until the job ends. ``dropout``: the chance that a device leaves each session it is in."""
    with contextlib.ExitStack() as stack:
        where = state_dir or Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="tally-testing-")))
        return asyncio.run(asyncio.wait_for(_run_job(spec_yaml, devices, others, dropout, where), timeout_s))


async def _run_job(spec_yaml: str, devices: Sequence[LocalTrainer], others: Sequence[OtherFleet],
                   dropout: float, state_dir: Path) -> JobRun:
    async with _services(state_dir) as coordinator:
        target = f"127.0.0.1:{coordinator.port}"
        metadata = bearer_metadata(coordinator.admin_token)
        async with open_aio_channel(target, PLAINTEXT) as channel:
            admin = admin_pb2_grpc.AdminStub(channel)
            job_id = (await admin.SubmitJob(admin_pb2.SubmitJobRequest(spec_yaml=spec_yaml), metadata=metadata,
                                            timeout=30)).job_id
            plan = DropoutPlan(dropout, seed=1) if dropout else None
            fleets = [Fleet(target, PLAINTEXT, devices, enrolment_key=coordinator.enrolment_key, seed=1,
                            audit=True, dropout=plan, id_prefix="with")]
            fleets += [Fleet(target, PLAINTEXT, other.devices, enrolment_key=coordinator.enrolment_key, seed=2 + i,
                             id_prefix=other.id_prefix, algorithms=other.algorithms, model_kinds=other.model_kinds,
                             trainer_capabilities=other.trainer_capabilities)
                       for i, other in enumerate(others)]
            try:
                stats = await asyncio.gather(*(f.run(until=f.until_job_done(job_id, every_seconds=0.2))
                                               for f in fleets))
            finally:
                for fleet in fleets:
                    fleet.close()
            checks = await check_committed(admin, metadata, SumAudit.of(fleets[0].inputs or []))
            job = await admin.GetJob(admin_pb2.GetJobRequest(job_id=job_id), metadata=metadata, timeout=30)
    return JobRun(job, checks, stats[0], list(stats[1:]))


@contextlib.asynccontextmanager
async def _services(state_dir: Path) -> AsyncIterator[CoordinatorService]:
    public = load_or_create_ticket_key(state_dir).public_key()
    started: list[AggregatorService | CoordinatorService] = []
    try:
        aggregators = []
        for i in (1, 2):
            aggregator = AggregatorService("127.0.0.1:0", PLAINTEXT, public, f"agg-{i}")
            await aggregator.start()
            started.append(aggregator)
            aggregators.append(aggregator)
        coordinator = CoordinatorService("127.0.0.1:0", PLAINTEXT, state_dir,
                                         [(a.id, f"127.0.0.1:{a.control_port}") for a in aggregators],
                                         checkin_hold_s=2.0)
        await coordinator.start()
        started.append(coordinator)
        yield coordinator
    finally:
        for service in reversed(started):
            await service.stop(grace=0)
