"""Tally's services started in the test's own process, over real gRPC on 127.0.0.1: the one
builder (``in_process``) every test that starts a coordinator, an aggregator or a device front
without a process of its own goes through. A test composes services on it, or takes one of the
compositions the tests share, each a method of the builder: the whole system (``whole_system``:
the real coordinator, two real aggregators and real SDK devices, plaintext or over TLS as deployed,
with the FedAvg job and digits devices most end-to-end tests run), the coordinator with fake
aggregators (``coordinator_with_fakes``, for the coordinator's service tests) and one aggregator
alone (``aggregator_alone``, for the aggregator's). Services as processes are
``tally.ops.cluster.ProcessCluster``; as containers, ``support.containers``.
"""

from __future__ import annotations

import asyncio
import contextlib
import urllib.request
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc
from cryptography.hazmat.primitives.asymmetric import ed25519

from tally import modelio
from tally.aggregator import AggregatorService
from tally.coordinator.faces.device_front import DeviceFront, FrontConfig
from tally.coordinator.service import CoordinatorService
from tally.datasets.digits import digits
from tally.loadtest import Fleet, FleetStats
from tally.models.mlp import mlp
from tally.security import (
    TicketVerifier,
    TLSConfig,
    bearer_metadata,
    certs,
    channel_options,
    load_or_create_ticket_key,
)
from tally.security.tls import open_channel
from tally.training import TorchTrainer, single_threaded
from tally.wire.v1 import admin_pb2, admin_pb2_grpc

if TYPE_CHECKING:
    from support.aggregator import Deployment
    from support.coordinator import CoordinatorStack, FakeAggregatorControl

    Started = AggregatorService | CoordinatorService | DeviceFront | FakeAggregatorControl

TIMEOUT = 240
HIDDEN = 16
PLAINTEXT = TLSConfig.plaintext()


def spec(name: str, rounds: int, cohort: int, over_selection: float = 1.0) -> str:
    return (
        f"name: {name}\nalgorithm: fedavg\nrounds: {rounds}\ncohort_size: {cohort}\n"
        f"over_selection: {over_selection}\nmin_cohort: 5\nretries: 3\n"
        f"model: {{inputs: 64, classes: 10, hidden: {HIDDEN}, seed: 0}}\n"
        "options: {local_epochs: 1, local_lr: 0.1, batch_size: 16}\n"
        "secure: {dropout_rate: 0.1, corrupt_rate: 0.05}\n"
        "deadlines: {checkin: 10, download: 10, advertise_keys: 4, share_keys: 4, masked_input: 8, unmask: 4}\n"
    )


def trainers(n: int, seed: int = 0) -> tuple[list[TorchTrainer], tuple]:
    single_threaded()
    fed = digits(n, alpha=0.5, seed=seed)
    factory = lambda: mlp(64, 10, hidden=HIDDEN, seed=0)  # noqa: E731
    return [TorchTrainer(factory, X, y, seed=seed + i) for i, (X, y) in enumerate(fed.clients)], fed.test


class InProcess:
    """What one test started in its process, stopped newest first when its block ends however the
    test went, so no test leaves a server bound or a job loop running. Enter it (``async with
    in_process() as services:``) to compose services with ``coordinator``, ``aggregator``,
    ``fake_aggregator``, ``front`` and ``restart``, or take a shared composition (``async with
    in_process().whole_system(tmp_path) as s:``), which enters it itself."""

    def __init__(self) -> None:
        self._running: list[Started] = []

    async def __aenter__(self) -> InProcess:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        while self._running:
            await self.stop(self._running[-1])

    async def aggregator(self, tls: TLSConfig, ticket_public_key: bytes | ed25519.Ed25519PublicKey,
                         aggregator_id: str, listen: str = "127.0.0.1:0", **options: Any) -> AggregatorService:
        service = AggregatorService(listen, tls, ticket_public_key, aggregator_id, **options)
        await service.start()
        self._running.append(service)
        return service

    async def fake_aggregator(self, aggregator_id: str, verifier: TicketVerifier, tls: TLSConfig = PLAINTEXT,
                              host: str = "127.0.0.1") -> FakeAggregatorControl:
        from support.coordinator import FakeAggregatorControl  # that module builds on this one

        fake = FakeAggregatorControl(aggregator_id, verifier)
        await fake.start(tls, host)
        self._running.append(fake)
        return fake

    async def coordinator(self, tls: TLSConfig, state_dir: Path, aggregators: Sequence[tuple[str, str]] = (),
                          listen: str = "127.0.0.1:0", **options: Any) -> CoordinatorService:
        service = CoordinatorService(listen, tls, state_dir, aggregators, **options)
        await service.start()
        self._running.append(service)
        return service

    async def front(self, config: FrontConfig) -> tuple[DeviceFront, int]:
        """A device front in this process, where a test can reach into it (a coordinator runs its
        own fronts as processes); the port it serves devices on."""
        front = DeviceFront(config)
        port = await front.start()
        self._running.append(front)
        return front, port

    async def restart(self, coordinator: CoordinatorService,
                      while_stopped: Callable[[], None] = lambda: None) -> CoordinatorService:
        """A new coordinator where ``coordinator`` served, on its state and aggregators, as a
        supervisor would start one after a crash (its other options are the defaults).
        ``while_stopped``: what happens between the two (to the state directory, say)."""
        await self.stop(coordinator)
        while_stopped()
        return await self.coordinator(coordinator.tls, coordinator.state_dir, coordinator.aggregators,
                                      listen=f"127.0.0.1:{coordinator.port}")

    async def stop(self, service: Started) -> None:
        self._running.remove(service)
        await service.stop(grace=0)

    @contextlib.asynccontextmanager
    async def whole_system(self, tmp_path: Path, tls: bool = False, device_processes: int = 1,
                           **coordinator_options: Any) -> AsyncIterator[Stack]:
        """The real coordinator and two real aggregators. ``tls``: every connection over TLS with
        ``tally certs`` identities instead of plaintext on loopback; as deployed, each aggregator's
        control API has its own port and admits only the coordinator's certificate, and devices
        present none (their Join authenticates each stream). ``device_processes``: the coordinator
        serves devices from that many processes (its fronts); ``coordinator_options``: its other
        options (``tracking_uri``, ...)."""
        state_dir = tmp_path / "state"
        public = load_or_create_ticket_key(state_dir).public_key()
        pki = tmp_path / "pki"
        if tls:
            certs.write_deployment(pki, aggregators=2)

        def identity(role: str | None, directory: str, **kwargs: Any) -> TLSConfig:
            return TLSConfig.from_dir(pki / directory, role, **kwargs) if tls else PLAINTEXT

        async with self:
            aggregators = [await self.aggregator(identity("aggregator", f"aggregator-{i}", require_client_auth=tls),
                                                 public, f"agg-{i}", control_listen="127.0.0.1:0" if tls else None)
                           for i in (1, 2)]
            coordinator = await self.coordinator(
                identity("coordinator", "coordinator"), state_dir,
                [(a.id, f"127.0.0.1:{a.control_port}") for a in aggregators], checkin_hold_s=2.0,
                device_processes=device_processes, **coordinator_options,
            )
            yield Stack(self, aggregators, coordinator, identity(None, "device"))

    @contextlib.asynccontextmanager
    async def coordinator_with_fakes(self, tmp_path: Path, aggregators: int = 2,
                                     **options: Any) -> AsyncIterator[CoordinatorStack]:
        """The real coordinator (``options`` are its own) and ``aggregators`` fake ones, with a
        channel to it that reconnects quickly, so a test can restart the coordinator under it."""
        from support.coordinator import CoordinatorStack  # that module builds on this one

        state_dir = tmp_path / "state"
        verifier = TicketVerifier(load_or_create_ticket_key(state_dir).public_key())
        async with self:
            fakes = [await self.fake_aggregator(f"agg{i}", verifier) for i in range(aggregators)]
            service = await self.coordinator(PLAINTEXT, state_dir, [(a.ident, a.address) for a in fakes], **options)
            channel = grpc.aio.insecure_channel(
                f"127.0.0.1:{service.port}",
                options=channel_options() + [("grpc.initial_reconnect_backoff_ms", 50),
                                             ("grpc.max_reconnect_backoff_ms", 200)],
            )
            async with channel:
                yield CoordinatorStack(self, service, fakes, channel)

    @contextlib.asynccontextmanager
    async def aggregator_alone(self, deployment: Deployment, aggregator_id: str = "agg-a", mutual: bool = False,
                               **options: Any) -> AsyncIterator[AggregatorService]:
        """One real aggregator with ``deployment``'s identity and ticket key. ``mutual``: it
        demands client certificates (of the coordinator, on a control port of its own)."""
        if mutual:
            options.setdefault("control_listen", "127.0.0.1:0")
        async with self:
            yield await self.aggregator(deployment.server_tls(mutual), deployment.public_key, aggregator_id, **options)


def in_process() -> InProcess:
    """The builder; see ``InProcess``."""
    return InProcess()


@dataclass
class Stack:
    services: InProcess
    aggregators: list[AggregatorService]
    coordinator: CoordinatorService
    client_tls: TLSConfig = PLAINTEXT  # what devices and the admin present to the services

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.coordinator.port}"

    @property
    def state_dir(self) -> Path:
        return self.coordinator.state_dir

    def fleet(self, trainers, **kwargs) -> Fleet:
        """A fleet provisioned with the coordinator's enrolment key."""
        return Fleet(self.target, self.client_tls, trainers, enrolment_key=self.coordinator.enrolment_key, **kwargs)

    def admin(self) -> tuple[admin_pb2_grpc.AdminStub, list]:
        channel = open_channel(self.target, self.client_tls)
        return admin_pb2_grpc.AdminStub(channel), bearer_metadata(self.coordinator.admin_token)

    async def submit(self, text: str) -> str:
        stub, md = self.admin()
        return (await asyncio.to_thread(stub.SubmitJob, admin_pb2.SubmitJobRequest(spec_yaml=text), metadata=md,
                                        timeout=10)).job_id

    async def run_job(self, text: str, devices, **fleet_options) -> tuple[str, FleetStats]:
        """Submit ``text`` and run ``devices`` as a fleet until the coordinator says it is done."""
        job_id = await self.submit(text)
        fleet = self.fleet(devices, **{"seed": 1, **fleet_options})
        try:
            return job_id, await fleet.run(until=fleet.until_job_done(job_id, every_seconds=0.2))
        finally:
            fleet.close()

    async def run_beside_a_fleet(self, job_id: str, devices, argv: list[str], cwd: Path) -> tuple[int, str, str]:
        """Run ``argv`` as a device process while ``devices`` run as a fleet until ``job_id`` is
        done; the process's exit code, stdout and stderr."""
        process = await asyncio.create_subprocess_exec(*argv, cwd=cwd, stdout=asyncio.subprocess.PIPE,
                                                       stderr=asyncio.subprocess.PIPE)
        fleet = self.fleet(devices, seed=1)
        try:
            await fleet.run(until=fleet.until_job_done(job_id, every_seconds=0.2))
        finally:
            fleet.close()
        out, err = await asyncio.wait_for(process.communicate(), 120)
        return process.returncode, out.decode(), err.decode()

    async def job(self, job_id: str) -> admin_pb2.Job:
        stub, md = self.admin()
        return await asyncio.to_thread(stub.GetJob, admin_pb2.GetJobRequest(job_id=job_id), metadata=md, timeout=10)

    async def round_metrics(self, job_id: str) -> dict[int, dict[str, float]]:
        """Each committed round's figures, as ``tally job metrics`` reads them."""
        stub, md = self.admin()
        out = await asyncio.to_thread(stub.GetJobMetrics, admin_pb2.GetJobMetricsRequest(job_id=job_id),
                                      metadata=md, timeout=10)
        return {r.round: dict(r.metrics) for r in out.rounds}

    async def committed(self, job_id: str, round_: int) -> None:
        """Until round ``round_`` is committed (WatchJob streams each change)."""
        stub, md = self.admin()

        def watch() -> None:
            for _ in stub.WatchJob(admin_pb2.WatchJobRequest(job_id=job_id), metadata=md, timeout=TIMEOUT):
                job = stub.GetJob(admin_pb2.GetJobRequest(job_id=job_id), metadata=md, timeout=10)
                if job.committed_round >= round_:
                    return

        await asyncio.to_thread(watch)

    def model(self, job_id: str) -> dict:
        version = self.coordinator.store.model_version(job_id)
        return modelio.deserialize(self.coordinator.store.read_blob(version.model_digest))

    async def until_done(self, job_id: str) -> None:
        """Until the job ends (WatchJob ends its stream then)."""
        stub, md = self.admin()
        await asyncio.to_thread(lambda: list(stub.WatchJob(admin_pb2.WatchJobRequest(job_id=job_id), metadata=md,
                                                            timeout=TIMEOUT)))

    async def restart_coordinator(self, while_stopped: Callable[[], None] = lambda: None) -> None:
        self.coordinator = await self.services.restart(self.coordinator, while_stopped)


def run(coro, timeout: float = TIMEOUT):
    return asyncio.run(asyncio.wait_for(coro, timeout))


def scrape_text(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
        return reply.read().decode()


