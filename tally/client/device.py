"""A device: the check-in loop an edge application embeds.

``Device.run`` registers, checks in (respecting the coordinator's ``retry_after``), and for each
assignment downloads the model, computes the algorithm's contribution on local data and runs the
secure-aggregation session. Coordinator calls retry with backoff on transient statuses, and a
refused token (a coordinator restarted with a new secret, or an expired token) is renewed by
registering again, so a coordinator restart in the middle of a job is survived.

A job whose spec has an ``adaptation:`` option names it in its tasks. A device that had a task of
such a job adapts the final model on its own data once the job has succeeded (at its first
check-in without a task after that, or when it stops, whichever comes first) and keeps the
adapted model for ``adapted_model`` (``tally.client.adapted_models``); nothing of it is sent.

A simulated device of a load test is this same ``Device`` with ``hooks`` (``tally.client.hooks``);
a real one has none, and then nothing of the load tester runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from concurrent.futures import Executor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from tally import logs, modelio, models
from tally.algorithms import packages
from tally.algorithms.adaptation_options import JobAdaptation
from tally.algorithms.base import Arrays, LocalTrainer
from tally.client.adapted_models import AdaptedModels
from tally.client.channels import Channels, reconnect_options
from tally.client.contribution import (
    Contribution,
    JobTrainers,
    TaskError,
    capability_missing,
    model_mismatch,
    plan_task,
    version_mismatch,
)
from tally.client.download import Downloader, ModelCache
from tally.client.enrolment import register_request
from tally.client.hooks import DeviceHooks
from tally.client.input_ledger import LEDGER_FILE, InputLedger
from tally.client.local_state import LocalStateStore
from tally.client.metrics import ClientMetrics
from tally.client.onnx_model import OnnxModel
from tally.client.privacy_ledger import PRIVACY_LEDGER_FILE, PrivacyBudget, PrivacyLedger
from tally.client.reports import Outcome, TaskReports
from tally.client.retry import RETRYABLE, RetryPolicy, Stopped, pause
from tally.client.session import ABORTED, COMPLETED, DROPPED, SecAggSession
from tally.client.trust import check_assignment
from tally.secagg import DevicePolicy, SigningKey
from tally.security import TLSConfig, bearer_metadata
from tally.security.files import private_dir
from tally.security.tls_failures import specificity, tls_failure
from tally.version import VERSION as SDK_VERSION
from tally.wire.fields import WireError
from tally.wire.task_reports import REFUSALS
from tally.wire.tensors import tensors_to_proto
from tally.wire.v1 import common_pb2, coordinator_pb2, coordinator_pb2_grpc

log = logging.getLogger(__name__)

# The coordinator's names for its answers (tally_coordinator_checkins_total{outcome}).
_CHECKIN_OUTCOMES = {"task": "task", "retry_after": "retry"}
_REPORTED = {COMPLETED: Outcome.COMPLETED, DROPPED: Outcome.DROPPED, ABORTED: Outcome.ABORTED}
# Renew the token this long before it expires, so no call races its expiry.
TOKEN_RENEW_MARGIN_SECONDS = 60.0
# Floor on a retry_after wait: a coordinator answering 0 must not turn devices into a busy loop.
MIN_RETRY_AFTER_SECONDS = 0.01
# Extra wait on top of retry_after, as a fraction of it, so devices told the same delay spread out.
RETRY_AFTER_JITTER = 0.1
# How often a device asks whether a job it owes an adaptation for has ended, while it runs.
ADAPTATION_POLL_SECONDS = 5.0


@dataclass
class DeviceStats:
    device_id: str
    checkins: int = 0
    tasks_done: int = 0
    sessions_completed: int = 0
    sessions_aborted: int = 0
    dropouts: int = 0
    bytes_up: int = 0
    bytes_down: int = 0
    retries: int = 0
    clipped_values: int = 0
    last_model_version: str = ""
    # (job_id, round) of each session that completed with this device's input in the sum.
    contributed: list[tuple[str, int]] = field(default_factory=list)
    # Jobs this device was given tasks of, in order.
    jobs: list[str] = field(default_factory=list)
    # Sums refused because their DP noise was below this device's floor (--min-noise-multiplier).
    privacy_refusals: int = 0
    # The epsilon this device's own privacy ledger has spent over every job (at its budget's
    # delta, 1e-5 without one): ``tally.client.privacy_ledger``.
    epsilon: float = 0.0
    # The most specific reason a coordinator call had to be retried since the last call that
    # succeeded ("Register: UNAVAILABLE (TLS: ...)" before a bare "CheckIn: UNAVAILABLE"):
    # ``tally.security.tls_failures.specificity``.
    last_error: str = ""
    # Tasks that did not end with this device's input summed: job id -> report reason
    # ("model_mismatch") -> count.
    failures: dict[str, dict[str, int]] = field(default_factory=dict)
    # Whether a job of the device's population ever ran while it checked in, and whether none
    # runs now (the last check-in's answer).
    saw_running_job: bool = False
    population_idle: bool = False
    # Left the population for good (a churn profile's lifetime ended).
    left: bool = False
    # How the latest task ended, for people: "job J round R: completed", "... refused: why".
    last_task: str = ""
    # The coordinator status that stopped this device for good, when one did ("CODE: details").
    refusal: str = ""


class Device:
    """One device. ``trainer`` is the application's data and training (``tally.training.
    TorchTrainer``: cuda when present, else CPU), or a ``JobTrainers`` that builds each job's
    trainer from the job (``tally.training.bundled``). ``channels``, ``metrics`` and ``executor``
    (where local training runs) may be shared by many devices in one process (the fleet)."""

    def __init__(
        self,
        coordinator: str,
        tls: TLSConfig,
        device_id: str,
        trainer: LocalTrainer | JobTrainers,
        *,
        population: str = "default",
        cache_dir: Path | None = None,
        state_dir: Path | None = None,
        rng_seed: int | None = None,
        retry: RetryPolicy | None = None,
        channels: Channels | None = None,
        metrics: ClientMetrics | None = None,
        executor: Executor | None = None,
        attestation: str = "",
        on_update: Callable[[DeviceStats], None] | None = None,
        identity: SigningKey | None = None,
        policy: DevicePolicy | None = None,
        enrolment_credential: bytes = b"",
        coordinator_key: bytes | None = None,
        hooks: DeviceHooks | None = None,
        algorithms: Mapping[str, str] | None = None,
        privacy_budget: PrivacyBudget | None = None,
        model_kinds: Mapping[str, str] | None = None,
        trainer_capabilities: Iterable[str] | None = None,
    ) -> None:
        """``privacy_budget``: the (epsilon, delta) this device lets the releases it joins cost
        it, by its own account (``tally.client.privacy_ledger``); None accounts without refusing.
        ``hooks``: a simulated device's behaviour (``tally.loadtest.hooks``: availability,
        check-in period, compute and network speed, lifetime, dropouts and misbehaviour in
        sessions, synthetic inputs, the sum audit); None on a real device. ``algorithms``: name ->
        version of the algorithms the device declares and runs; None: those installed in its
        environment (``tally algorithms list``), which is what a real device declares. A simulated
        fleet may declare fewer, or other versions, to play a population of mixed installs.
        ``model_kinds``: likewise for the model kinds (None: ``tally.models.versions()``).
        ``trainer_capabilities``: what the trainer offers algorithms (``Algorithm.needs``); None: what
        it says of itself (``tally.algorithms.packages.trainer_capabilities``)."""
        self.coordinator = coordinator
        self.device_id = device_id
        self.trainer = trainer
        self.population = population
        self.algorithms = dict(packages.versions() if algorithms is None else algorithms)
        self.model_kinds = dict(models.versions() if model_kinds is None else model_kinds)
        self.trainer_capabilities = tuple(packages.trainer_capabilities(trainer) if trainer_capabilities is None
                                          else trainer_capabilities)
        self.attestation = attestation
        self.retry = retry or RetryPolicy()
        self.metrics = metrics or ClientMetrics()
        self.executor = executor
        self._owns_channels = channels is None
        self._channels = channels or Channels(
            tls, extra_options=reconnect_options(self.retry.initial_seconds, self.retry.max_seconds)
        )
        self._cache = ModelCache(cache_dir)
        self._encode_rng = np.random.default_rng(rng_seed)
        self._jitter = random.Random(None if rng_seed is None else f"jitter-{rng_seed}")
        self._on_update = on_update or (lambda stats: None)
        # Per-job algorithm state; on disk under ``state_dir`` so it survives a restart.
        self._local = LocalStateStore(state_dir)
        # Adaptations owed (jobs with an adaptation option this device had tasks of) and done.
        self._adapted = AdaptedModels(state_dir, self.metrics)
        self._adaptation_polled: dict[str, float] = {}
        self._reports = TaskReports()
        # Which round of each job this device sent an input in: on disk with a state directory,
        # written before the input leaves, so a restart cannot make it send a second one.
        self._inputs = InputLedger(private_dir(state_dir) / LEDGER_FILE if state_dir is not None else None)
        # What each release this device joined cost it, and the budget it enforces: beside it.
        self.privacy = PrivacyLedger(private_dir(state_dir) / PRIVACY_LEDGER_FILE if state_dir is not None else None,
                                     privacy_budget)
        self._token: str | None = None
        self._token_renew_at = 0.0
        self._register_lock = asyncio.Lock()
        self._stop: asyncio.Event | None = None
        self._running = False
        self.stats = DeviceStats(device_id, epsilon=self.privacy.epsilon())  # a restarted ledger's
        self.metrics.observe_epsilon(device_id, self.stats.epsilon)
        # A call succeeded since ``stats.last_error`` was set: the next error replaces it, however
        # vague (the trouble it named is over).
        self._error_over = False
        # The long-term key this device enrols with; it signs the device's session keys.
        self.identity = identity or SigningKey.generate()
        # Proof of provisioning for the coordinator's enrolment verifier (``tally enrol``).
        self.enrolment_credential = enrolment_credential
        # What the device accepts of a session's configuration, whatever the servers say.
        self.policy = policy or DevicePolicy()
        # The coordinator's session-ticket key: it signs the roster. Pinned when provisioned,
        # else learnt at the first registration over the coordinator's own TLS channel.
        self.coordinator_key = coordinator_key
        self.hooks = hooks

    # ---- public API ----------------------------------------------------------------------------

    async def run(self, stop: asyncio.Event | None = None, max_tasks: int | None = None) -> DeviceStats:
        """Check in and carry out tasks until ``max_tasks`` tasks are done or ``stop`` is set.

        ``stop`` is honoured at the next wait (check-in pacing, backoff, a later step's
        broadcast); a session interrupted that way ends for the aggregator as a dropout.
        Transient coordinator statuses are retried forever (by default); a status retrying
        cannot fix (PERMISSION_DENIED, INVALID_ARGUMENT, ...) raises ``grpc.aio.AioRpcError``."""
        self._stop = stop
        self._running = True
        started = time.monotonic()
        try:
            while max_tasks is None or self.stats.tasks_done < max_tasks:
                if stop is not None and stop.is_set():
                    break
                if self.hooks is not None:
                    offline = self.hooks.offline_for(time.monotonic() - started)
                    if offline is None:
                        self.stats.left = True  # churn: gone for good
                        break
                    try:
                        if offline:
                            await pause(offline, stop)
                    except Stopped:
                        break
                try:
                    await self._check_in_once()
                except Stopped:
                    break
            with contextlib.suppress(Stopped):  # a stop while the coordinator is unreachable
                await self._adapt_ended_jobs(every_seconds=0.0)
        finally:
            self._running = False
            await self._release_channels()
        return self.stats

    async def fetch_onnx(self, version: str | int = "latest") -> bytes:
        """The ONNX export of a committed global model: ``"latest"``, a round number, or
        ``"v<round>"``; for ``tally.client.OnnxModel.from_bytes``."""
        name = f"v{version}" if isinstance(version, int) else version
        if not name.endswith(".onnx"):
            name += ".onnx"
        try:
            data, digest = await self._downloader().fetch(name)
        finally:
            await self._release_channels()
        self._cache.put(digest, data)
        return data

    async def round_status(self, job_id: str) -> coordinator_pb2.RoundStatusResponse:
        return await self._call("RoundStatus", coordinator_pb2.RoundStatusRequest(job_id=job_id))

    async def job_states(self, job_ids: Iterable[str]) -> dict[str, str]:
        """Each job's state by name ("FAILED"), asked once each after ``run`` has ended with its
        stop event set (so a call that fails is not retried): how a device's command knows whether
        the jobs it served failed. A job the coordinator cannot be asked about is left out."""
        states: dict[str, str] = {}
        try:
            for job_id in job_ids:
                try:
                    status = await self.round_status(job_id)
                except (grpc.aio.AioRpcError, Stopped):
                    continue
                states[job_id] = common_pb2.JobState.Name(status.job_state).removeprefix("JOB_STATE_")
        finally:
            await self._release_channels()
        return states

    def local_state(self, job_id: str) -> Any:
        """The algorithm's on-device state for ``job_id`` as of the last session this device
        contributed to (None before the first)."""
        return self._local.get(job_id)

    def adapted_model(self, job_id: str) -> OnnxModel | None:
        """The model this device keeps for ``job_id`` after local adaptation, served with ONNX
        Runtime (no torch); None until the job has succeeded and the device has adapted it."""
        data = self._adapted.model(job_id)
        return None if data is None else OnnxModel.from_bytes(data)

    def adaptation_record(self, job_id: str) -> dict[str, Any] | None:
        """The device's who-gains record of ``job_id``'s adaptation: the method, which model it
        kept, and the accuracies on its held-out examples (``tally.client.adaptation.adapt_for_job``)."""
        return self._adapted.record(job_id)

    async def adapt(self, job_id: str, option: JobAdaptation) -> dict[str, Any]:
        """Adapt ``job_id``'s latest committed model (the final one once the job has succeeded) on
        this device's data as ``option`` says and keep it; return the who-gains record. Devices
        do this by themselves for jobs with an adaptation option; an application calls it for any
        other job of its population."""
        try:
            status = await self.round_status(job_id)
            if not status.model_digest:
                raise LookupError(f"job {job_id!r} has no committed model yet")
            blob = self._cache.get(status.model_digest)
            if blob is None:
                blob, digest = await self._downloader().fetch(status.model_version, status.model_digest)
                self._cache.put(digest, blob)
        finally:
            await self._release_channels()
        from tally.client.adaptation import (  # torch: only a device that adapts
            adapt_for_job,
            trainer_data,
        )

        def work():
            trainer = (self.trainer.for_job(job_id, None, {}, modelio.deserialize(blob))
                       if isinstance(self.trainer, JobTrainers) else self.trainer)
            module, features, labels = trainer_data(trainer)
            return adapt_for_job(module, modelio.deserialize(blob), features, labels, option)

        result = await asyncio.get_running_loop().run_in_executor(self.executor, work)
        record = {"job_id": job_id, "model_version": status.model_version, **result.record}
        self._adapted.keep(job_id, result.onnx, record)
        logs.event(log, "adapted", device_id=self.device_id, job_id=job_id, method=option.options.method,
                   kept=record["kept"], **{f"accuracy_{k}": v for k, v in record["accuracy"].items()})
        return record

    async def _release_channels(self) -> None:
        """Close the device's own channels when nothing uses them (they reopen on demand)."""
        if self._owns_channels and not self._running:
            await self._channels.close()

    # ---- check-in loop -------------------------------------------------------------------------

    async def _check_in_once(self) -> None:
        reports = self._reports.pending()
        request = coordinator_pb2.CheckInRequest(
            capabilities=coordinator_pb2.Capabilities(
                accelerator=self._accelerator(), sdk_version=SDK_VERSION,
                algorithms=[coordinator_pb2.InstalledAlgorithm(name=name, version=version)
                            for name, version in self.algorithms.items()],
                models=[coordinator_pb2.InstalledModel(name=name, version=version)
                        for name, version in self.model_kinds.items()],
                trainer_capabilities=self.trainer_capabilities),
            reports=reports,
            input_ledger=self._inputs.statement(),
            privacy_budget_spent=self.privacy.statement(),
        )
        response = await self._call("CheckIn", request)
        self._reports.delivered(reports)
        self.stats.checkins += 1
        which = response.WhichOneof("result")
        self.metrics.checkins.labels(outcome=_CHECKIN_OUTCOMES.get(which, "empty")).inc()
        idle = which == "retry_after" and response.retry_after.population_idle
        self.stats.population_idle = idle
        self.stats.saw_running_job |= not idle
        if which == "task":
            await self._do_task(response.task)
        self._on_update(self.stats)
        if which != "task":
            await self._adapt_ended_jobs(every_seconds=ADAPTATION_POLL_SECONDS)
            await self._pace(response.retry_after)

    def _accelerator(self) -> str:
        device = getattr(self.trainer, "device", None)
        return "cuda" if getattr(device, "type", str(device)) == "cuda" else "cpu"

    async def _do_task(self, task: coordinator_pb2.TaskAssignment) -> None:
        fields = {"job_id": task.job_id, "round": task.round, "task_id": task.task_id}
        if task.job_id not in self.stats.jobs:
            self.stats.jobs.append(task.job_id)
        logs.event(log, "task assigned", device_id=self.device_id, **fields)
        if self._inputs.already_sent(task.job_id, task.round):
            # Whoever asks: two sums of one round that differ by this device isolate its input.
            return self._refuse(task, "already_sent_input",
                                f"this device already sent an input in round {task.round} of job "
                                f"{task.job_id}", fields)
        mismatch = version_mismatch(task, self.algorithms)
        if mismatch is not None:
            return self._refuse(task, "algorithm_version", mismatch, fields)
        mismatch = model_mismatch(task, self.model_kinds)
        if mismatch is not None:
            return self._refuse(task, "model_version", mismatch, fields)
        mismatch = capability_missing(task, self.trainer_capabilities)
        if mismatch is not None:
            return self._refuse(task, "trainer_capability", mismatch, fields)
        try:
            plan = plan_task(task, self.policy.min_noise_multiplier)
        except (TaskError, WireError) as exc:
            return self._refuse(task, "invalid_task", exc, fields)
        try:
            check_assignment(task, plan.config, self.identity, self.policy, self.coordinator_key, time.time())
        except (TaskError, WireError) as exc:
            return self._refuse(task, "policy", exc, fields)
        if task.job_id in self.privacy.spent_jobs:  # stated at check-in; a coordinator may ignore it
            return self._refuse(task, "privacy_budget_spent",
                                f"this device's privacy budget is spent for job {task.job_id}", fields)
        self._expect_adaptation(task)
        contribution = Contribution(
            plan,
            self.trainer,
            self._local.get(task.job_id),
            self._encode_rng,
            lambda: self._load_model(task),
            lambda sum_id: self._fetch_step(task, sum_id),
            lambda step, values: self._reveal(task, step, values),
            self.executor,
            self.metrics,
            self.hooks,
            self.privacy,
        )
        contribution.start()
        session = SecAggSession(
            self._channels.get(task.aggregator_address), task, plan.config,
            self._computed(contribution), self.metrics,
            identity=self.identity, policy=self.policy,
            hooks=self.hooks.session() if self.hooks is not None else None,
            on_input=lambda: self._inputs.sent(task.job_id, task.round),
        )
        try:
            outcome = await session.run()
        finally:
            contribution.close()
        stats = self.stats
        stats.tasks_done += 1
        stats.bytes_up += outcome.bytes_up
        stats.bytes_down += outcome.bytes_down
        stats.clipped_values += contribution.clipped
        if outcome.status == COMPLETED:
            stats.sessions_completed += 1
        elif outcome.status == DROPPED:
            stats.dropouts += 1
        else:
            assert outcome.status == ABORTED
            stats.sessions_aborted += 1
        if outcome.label == "privacy_floor":
            stats.privacy_refusals += 1
        stats.epsilon = self.privacy.epsilon()
        self.metrics.observe_epsilon(self.device_id, stats.epsilon)
        if outcome.contributed:
            # Local state advances only when this device's input is in the round's sums.
            self._local[task.job_id] = contribution.local_state
            stats.contributed.append((task.job_id, task.round))
        if outcome.status != COMPLETED:
            self._count_failure(task.job_id, outcome.label or outcome.status)
        why = f": {outcome.label or outcome.reason}" if outcome.status != COMPLETED else " (input summed)"
        stats.last_task = f"job {task.job_id} round {task.round}: {outcome.status}{why}"
        self._reports.add(task, _REPORTED[outcome.status], outcome.label, outcome.reason,
                          sent_input=outcome.sent_input)

    def _count_failure(self, job_id: str, reason: str) -> None:
        reasons = self.stats.failures.setdefault(job_id, {})
        reasons[reason] = reasons.get(reason, 0) + 1
        if reason in REFUSALS:
            self.metrics.observe_refusal(reason)

    def _computed(self, contribution: Contribution) -> Callable[[str], Awaitable[np.ndarray]]:
        """The contribution's input, ready only after the device's simulated compute time."""
        seconds = self.hooks.compute_seconds() if self.hooks is not None else 0.0
        if not seconds:
            return contribution.ring_input

        async def ring_input(sum_id: str) -> np.ndarray:
            vector = await contribution.ring_input(sum_id)
            await pause(seconds, self._stop)
            return vector

        return ring_input

    def _expect_adaptation(self, task: coordinator_pb2.TaskAssignment) -> None:
        """Note the job's adaptation option; one that does not parse costs the adaptation, never
        the round (the device still trains)."""
        if not task.adaptation:
            return
        try:
            self._adapted.expect(task.job_id, JobAdaptation.from_json(task.adaptation))
        except (ValueError, TypeError) as exc:
            logs.event(log, "adaptation option refused", logging.WARNING, device_id=self.device_id,
                       job_id=task.job_id, reason=str(exc))

    async def _adapt_ended_jobs(self, every_seconds: float) -> None:
        """Adapt each job owed an adaptation that has succeeded; forget those that failed or
        were cancelled. A job is asked about at most once per ``every_seconds``."""
        now = time.monotonic()
        for job_id, option in self._adapted.pending().items():
            if now < self._adaptation_polled.get(job_id, float("-inf")) + every_seconds:
                continue
            self._adaptation_polled[job_id] = now
            try:
                status = await self.round_status(job_id)
                if status.job_state == common_pb2.JOB_STATE_SUCCEEDED:
                    await self.adapt(job_id, option)
                elif status.job_state in (common_pb2.JOB_STATE_FAILED, common_pb2.JOB_STATE_CANCELLED):
                    self._adapted.forget(job_id)
            except grpc.aio.AioRpcError as exc:  # asked again at a later check-in
                logs.event(log, "adaptation postponed", logging.WARNING, device_id=self.device_id, job_id=job_id,
                           reason=f"{exc.code().name}: {exc.details()}")
            except (TypeError, ValueError, LookupError, RuntimeError) as exc:  # this device cannot adapt this job
                logs.event(log, "adaptation failed", logging.WARNING, device_id=self.device_id, job_id=job_id,
                           reason=str(exc))
                self._adapted.failed(job_id, option.options.method)

    def _refuse(self, task: coordinator_pb2.TaskAssignment, label: str, reason: Exception | str,
                fields: dict[str, Any]) -> None:
        logs.event(log, "task refused", logging.WARNING, device_id=self.device_id, reason=str(reason), **fields)
        self.stats.tasks_done += 1
        self.stats.sessions_aborted += 1
        self.stats.last_task = f"job {task.job_id} round {task.round}: refused: {reason}"
        self._count_failure(task.job_id, label)
        self._reports.add(task, Outcome.REFUSED, label, str(reason),
                          sent_input=label == "already_sent_input")

    async def _load_model(self, task: coordinator_pb2.TaskAssignment) -> Arrays:
        start = time.perf_counter()
        blob = self._cache.get(task.model_digest)
        if blob is None:
            blob, digest = await self._downloader().fetch(task.model_version, task.model_digest)
            self._cache.put(digest, blob)
        self.metrics.download_seconds.observe(time.perf_counter() - start)
        self.stats.last_model_version = task.model_version
        return modelio.deserialize(blob)

    async def _fetch_step(self, task: coordinator_pb2.TaskAssignment, sum_id: str) -> coordinator_pb2.Step:
        request = coordinator_pb2.GetStepRequest(
            job_id=task.job_id, round=task.round, task_id=task.task_id, sum_id=sum_id
        )
        while True:
            response = await self._call("GetStep", request)
            if response.WhichOneof("result") == "step":
                return response.step
            await self._pace(response.retry_after)

    async def _reveal(self, task: coordinator_pb2.TaskAssignment, step: str, values: Arrays) -> None:
        """Send a reveal step's payload in the clear (the job opted in; the coordinator checks)."""
        request = coordinator_pb2.RevealRequest(
            job_id=task.job_id, round=task.round, task_id=task.task_id, step=step,
            values=tensors_to_proto(values),
        )
        await self._call("Reveal", request)

    # ---- coordinator calls ---------------------------------------------------------------------

    def _stub(self) -> coordinator_pb2_grpc.CoordinatorStub:
        return coordinator_pb2_grpc.CoordinatorStub(self._channels.get(self.coordinator))

    def _downloader(self) -> Downloader:
        def received(n: int) -> None:
            self.stats.bytes_down += n
            self.metrics.download_bytes.labels("model").inc(n)

        return Downloader(
            self._stub(), self._metadata, self._reregister, self.retry, self._jitter, self._stop,
            on_bytes=received, on_retry=self._count_retry, on_mismatch=self.metrics.digest_mismatches.inc,
        )

    async def _call(self, method: str, request: Any, *, authenticated: bool = True) -> Any:
        """A unary coordinator call with backoff on transient statuses; authenticated calls carry
        the token and register again, once, when the coordinator refuses it. ``request`` may be
        a function making it afresh for each attempt (a registration statement is signed with
        its time: one the coordinator took while its answer was lost would be a replay)."""
        attempt = 0
        reregistered = False
        while True:
            token = await self._current_token() if authenticated else None
            try:
                started = time.perf_counter()
                response = await getattr(self._stub(), method)(
                    request() if callable(request) else request,
                    metadata=bearer_metadata(token) if token else None,
                    timeout=self.retry.call_timeout,
                )
                self.metrics.observe_rpc(method, time.perf_counter() - started)
                self._error_over = True
                return response
            except grpc.aio.AioRpcError as exc:
                code = exc.code()
                if authenticated and code == grpc.StatusCode.UNAUTHENTICATED and not reregistered:
                    reregistered = True
                    await self._register(stale=token)
                    continue
                if code not in RETRYABLE or self.retry.exhausted(attempt):
                    raise
                self._count_retry(method, code, exc.details() or "")
            await pause(self.retry.delay(attempt, self._jitter), self._stop)
            attempt += 1

    async def _pace(self, retry_after: coordinator_pb2.RetryAfter) -> None:
        """Wait as the coordinator asked, plus a little jitter so a fleet spreads out."""
        seconds = max(retry_after.seconds, MIN_RETRY_AFTER_SECONDS)
        wait = self.hooks.checkin_wait(seconds) if self.hooks is not None else None
        if wait is None:
            wait = seconds * (1 + RETRY_AFTER_JITTER * self._jitter.random())
        await pause(wait, self._stop)

    def _count_retry(self, method: str, code: grpc.StatusCode, details: str = "") -> None:
        """A call to be retried; a TLS handshake failure is named as one, not as a dead address."""
        tls = tls_failure(details)
        error = f"{method}: {code.name}" + (f" ({tls})" if tls else "")
        changed = False
        if self._error_over or specificity(error) >= specificity(self.stats.last_error):
            changed, self.stats.last_error = error != self.stats.last_error, error
        self._error_over = False
        self.stats.retries += 1
        self.metrics.retries.labels(method, code.name).inc()
        logs.event(log, "rpc retry", device_id=self.device_id, method=method, code=code.name,
                   **({"tls": tls} if tls else {}))
        if changed:  # a new kind of trouble is news; the same one again is not
            self._on_update(self.stats)

    async def _current_token(self) -> str:
        """The token, registering first when there is none or it is about to expire."""
        if self._token is None or (self._token_renew_at and time.time() >= self._token_renew_at):
            await self._register(stale=self._token)
        assert self._token is not None
        return self._token

    async def _metadata(self) -> tuple[tuple[str, str], ...]:
        return bearer_metadata(await self._current_token())

    async def _reregister(self) -> None:
        await self._register(stale=self._token)

    async def _register(self, stale: str | None) -> None:
        """Replace the ``stale`` token (None: there is none yet), once for all concurrent callers."""
        async with self._register_lock:
            if self._token is not None and self._token != stale:
                return  # another caller already renewed it
            response = await self._call("Register", lambda: register_request(
                self.identity, self.device_id, self.population, self.enrolment_credential,
                time.time(), self.attestation,
            ), authenticated=False)
            if self.coordinator_key is None:
                self.coordinator_key = response.coordinator_key
            elif response.coordinator_key != self.coordinator_key:
                raise PermissionError("the coordinator's ticket key is not the one this device was provisioned with")
            self._token = response.token
            self._token_renew_at = 0.0
            if response.HasField("expires_at"):
                expires = response.expires_at.ToSeconds()
                lifetime = max(expires - time.time(), 0.0)
                self._token_renew_at = expires - min(TOKEN_RENEW_MARGIN_SECONDS, lifetime / 2)
            logs.event(log, "registered", device_id=self.device_id, population=self.population)
