"""The fleet simulator: many virtual devices in one process, for load tests and demos.

Every simulated device is a real ``Device`` (its own token, model download, local training and
secure-aggregation stream) whose hooks (``tally.loadtest.hooks.SimulatedDevice``) give it its
behaviour, dropouts, synthetic inputs and audit; they share one asyncio loop, one channel per
target, one metrics registry and one training thread pool, so a laptop can play a fleet of a
thousand.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import os
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

import grpc
import numpy as np
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

from tally import logs
from tally.algorithms.base import LocalTrainer
from tally.client.channels import Channels, reconnect_options
from tally.client.device import Device, DeviceStats
from tally.client.enrolment import simulated_identity
from tally.client.metrics import ClientMetrics
from tally.client.privacy_ledger import PrivacyBudget
from tally.client.retry import CoordinatorUnreachable, RetryPolicy, Stopped, pause
from tally.loadtest.behaviour import BehaviourProfile, DeviceTraits
from tally.loadtest.dropout import DropoutPlan
from tally.loadtest.hooks import SimulatedDevice
from tally.loadtest.sum_audit import InputFingerprint
from tally.loadtest.synthetic import SyntheticUpdates
from tally.secagg import DevicePolicy
from tally.security import TLSConfig
from tally.security.enrolment import SharedKeyEnrolment
from tally.security.tls_failures import specificity
from tally.wire.v1 import common_pb2

log = logging.getLogger(__name__)
# The random stream a device's arrival time is drawn from, apart from its other draws.
_RAMP_STREAM = 0x2A3F
FINISHED_JOB_STATES = frozenset(
    {common_pb2.JOB_STATE_SUCCEEDED, common_pb2.JOB_STATE_FAILED, common_pb2.JOB_STATE_CANCELLED}
)

Until = int | Callable[["FleetStats"], bool | Awaitable[bool]]


@dataclass
class FleetStats:
    devices: int
    checkins: int
    tasks_done: int
    sessions_completed: int
    sessions_aborted: int
    dropouts: int
    bytes_up: int
    bytes_down: int
    retries: int
    clipped_values: int
    last_model_version: str
    # job_id -> rounds in which at least one of the fleet's devices contributed to the sum.
    rounds: dict[str, list[int]]
    elapsed_seconds: float
    # Jobs any device was given tasks of, in the order first seen.
    jobs: list[str]
    # The most specific reason any device had to retry a coordinator call ("" when none did).
    last_error: str
    # Some device saw a job of the population running, and every device's last check-in said
    # none runs now.
    jobs_over: bool
    # Devices that left the population for good (churn); ``devices`` counts them and their
    # replacements.
    left: int = 0
    # Devices stopped by a coordinator status that retrying cannot fix (a missing enrolment
    # credential, a revoked device), and the first one's reason ("UNAUTHENTICATED: ...").
    refused: int = 0
    refusal: str = ""
    # Tasks that did not end with the device's input summed, over all devices: job id -> report
    # reason -> count.
    failures: dict[str, dict[str, int]] = field(default_factory=dict)
    # The fleet gave up after this many seconds without a task (``task_timeout``); 0: it did not.
    no_task_within_s: float = 0.0
    # The state of each job of ``jobs`` as the coordinator last gave it ("FAILED"; absent when
    # it could not be asked).
    job_states: dict[str, str] = field(default_factory=dict)

    @classmethod
    def collect(cls, stats: Sequence[DeviceStats], last_model_version: str, elapsed: float) -> FleetStats:
        rounds: dict[str, set[int]] = {}
        for s in stats:
            for job, round_ in s.contributed:
                rounds.setdefault(job, set()).add(round_)
        total = lambda name: sum(getattr(s, name) for s in stats)  # noqa: E731
        return cls(
            devices=len(stats),
            checkins=total("checkins"),
            tasks_done=total("tasks_done"),
            sessions_completed=total("sessions_completed"),
            sessions_aborted=total("sessions_aborted"),
            dropouts=total("dropouts"),
            bytes_up=total("bytes_up"),
            bytes_down=total("bytes_down"),
            retries=total("retries"),
            clipped_values=total("clipped_values"),
            last_model_version=last_model_version,
            rounds={job: sorted(r) for job, r in rounds.items()},
            elapsed_seconds=elapsed,
            jobs=list(dict.fromkeys(job for s in stats for job in s.jobs)),
            last_error=_most_specific(s.last_error for s in stats),
            jobs_over=any(s.saw_running_job for s in stats)
            and all(s.population_idle for s in stats if not s.left and not s.refusal),
            left=sum(s.left for s in stats),
            refused=sum(bool(s.refusal) for s in stats),
            refusal=next((s.refusal for s in stats if s.refusal), ""),
            failures=_add_counts(s.failures for s in stats),
        )

    @classmethod
    def combine(cls, parts: Sequence[FleetStats]) -> FleetStats:
        """The statistics of one fleet whose devices ran in several processes."""
        total = lambda name: sum(getattr(s, name) for s in parts)  # noqa: E731
        rounds: dict[str, set[int]] = {}
        for s in parts:
            for job, rs in s.rounds.items():
                rounds.setdefault(job, set()).update(rs)
        return cls(
            **{name: total(name) for name in ("devices", "checkins", "tasks_done", "sessions_completed",
                                             "sessions_aborted", "dropouts", "bytes_up", "bytes_down",
                                             "retries", "clipped_values", "left", "refused")},
            last_model_version=next((s.last_model_version for s in parts if s.last_model_version), ""),
            rounds={job: sorted(r) for job, r in rounds.items()},
            elapsed_seconds=max((s.elapsed_seconds for s in parts), default=0.0),
            jobs=list(dict.fromkeys(job for s in parts for job in s.jobs)),
            last_error=_most_specific(s.last_error for s in parts),
            jobs_over=all(s.jobs_over for s in parts),
            refusal=next((s.refusal for s in parts if s.refusal), ""),
            failures=_add_counts(s.failures for s in parts),
            job_states={job: state for s in parts for job, state in s.job_states.items()},
            no_task_within_s=max((s.no_task_within_s for s in parts), default=0.0),
        )

    @property
    def max_rounds(self) -> int:
        """Rounds contributed to in the job the fleet worked on most."""
        return max((len(r) for r in self.rounds.values()), default=0)

    def to_dict(self) -> dict:
        return asdict(self)

    def summary(self) -> str:
        if self.checkins == 0 and self.last_error and not self.refused:
            return f"waiting for the coordinator ({self.retries} retries, last {self.last_error})"
        return (
            f"tasks {self.tasks_done} · sessions ok {self.sessions_completed} "
            f"aborted {self.sessions_aborted} · dropouts {self.dropouts} · "
            f"up {_human_bytes(self.bytes_up)} down {_human_bytes(self.bytes_down)}"
            + (f" · refused {self.refused}" if self.refused else "")
        )

    def refusal_message(self) -> str:
        """For people, when devices were refused: how many, and why the first was."""
        return (f"{self.refused} of {self.devices} devices stopped: the coordinator refused them "
                f"({self.refusal}); retrying cannot fix that")


def _most_specific(errors: Iterable[str]) -> str:
    """The error that tells the operator most (a named TLS cause first), the earliest of equals."""
    return max(errors, key=specificity, default="")


def _add_counts(counts: Iterable[dict[str, dict[str, int]]]) -> dict[str, dict[str, int]]:
    total: dict[str, dict[str, int]] = {}
    for part in counts:
        for job, reasons in part.items():
            into = total.setdefault(job, {})
            for reason, n in reasons.items():
                into[reason] = into.get(reason, 0) + n
    return total


def _human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def device_ids(prefix: str, count: int, first: int = 0) -> list[str]:
    """The ids of devices ``first``.. of a fleet, in order (a synthetic device's inputs derive
    from its id)."""
    return [f"{prefix}-{i:05d}" for i in range(first, first + count)]


class Fleet:
    """``trainers[i]`` is simulated device i's data and training (``SyntheticUpdates`` for a
    load test without data). Device ids are ``<id_prefix>-<i:05d>``; device i's encoding
    randomness is seeded from (seed, i)."""

    def __init__(
        self,
        coordinator: str,
        tls: TLSConfig,
        trainers: Sequence[LocalTrainer],
        *,
        dropout: DropoutPlan | None = None,
        population: str = "default",
        seed: int = 0,
        cache_dir: Path | None = None,
        retry: RetryPolicy | None = None,
        metrics: ClientMetrics | None = None,
        id_prefix: str = "sim",
        training_threads: int | None = None,
        device_policy: DevicePolicy | None = None,
        enrolment_key: bytes | None = None,
        state_dir: Path | None = None,
        audit: bool = False,
        first_index: int = 0,
        profile: BehaviourProfile | None = None,
        ramp_s: float = 0.0,
        algorithms: Mapping[str, str] | None = None,
        privacy_budget: PrivacyBudget | None = None,
        model_kinds: Mapping[str, str] | None = None,
        trainer_capabilities: Sequence[str] | None = None,
    ) -> None:
        """``state_dir``: each device keeps its per-job local state (LG-FedAvg's local layers,
        SuPerFed's personal model) in ``state_dir/<device id>``, across restarts. ``audit``:
        devices record the fingerprint of every input (``self.inputs``) so that ``sum_audit``
        can check the committed sums against them. ``first_index``: this process plays devices
        ``first_index`` onwards of a fleet spread over several (ids and seeds follow the index,
        so N shards are the same fleet as one process). ``profile``: how the devices behave
        (``tally.loadtest.behaviour``); a device that leaves by churn is replaced by a new one.
        ``ramp_s``: devices come online over this many seconds, each at its own time (uniform,
        from the seed and its index), as a real population does: 100,000 devices registering in
        one instant swamp the machine playing them before any round can run. ``algorithms``: what
        every device declares it has installed (``Device``; None: this environment's), and
        ``model_kinds`` the model kinds; ``trainer_capabilities``: what every device's trainer offers
        (None: what each trainer says of itself).
        ``privacy_budget``: each device's own (``tally.client.privacy_ledger``), its ledger under
        ``state_dir``."""
        if ramp_s < 0:
            raise ValueError(f"ramp_s must be >= 0, got {ramp_s}")
        self.ramp_s = ramp_s
        if not trainers:
            raise ValueError("a fleet needs at least one device")
        policy = retry or RetryPolicy()
        self.channels = Channels(tls, extra_options=reconnect_options(policy.initial_seconds, policy.max_seconds))
        self.metrics = metrics or ClientMetrics()
        self.executor = ThreadPoolExecutor(
            max_workers=training_threads or os.cpu_count() or 1, thread_name_prefix="tally-train"
        )
        self._changed: asyncio.Event | None = None
        self._last_version = ""
        self.coordinator = coordinator
        # The fleet stands in for the operator's provisioning: with the coordinator's enrolment
        # key it hands each simulated device its credential.
        self.profile = profile
        self._seed = seed
        self._trainers = list(trainers)
        self._ids = device_ids(id_prefix, len(trainers), first_index)
        self._first_index = first_index
        self.inputs: list[InputFingerprint] | None = [] if audit else None
        self._dropout = dropout
        self._device_options = dict(
            population=population, cache_dir=cache_dir, retry=policy, channels=self.channels,
            metrics=self.metrics, executor=self.executor, on_update=self._updated, policy=device_policy,
            algorithms=algorithms, model_kinds=model_kinds, trainer_capabilities=trainer_capabilities,
            privacy_budget=privacy_budget)
        self._enrolment_key = enrolment_key
        self._state_dir = state_dir
        self.devices = [self._device(i, 0) for i in range(len(trainers))]
        # Devices that left the population for good (churn); each slot's replacement is in ``devices``.
        self.departed: list[Device] = []

    def behave(self, profile: BehaviourProfile | None) -> None:
        """From the next check-in or session on, the devices follow ``profile`` (None: plain
        protocol-following devices); a fault campaign changes it between rounds."""
        self.profile = profile
        for device in self.devices:
            self._hooks(device).traits = self._traits(device.device_id)

    def _device(self, i: int, generation: int) -> Device:
        """Slot i's device; a churned slot's replacement (generation > 0) is a new device: its
        own id, identity and registration, the same data."""
        device_id = self._ids[i] if generation == 0 else f"{self._ids[i]}-g{generation}"
        enrolment = SharedKeyEnrolment(self._enrolment_key) if self._enrolment_key is not None else None
        options = self._device_options
        trainer = self._trainers[i]
        hooks = SimulatedDevice(
            device_id, dropout=self._dropout, traits=self._traits(device_id),
            synthetic=trainer if isinstance(trainer, SyntheticUpdates) else None, audit=self.inputs,
            metrics=self.metrics)
        return Device(
            self.coordinator,
            self.channels.tls,
            device_id,
            trainer,
            rng_seed=int(np.random.SeedSequence(
                [self._seed, self._first_index + i, *([generation] if generation else [])]).generate_state(1)[0]),
            identity=simulated_identity(self._enrolment_key, device_id) if enrolment else None,
            enrolment_credential=enrolment.credential(options["population"], device_id) if enrolment else b"",
            state_dir=self._state_dir / device_id if self._state_dir is not None else None,
            hooks=hooks,
            **options,
        )

    def _traits(self, device_id: str) -> DeviceTraits | None:
        return self.profile.traits(self._seed, device_id) if self.profile is not None else None

    @staticmethod
    def _hooks(device: Device) -> SimulatedDevice:
        assert isinstance(device.hooks, SimulatedDevice), "every device of a fleet is simulated"
        return device.hooks

    def stats(self, elapsed: float = 0.0) -> FleetStats:
        return FleetStats.collect([d.stats for d in (*self.devices, *self.departed)], self._last_version, elapsed)

    async def run(
        self,
        stop: asyncio.Event | None = None,
        until: Until | None = None,
        *,
        max_tasks_per_device: int | None = None,
        progress: bool = False,
        console: Console | None = None,
        poll_seconds: float = 0.5,
        connect_timeout: float | None = None,
        task_timeout: float | None = None,
        on_stats: Callable[[FleetStats], None] | None = None,
    ) -> FleetStats:
        """Run every device until ``stop`` is set, ``until`` holds (an int: that many rounds
        contributed to; a predicate on the stats, possibly async) or each device has done
        ``max_tasks_per_device`` tasks. ``progress`` shows a live display; ``on_stats`` gets
        the same snapshots (a fleet of several processes reports them to its parent). With
        ``connect_timeout``, raise ``CoordinatorUnreachable`` when no device has completed a
        check-in by then, rather than retry in silence forever. With ``task_timeout``, stop when no
        device has been given a task by then (``FleetStats.no_task_within_s`` says so)."""
        predicate = _rounds_reached(until) if isinstance(until, int) else until
        self._changed = asyncio.Event()
        halt = asyncio.Event()
        start = time.perf_counter()
        gave_up = 0.0
        runners = [asyncio.ensure_future(self._slot(i, halt, max_tasks_per_device)) for i in range(len(self.devices))]
        everyone = asyncio.gather(*runners)
        # Ended early (a stop, a connect timeout), the runners are cancelled and `everyone` holds a
        # CancelledError nobody awaits: retrieved here, or asyncio prints it as a traceback at exit.
        everyone.add_done_callback(lambda done: done.cancelled() or done.exception())
        total = max_tasks_per_device * len(self.devices) if max_tasks_per_device else None
        try:
            with progress_display(progress, console, total) as show:
                while not everyone.done():
                    await self._wake(everyone, stop, poll_seconds)
                    stats = self.stats(time.perf_counter() - start)
                    show(stats)
                    if on_stats is not None:
                        on_stats(stats)
                    if stats.checkins == 0 and connect_timeout is not None and stats.elapsed_seconds > connect_timeout:
                        raise CoordinatorUnreachable.after("no device reached", self.coordinator, connect_timeout,
                                                           stats.last_error)
                    if halt.is_set():
                        continue  # devices are finishing their tasks
                    if task_timeout is not None and not stats.jobs and stats.elapsed_seconds > task_timeout:
                        gave_up = task_timeout
                        halt.set()
                        continue
                    if (stop is not None and stop.is_set()) or (predicate and await _holds(predicate, stats)):
                        halt.set()
                await everyone
            halt.set()  # from here a call that fails is not retried
            # Each job's state as the fleet ends, for its verdict (``tally fleet``'s exit code).
            asker = next((d for d in self.devices if not d.stats.refusal), None)
            job_states = await asker.job_states(self.stats().jobs) if asker is not None else {}
        finally:
            halt.set()
            for runner in runners:
                runner.cancel()
            await asyncio.gather(*runners, return_exceptions=True)
            await self.channels.close()
        stats = self.stats(time.perf_counter() - start)
        stats.job_states, stats.no_task_within_s = job_states, gave_up
        return stats

    async def _slot(self, i: int, halt: asyncio.Event, max_tasks: int | None) -> None:
        """Run slot i's device; each time one leaves by churn, a new one takes its place. A device
        the coordinator refuses for good stops alone: one revoked device does not end a load test,
        and a fleet all of whose devices are refused ends with their reason."""
        generation = 0
        if self.ramp_s:
            try:
                await pause(self.arrival_s(i), halt)
            except Stopped:
                return
        while (await self._run_device(self.devices[i], halt, max_tasks)).left and not halt.is_set():
            generation += 1
            self.departed.append(self.devices[i])
            self.devices[i] = self._device(i, generation)

    async def _run_device(self, device: Device, halt: asyncio.Event, max_tasks: int | None) -> DeviceStats:
        try:
            return await device.run(halt, max_tasks)
        except grpc.aio.AioRpcError as exc:
            device.stats.refusal = f"{exc.code().name}: {exc.details()}"
        except PermissionError as exc:  # the coordinator's ticket key is not the provisioned one
            device.stats.refusal = str(exc)
        logs.event(log, "device refused", logging.WARNING, device_id=device.device_id, reason=device.stats.refusal)
        self._updated(device.stats)
        return device.stats

    def arrival_s(self, i: int) -> float:
        """When slot i's device comes online, in seconds after the fleet starts (``ramp_s``)."""
        draw = np.random.default_rng([self._seed, self._first_index + i, _RAMP_STREAM]).random()
        return self.ramp_s * float(draw)

    def until_job_done(self, job_id: str, every_seconds: float = 1.0) -> Callable[[FleetStats], Awaitable[bool]]:
        """A predicate for ``run``: the coordinator reports ``job_id`` finished (asked at most
        every ``every_seconds``)."""
        return self._until_finished(lambda stats: [job_id], every_seconds)

    def until_jobs_done(self, every_seconds: float = 1.0) -> Callable[[FleetStats], Awaitable[bool]]:
        """A predicate for ``run``: every job the fleet was given tasks of is finished, or (for a
        fleet none of whose devices was ever selected, like one shard of a large fleet) jobs of
        its population ran and none runs now. A fleet that ends when its work does."""
        finished = self._until_finished(lambda stats: stats.jobs, every_seconds)

        async def done(stats: FleetStats) -> bool:
            return stats.jobs_over or await finished(stats)

        return done

    def _until_finished(
        self, jobs: Callable[[FleetStats], list[str]], every_seconds: float
    ) -> Callable[[FleetStats], Awaitable[bool]]:
        last = [float("-inf")]
        finished: set[str] = set()

        async def done(stats: FleetStats) -> bool:
            wanted = jobs(stats)
            if not wanted or time.perf_counter() - last[0] < every_seconds:
                return False
            last[0] = time.perf_counter()
            for job_id in set(wanted) - finished:
                state = await self._job_state(job_id)
                if state is None:
                    return False  # not submitted yet, or nobody left to ask
                if state in FINISHED_JOB_STATES:
                    finished.add(job_id)
            return finished >= set(wanted)

        return done

    async def _job_state(self, job_id: str) -> common_pb2.JobState.ValueType | None:
        """The job's state (None: not submitted, or no device left to ask), asked as a device of
        the fleet. A device the coordinator refuses (revoked, say, and not yet stopped by its own
        next call) cannot ask: the next one does, and the refused ones stop by themselves."""
        for device in self.devices:
            if device.stats.refusal:
                continue
            try:
                return (await device.round_status(job_id)).job_state
            except grpc.aio.AioRpcError as exc:
                if exc.code() == grpc.StatusCode.NOT_FOUND:
                    return None
                if exc.code() not in (grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAUTHENTICATED):
                    raise
        return None

    def close(self) -> None:
        """Release the training threads (the fleet cannot run again afterwards)."""
        self.executor.shutdown(wait=True, cancel_futures=True)

    def _updated(self, stats: DeviceStats) -> None:
        if stats.last_model_version:
            self._last_version = stats.last_model_version
        if self._changed is not None:
            self._changed.set()

    async def _wake(self, everyone: asyncio.Future, stop: asyncio.Event | None, timeout: float) -> None:
        """Wait for a device's update, the end of all devices, ``stop``, or ``timeout``."""
        assert self._changed is not None
        waiters = [asyncio.ensure_future(self._changed.wait())]
        if stop is not None:
            waiters.append(asyncio.ensure_future(stop.wait()))
        try:
            await asyncio.wait([everyone, *waiters], timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waiters:
                w.cancel()
            self._changed.clear()


def _rounds_reached(rounds: int) -> Callable[[FleetStats], bool]:
    return lambda stats: stats.max_rounds >= rounds


async def _holds(predicate: Callable[[FleetStats], bool | Awaitable[bool]], stats: FleetStats) -> bool:
    result = predicate(stats)
    return bool(await result) if inspect.isawaitable(result) else bool(result)


@contextlib.contextmanager
def progress_display(enabled: bool, console: Console | None, total: int | None):
    """A live progress line (tasks, sessions, dropouts, bytes), or nothing."""
    if not enabled:
        yield lambda stats: None
        return
    progress = Progress(
        SpinnerColumn(),
        TextColumn("[bold]fleet[/bold] {task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[summary]}"),
        TimeElapsedColumn(),
        console=console,
    )
    with progress:
        task = progress.add_task("tasks", total=total, summary="")

        def show(stats: FleetStats) -> None:
            description = f"{stats.devices} devices · rounds {stats.max_rounds}"
            progress.update(task, completed=stats.tasks_done, description=description, summary=stats.summary())

        yield show
