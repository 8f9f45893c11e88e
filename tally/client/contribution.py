"""A device's inputs to the sums of one task: the algorithm's client half, run on local data,
encoded with the server's schema into the session's ring.

The first step's input is computed as soon as the task arrives (model download and local
training overlap the key exchange); later steps of a multi-sum round wait for their broadcast,
which depends on the round's earlier sums. Local state advances step by step here but is
committed by the device only when the session completes with this device's input in the sum.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import numpy as np

from tally import algorithms
from tally.algorithms import packages
from tally.algorithms.base import Arrays, LocalTrainer
from tally.client.hooks import DeviceHooks
from tally.client.metrics import ClientMetrics
from tally.client.privacy_ledger import NO_NOISE, PrivacyLedger, Release
from tally.codec import CodecError, PayloadSchema
from tally.evaluation import EvaluatedClient
from tally.privacy.payload import NoiseBelowFloor, PrivateClient, ring_encode, verified_noise
from tally.secagg import SessionConfig
from tally.wire.protocol import from_proto
from tally.wire.sums import schema_from_proto
from tally.wire.tensors import tensors_from_proto
from tally.wire.v1 import coordinator_pb2


@runtime_checkable
class JobTrainers(Protocol):
    """A device whose training depends on the job: given in place of a ``LocalTrainer``, it is
    asked for each job's trainer once the job's model is downloaded (``tally.training.bundled``:
    the bundled devices of ``tally client`` and ``tally fleet``, which learn the model and the
    algorithm from the job rather than from flags)."""

    def for_job(self, job_id: str, algorithm: str | None, options: Mapping[str, Any],
                model: Mapping[str, np.ndarray]) -> LocalTrainer:
        """The trainer for ``job_id``, whose ``algorithm`` (None: any, e.g. to adapt its final
        model) runs with ``options`` from the initial ``model``; ``ModelMismatch`` refuses it."""
        ...


class TaskError(ValueError):
    """An assignment the device cannot carry out as given (inconsistent ids, sizes or options)."""


@dataclass(frozen=True)
class TaskPlan:
    """The parts of a TaskAssignment the device checked before joining the session."""

    task: coordinator_pb2.TaskAssignment
    config: SessionConfig
    first_sum: str
    client_half: PrivateClient


def version_mismatch(task: coordinator_pb2.TaskAssignment, installed: Mapping[str, str]) -> str | None:
    """Why this device will not run ``task``'s algorithm: it has none of that name, or another
    version than the coordinator's (a payload computed by another version may mean something else
    to the server half). None when they agree, or the coordinator names no version (an older one)."""
    return _not_installed("algorithm", task.algorithm, task.algorithm_version, installed)


def model_mismatch(task: coordinator_pb2.TaskAssignment, installed: Mapping[str, str]) -> str | None:
    """Why this device will not train ``task``'s model kind: it has none of that name, or another
    version than the coordinator built the job's model with. None when they agree, or the
    coordinator names no version (a kind registered in its process only, or an older coordinator)."""
    return _not_installed("model kind", task.model_kind, task.model_kind_version, installed)


def _not_installed(what: str, name: str, version: str, installed: Mapping[str, str]) -> str | None:
    if not version:
        return None
    own = installed.get(name)
    if own == version:
        return None
    has = f"has version {own!r}" if own is not None else "does not have it installed"
    return (f"the job runs {what} {name!r} version {version!r}; this device {has} "
            "(devices run only what their operator installed)")


def capability_missing(task: coordinator_pb2.TaskAssignment, offered: Iterable[str]) -> str | None:
    """Why this device's trainer cannot answer ``task``'s algorithm: it needs a capability the
    trainer does not offer (the algorithm as installed here says what it needs)."""
    found = packages.catalogue().installed.get(task.algorithm)
    missing = [need for need in (found.item.needs if found is not None else ()) if need not in set(offered)]
    if not missing:
        return None
    return (f"algorithm {task.algorithm!r} needs trainer capability {', '.join(map(repr, missing))}, "
            "which this device's trainer does not offer")


def plan_task(task: coordinator_pb2.TaskAssignment, min_noise_multiplier: float = 0.0) -> TaskPlan:
    """Validate an assignment; ``TaskError``/``WireError`` name what is wrong. A step whose DP
    noise is below ``min_noise_multiplier`` is refused when its broadcast arrives."""
    if not task.HasField("session") or not task.HasField("step"):
        raise TaskError("task assignment without a session or a step")
    config = from_proto(task.session)
    first_sum = task.step.sum_id or task.step.schema.sum_id
    if first_sum not in {s.sum_id for s in config.sums}:
        raise TaskError(f"step sum {first_sum!r} is not a sum of session {config.ref.session_id!r}")
    if not 1 <= task.device_index <= config.n:
        raise TaskError(f"device index {task.device_index} is outside the cohort 1..{config.n}")
    try:
        options = json.loads(task.algorithm_options or "{}")
        _, client_half = algorithms.make(task.algorithm, options)
    except (ValueError, TypeError) as exc:
        raise TaskError(f"algorithm {task.algorithm!r}: {exc}") from exc
    # Applies the differential privacy a step's broadcast asks for (tally/privacy), none otherwise,
    # around the federated evaluation its plan asks for (tally/evaluation), none otherwise.
    private = PrivateClient(EvaluatedClient(client_half), min_noise_multiplier, config.n)
    return TaskPlan(task, config, first_sum, private)


class Contribution:
    """``load_model`` returns the first step's base broadcast (the downloaded model);
    ``fetch_step`` returns the Step of a later sum once the coordinator has it. ``hooks``: a
    simulated device's (``tally.client.hooks``), which may supply the values and sees each input.
    ``privacy``: the device's privacy ledger; each step's release is admitted against its budget
    before training and charged when its input is handed to the session."""

    def __init__(
        self,
        plan: TaskPlan,
        trainer: LocalTrainer | JobTrainers,
        local_state: Any,
        rng: np.random.Generator,
        load_model: Callable[[], Awaitable[Arrays]],
        fetch_step: Callable[[str], Awaitable[coordinator_pb2.Step]],
        reveal: Callable[[str, Arrays], Awaitable[None]],
        executor: Executor | None,
        metrics: ClientMetrics,
        hooks: DeviceHooks | None = None,
        privacy: PrivacyLedger | None = None,
    ) -> None:
        self.plan = plan
        self._trainer = trainer
        self.local_state = local_state
        self.rng = rng
        self.clipped = 0
        self._load_model = load_model
        self._fetch_step = fetch_step
        self._reveal = reveal
        self._executor = executor
        self._metrics = metrics
        self._hooks = hooks
        self._privacy = privacy or PrivacyLedger()
        self._releases: dict[str, Release] = {}  # admitted, charged when handed to the session
        self._first: asyncio.Future[np.ndarray] | None = None

    def start(self) -> None:
        """Begin the first step's computation in the background."""
        if self._first is None:
            self._first = asyncio.ensure_future(self._first_input())

    def close(self) -> None:
        """Stop a computation the session no longer needs (it ended before asking)."""
        if self._first is None:
            return
        if not self._first.done():
            self._first.cancel()
        elif not self._first.cancelled():
            self._first.exception()  # a failure nobody asked for is not an unhandled error

    async def ring_input(self, sum_id: str) -> np.ndarray:
        """The ring-encoded input of ``sum_id``, as ``SecAggClient.provide_input`` takes it."""
        if sum_id == self.plan.first_sum:
            self.start()
            assert self._first is not None
            vector = await self._first
        else:
            step = await self._fetch_step(sum_id)
            while step.reveal:
                # A reveal step the job opted in to precedes this sum: its payload goes to the
                # coordinator in the clear, then the sum's own step follows.
                await self._reveal_step(step)
                step = await self._fetch_step(sum_id)
            if (step.sum_id or step.schema.sum_id) != sum_id:
                raise TaskError(f"asked for the step of sum {sum_id!r}, got {step.sum_id!r}")
            vector = await self._compute(step, tensors_from_proto(step.broadcast))
        # Charged (fsynced) before the session masks and sends it: a restart cannot forget it.
        await asyncio.to_thread(self._privacy.record, self._releases.pop(sum_id))
        return vector

    @property
    def trainer(self) -> LocalTrainer:
        """The trainer of this task; a ``JobTrainers``'s is known once the model is downloaded."""
        if isinstance(self._trainer, JobTrainers):
            raise TaskError("the job's trainer is built from its model, which is not downloaded yet")
        return self._trainer

    async def _first_input(self) -> np.ndarray:
        step = self.plan.task.step
        model = await self._load_model()
        if isinstance(self._trainer, JobTrainers):  # the job's trainer, built from the job (torch: off the loop)
            task = self.plan.task
            self._trainer = await asyncio.get_running_loop().run_in_executor(
                self._executor, self._trainer.for_job, task.job_id, task.algorithm,
                json.loads(task.algorithm_options or "{}"), model)
        broadcast = dict(model)
        broadcast.update(tensors_from_proto(step.broadcast))  # the step's tensors override
        return await self._compute(step, broadcast)

    async def _reveal_step(self, step: coordinator_pb2.Step) -> None:
        ref = self.plan.config.ref
        release = Release(ref.job_id, ref.round, step.name, ref.session_id, NO_NOISE, 0)
        self._privacy.admit(release)  # a payload in the clear is an unbounded release
        loop = asyncio.get_running_loop()
        values, state = await loop.run_in_executor(
            self._executor, self.plan.client_half.contribute, step.name, tensors_from_proto(step.broadcast),
            self.trainer, self.local_state,
        )
        await asyncio.to_thread(self._privacy.record, release)
        await self._reveal(step.name, values)
        self.local_state = state

    async def _compute(self, step: coordinator_pb2.Step, broadcast: Arrays) -> np.ndarray:
        sum_id, schema = schema_from_proto(step.schema)
        try:
            spec = self.plan.config.sum_spec(sum_id)
        except KeyError:
            raise TaskError(f"schema of sum {sum_id!r}, which the session does not have") from None
        if schema.dim != spec.dim:
            raise TaskError(f"sum {sum_id!r}: the schema has {schema.dim} values, the session {spec.dim}")
        # A ring the cohort's sum could wrap would corrupt everyone's result: refuse it here too.
        schema.check_bits(self.plan.config.n, spec.bits)
        loop = asyncio.get_running_loop()
        start = time.perf_counter()
        try:
            vector, state, clipped = await loop.run_in_executor(
                self._executor, self._contribute, step.name, broadcast, schema, sum_id, spec.bits
            )
        except NoiseBelowFloor as exc:
            self._metrics.privacy_checks.labels(outcome=exc.reason).inc()
            raise
        if self.plan.client_half.min_noise_multiplier > 0:
            self._metrics.privacy_checks.labels(outcome="accepted").inc()
        self._metrics.compute_seconds.observe(time.perf_counter() - start)
        self._metrics.encoded_values.inc(schema.dim)
        self._metrics.clipped_values.inc(clipped)
        self.local_state = state
        self.clipped += clipped
        return vector

    def _contribute(
        self, step: str, broadcast: Arrays, schema: PayloadSchema, sum_id: str, bits: int
    ) -> tuple[np.ndarray, Any, int]:
        task = self.plan.task
        self.plan.client_half.check(broadcast)  # synthetic updates too: the floor is the device's
        self._admit(sum_id, broadcast, schema.dim)
        values = self._hooks.inputs(task, step, schema) if self._hooks is not None else None
        if values is not None:
            state = self.local_state
        else:
            values, state = self.plan.client_half.contribute(step, broadcast, self.trainer, self.local_state)
        vector, clipped = ring_encode(schema, values, self.rng, bits)
        if self._hooks is not None:
            self._hooks.input_encoded(task, self.plan.config.ref.session_id, sum_id, bits, vector)
        return vector, state, clipped

    def _admit(self, sum_id: str, broadcast: Arrays, dim: int) -> None:
        """Account the release this step asks for before any training: ``BudgetSpent`` when it
        would take the ledger past the device's budget, ``TaskError`` when its DP parameters
        lack what the device needs to account it."""
        config = self.plan.config
        try:
            noise, honest = verified_noise({k: v for k, v in broadcast.items() if k.startswith("dp.")}, config.n, dim)
        except CodecError as exc:
            raise TaskError(str(exc)) from None
        release = Release(config.ref.job_id, config.ref.round, sum_id, config.ref.session_id, noise, honest)
        self._privacy.admit(release)
        self._releases[sum_id] = release
