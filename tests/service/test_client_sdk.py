"""The client SDK against fake coordinator and aggregator servicers on real gRPC ports.

The fake aggregator runs the real ``SecAggServer``, so every device goes through the whole path
(register, check-in pacing, chunked download, local training, encoding, the secure-aggregation
stream) and the cohort's sum is compared exactly with an in-process computation. Dropouts are
real cancelled streams; the fake aggregator treats a broken stream as the phase's deadline for
that device, which keeps the tests free of timers.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import functools
import gc
import hashlib
import io
import json
import logging
import os
import socket
import stat
import subprocess
import sys
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

import grpc
import numpy as np
import pytest
import torch
from cryptography.hazmat.primitives.asymmetric import ed25519
from google.protobuf.timestamp_pb2 import Timestamp
from hypothesis import given, settings
from hypothesis import strategies as st
from rich.console import Console

from support.secagg import LAX, identities, roster
from tally import algorithms, modelio
from tally.algorithms import packages
from tally.algorithms.base import Options
from tally.algorithms.packages import Algorithm
from tally.cli import client as client_cli
from tally.cli import client_run
from tally.client import ClientMetrics, Device, ModelCache, OnnxModel, RetryPolicy
from tally.client.adapted_models import AdaptedModels
from tally.client.channels import open_aio_channel
from tally.client.enrolment import load_or_create_identity, simulated_identity
from tally.client.input_ledger import LEDGER_FILE, InputLedger
from tally.client.local_state import LocalStateStore
from tally.client.session import settle, stream_timeout
from tally.codec import Field, Kind, PayloadSchema, ring_mask, to_ring
from tally.datasets.digits import digits
from tally.loadtest import DropoutPlan, Fleet
from tally.loadtest.hooks import SimulatedDevice
from tally.models.mlp import mlp
from tally.models.params import get_params
from tally.secagg import (
    GraphParams,
    ProtocolError,
    SecAggClient,
    SecAggServer,
    SessionConfig,
    SessionRef,
    SumSpec,
)
from tally.secagg.messages import MaskedInputResponse, ShareDelivery, ShareKeysRequest, ShareKeysResponse
from tally.security import (
    AuthError,
    SessionTicket,
    TicketSigner,
    TokenIssuer,
    bind,
    certs,
    channel_options,
    config_digest,
    token_from_metadata,
)
from tally.security.files import private_dir
from tally.security.tls import TLSConfig
from tally.training import TorchTrainer
from tally.wire.join import join_from_metadata
from tally.wire.protocol import aggregator_envelope, open_envelope, session_config_bytes, to_proto
from tally.wire.sums import schema_to_proto
from tally.wire.task_reports import MAX_LEDGER_JOBS
from tally.wire.tensors import tensors_to_proto
from tally.wire.v1 import (
    common_pb2,
    coordinator_pb2,
    coordinator_pb2_grpc,
    secagg_pb2,
    secagg_pb2_grpc,
)

PLAIN = TLSConfig.plaintext()
FAST = RetryPolicy(initial_seconds=0.01, max_seconds=0.2, call_timeout=10.0)
FEDAVG_OPTIONS = {"local_epochs": 1, "local_lr": 0.1, "batch_size": 8, "delta_clip": 1.0, "frac_bits": 16,
                  "example_cap": 100}
JOB = "job-1"
TICKET_SIGNER = TicketSigner(ed25519.Ed25519PrivateKey.generate())
ENROLMENT_KEY = hashlib.sha256(b"test enrolment key").digest()
TIMEOUT = 30.0


def run(coro: Any, timeout: float = TIMEOUT) -> Any:
    return asyncio.run(asyncio.wait_for(coro, timeout))


# ---- deterministic devices ---------------------------------------------------------------------


class ShiftTrainer:
    """A LocalTrainer whose training moves every parameter by ``shift``: exact references."""

    def __init__(self, shift: float, examples: int, value: float = 0.0) -> None:
        self.shift = shift
        self.examples = examples
        self.value = value

    @property
    def num_examples(self) -> int:
        return self.examples

    def train(self, params: Mapping[str, np.ndarray], epochs: int, lr: float, batch_size: int):
        return {k: np.asarray(v) + self.shift for k, v in params.items()}, 0.0

    def evaluate(self, params: Mapping[str, np.ndarray]) -> tuple[float, float]:
        return 0.0, 1.0


def small_model() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(7)
    return {"w": rng.normal(size=(3, 4)).astype(np.float32), "b": np.zeros(4, np.float32)}


# ---- a round as the coordinator would plan it --------------------------------------------------


@dataclass
class Plan:
    """One round of one job: what the fakes serve and what the reference computation needs."""

    config: SessionConfig
    algorithm: str
    options: dict
    steps: list[coordinator_pb2.Step]  # in sum order
    schemas: dict[str, PayloadSchema]
    blob: bytes
    tokens: dict[int, str] = field(default_factory=dict)

    @functools.cached_property
    def ticket(self) -> bytes:
        """Signed by the fake coordinator's key over the config and its roster, as the real one
        signs: devices check it before they join."""
        ref = self.config.ref
        return TICKET_SIGNER.sign(SessionTicket(
            ref.job_id, ref.round, ref.session_id, tuple(s.sum_id for s in self.config.sums), self.config.n,
            config_digest(session_config_bytes(self.config)), "agg", time.time() + 3600,
        ))

    @property
    def digest(self) -> str:
        return hashlib.sha256(self.blob).hexdigest()


def make_plan(
    n: int,
    params: dict[str, np.ndarray],
    step_schemas: list[tuple[str, str, PayloadSchema]],  # (step name, sum id, schema)
    *,
    algorithm: str = "fedavg",
    options: dict | None = None,
    first_broadcast: dict[str, np.ndarray] | None = None,
    later_broadcasts: dict[str, dict[str, np.ndarray]] | None = None,
    t: int | None = None,
    min_survivors: int = 2,
    roster_keys: tuple[bytes, ...] | None = None,
) -> Plan:
    sums = tuple(SumSpec(sum_id, schema.dim, schema.required_bits(n)) for _, sum_id, schema in step_schemas)
    config = SessionConfig(
        ref=SessionRef(JOB, 3, f"session-{n}"),
        sums=sums,
        params=GraphParams(n, n - 1, t or max(2, n - 2)),
        graph_seed=b"\x05" * 32,
        min_survivors=min_survivors,
        consistency_check=True,
        identities=roster_keys or roster(n),
    )
    steps = []
    for position, (name, sum_id, schema) in enumerate(step_schemas):
        broadcast = first_broadcast if position == 0 else (later_broadcasts or {}).get(sum_id, {})
        steps.append(coordinator_pb2.Step(
            name=name, sum_id=sum_id, broadcast=tensors_to_proto(broadcast or {}),
            schema=schema_to_proto(sum_id, schema),
        ))
    return Plan(
        config=config,
        algorithm=algorithm,
        options=options if options is not None else FEDAVG_OPTIONS,
        steps=steps,
        schemas={sum_id: schema for _, sum_id, schema in step_schemas},
        blob=modelio.serialize(params),
        tokens={i: f"session-token-{i}" for i in range(1, n + 1)},
    )


def fedavg_plan(n: int, **kwargs: Any) -> Plan:
    server, _ = algorithms.make("fedavg", FEDAVG_OPTIONS)
    step = server.steps(server.init(small_model()))[0]
    return make_plan(n, small_model(), [(step.name, step.name, step.schema)], **kwargs)


DEADLINES = secagg_pb2.PhaseDeadlines(
    advertise_keys_seconds=20, share_keys_seconds=20, masked_input_seconds=20, unmask_seconds=20
)


# ---- fake coordinator --------------------------------------------------------------------------


class FakeCoordinator(coordinator_pb2_grpc.CoordinatorServicer):
    """Registers devices, answers RetryAfter on a first check-in, then assigns the plan's task to
    the devices named in ``cohort``; serves the model in chunks (optionally breaking each
    device's first stream, or corrupting its first download) and later steps via GetStep."""

    def __init__(
        self,
        plan: Plan | None = None,
        cohort: Mapping[str, int] | None = None,
        *,
        aggregator: str = "",
        chunk_size: int = 32,
        break_after_chunks: int | None = None,
        corrupt_first: frozenset[str] = frozenset(),
        step_polls: int = 1,
        files: Mapping[str, bytes] | None = None,
        assign: bool = True,
        cancel_checkins: bool = False,
        reassign: str | None = None,
        idle_from_checkin: int | None = None,
        installs: Mapping[str, str] | None = None,
    ) -> None:
        """``installs``: the TaskAssignment's algorithm_version, model_kind and model_kind_version
        (what the device is asked to have installed); unset, none is named."""
        self.plan = plan
        self.installs = dict(installs or {})
        self.declared: dict[str, dict[str, str]] = {}
        self.declared_models: dict[str, dict[str, str]] = {}
        self.declared_capabilities: dict[str, list[str]] = {}
        self.cohort = dict(cohort or {})
        self.aggregator = aggregator
        self.chunk_size = chunk_size
        self.break_after_chunks = break_after_chunks
        self.corrupt_first = corrupt_first
        self.step_polls = step_polls
        self.files = dict(files or {})
        if plan is not None:
            self.files["v3"] = plan.blob
        self.assign = assign
        self.cancel_checkins = cancel_checkins
        # A malicious coordinator: the same round's task again and again, on this aggregator.
        self.reassign = reassign
        # From this check-in of each device on, no job of the population runs.
        self.idle_from_checkin = idle_from_checkin
        self.reports: dict[str, list[coordinator_pb2.TaskReport]] = defaultdict(list)
        self.issuer = TokenIssuer(os.urandom(32))
        self.registrations: Counter[str] = Counter()
        self.checkins: Counter[str] = Counter()
        self.downloads: list[tuple[str, str, int]] = []  # (device, version, offset)
        self.streams: Counter[str] = Counter()
        self.polls: Counter[tuple[str, str]] = Counter()
        self.assigned: set[str] = set()
        self.checked_in = asyncio.Event()
        self.job_state: Callable[[], int] = lambda: common_pb2.JOB_STATE_SUCCEEDED

    async def _device(self, context: grpc.aio.ServicerContext) -> str:
        try:
            return self.issuer.verify(token_from_metadata(context.invocation_metadata()), time.time()).device_id
        except AuthError as exc:
            await context.abort(exc.code, exc.message)

    async def Register(self, request, context):
        self.registrations[request.device_id] += 1
        expires = Timestamp()
        expires.FromSeconds(int(time.time()) + 3600)
        token = self.issuer.issue(request.device_id, request.population, 3600, time.time())
        return coordinator_pb2.RegisterResponse(
            token=token, expires_at=expires, coordinator_key=TICKET_SIGNER.public_key.public_bytes_raw()
        )

    async def CheckIn(self, request, context):
        device = await self._device(context)
        assert request.capabilities.accelerator in ("cpu", "cuda") and request.capabilities.sdk_version
        self.checkins[device] += 1
        self.declared[device] = {a.name: a.version for a in request.capabilities.algorithms}
        self.declared_models[device] = {m.name: m.version for m in request.capabilities.models}
        self.declared_capabilities[device] = list(request.capabilities.trainer_capabilities)
        self.reports[device].extend(request.reports)
        self.checked_in.set()
        if self.cancel_checkins:  # what a coordinator shutting down does to held check-ins
            await context.abort(grpc.StatusCode.CANCELLED, "server shutting down")
        if self.idle_from_checkin is not None and self.checkins[device] >= self.idle_from_checkin:
            return coordinator_pb2.CheckInResponse(retry_after=coordinator_pb2.RetryAfter(
                seconds=0.01, reason="no running job", population_idle=True))
        if (self.checkins[device] == 1 or not self.assign or device not in self.cohort
                or (device in self.assigned and not self.reassign)):
            return coordinator_pb2.CheckInResponse(retry_after=coordinator_pb2.RetryAfter(seconds=0.01, reason="wait"))
        task = self.task(self.cohort[device])
        if device in self.assigned:
            task.aggregator_address = self.reassign
        self.assigned.add(device)
        return coordinator_pb2.CheckInResponse(task=task)

    def task(self, index: int) -> coordinator_pb2.TaskAssignment:
        plan = self.plan
        return coordinator_pb2.TaskAssignment(
            job_id=JOB, round=plan.config.ref.round, task_id=f"task-{index}", algorithm=plan.algorithm,
            algorithm_options=json.dumps(plan.options), step=plan.steps[0], model_version="v3",
            model_digest=plan.digest, model_size=len(plan.blob), chunk_size=self.chunk_size,
            aggregator_address=self.aggregator, session_ticket=plan.ticket, device_index=index,
            session_token=plan.tokens[index], session=to_proto(plan.config), deadlines=DEADLINES,
            **self.installs,
        )

    async def DownloadModel(self, request, context):
        device = await self._device(context)
        blob = self.files.get(request.model_version.removesuffix(".onnx"))
        if blob is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no model {request.model_version}")
        digest = hashlib.sha256(blob).hexdigest()
        if request.digest and request.digest != digest:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "digest mismatch")
        self.downloads.append((device, request.model_version, request.offset))
        self.streams[device] += 1
        first_stream = self.streams[device] == 1
        served = blob
        if device in self.corrupt_first and first_stream:
            served = bytes([blob[0] ^ 0xFF]) + blob[1:]
        for sent, offset in enumerate(range(request.offset, len(blob), self.chunk_size)):
            if first_stream and self.break_after_chunks is not None and sent == self.break_after_chunks:
                await context.abort(grpc.StatusCode.UNAVAILABLE, "connection reset (test)")
            yield coordinator_pb2.ModelChunk(
                offset=offset, data=served[offset:offset + self.chunk_size], total_size=len(blob), digest=digest
            )

    async def GetStep(self, request, context):
        device = await self._device(context)
        self.polls[(device, request.sum_id)] += 1
        assert request.job_id == JOB and request.task_id == f"task-{self.cohort[device]}"
        if self.polls[(device, request.sum_id)] <= self.step_polls:
            return coordinator_pb2.GetStepResponse(retry_after=coordinator_pb2.RetryAfter(seconds=0.01))
        step = next(s for s in self.plan.steps if s.sum_id == request.sum_id)
        return coordinator_pb2.GetStepResponse(step=step)

    async def RoundStatus(self, request, context):
        await self._device(context)
        return coordinator_pb2.RoundStatusResponse(job_state=self.job_state(), round=3)


# ---- fake aggregator: the real SecAggServer behind the device streams -------------------------


class FakeSessionStreams(secagg_pb2_grpc.SecureAggregationServicer):
    """One session. A device whose stream breaks is dead; when the current phase waits only for
    dead devices, the phase's deadline is taken as passed (no clock needed)."""

    def __init__(
        self,
        plan: Plan,
        announced: SessionConfig | None = None,
        rewrite: Callable[[int, Any], Any] = lambda recipient, message: message,
    ) -> None:
        """``rewrite(recipient, message)``: what a malicious aggregator sends in its place."""
        self.plan = plan
        self.announced = announced or plan.config
        self.rewrite = rewrite
        self.server = SecAggServer(plan.config)
        self.outboxes = {i: asyncio.Queue() for i in range(1, plan.config.n + 1)}
        self.dead: set[int] = set()
        self.received: list[Any] = []
        self.rejected: list[tuple[int, ProtocolError]] = []
        self.done = asyncio.Event()

    async def Session(self, request_iterator, context):
        join = join_from_metadata(context.invocation_metadata())
        index = join.device_index
        if join.session_ticket != self.plan.ticket or join.session_token != self.plan.tokens.get(index):
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, "bad ticket or session token")
        await context.write(aggregator_envelope(
            secagg_pb2.Joined(config=to_proto(self.announced), deadlines=DEADLINES)))
        reader = asyncio.ensure_future(self._read(index, context))
        try:
            while True:
                envelope = await self.outboxes[index].get()
                await context.write(envelope)
                if envelope.WhichOneof("message") in ("session_done", "abort"):
                    return
        finally:
            reader.cancel()
            self.dead.add(index)
            self._settle()

    async def _read(self, index: int, context) -> None:
        while True:
            envelope = await context.read()
            if envelope is grpc.aio.EOF:
                return
            message = open_envelope(envelope)
            assert message.sender == index
            self.received.append(message)
            try:
                self._route(self.server.receive(message))
            except ProtocolError as exc:
                self.rejected.append((index, exc))
            self._settle()

    def _route(self, outgoing) -> None:
        for o in outgoing:
            if o.recipient not in self.dead:
                self.outboxes[o.recipient].put_nowait(aggregator_envelope(self.rewrite(o.recipient, o.message)))

    def _settle(self) -> None:
        server = self.server
        while not server.finished and server.awaiting and server.awaiting <= self.dead:
            self._route(server.on_deadline())
        if server.finished and not self.done.is_set():
            self.done.set()
            final = (
                secagg_pb2.SessionDone(sum_ids=list(server.results))
                if server.aborted is None
                else secagg_pb2.Abort(ref=to_proto(server.config.ref), reason=server.aborted.reason)
            )
            for i, box in self.outboxes.items():
                if i not in self.dead:
                    box.put_nowait(aggregator_envelope(final))


async def serve(*servicers: Any, port: int = 0, tls: TLSConfig = PLAIN) -> tuple[grpc.aio.Server, int]:
    server = grpc.aio.server(options=channel_options())
    for servicer in servicers:
        if isinstance(servicer, coordinator_pb2_grpc.CoordinatorServicer):
            coordinator_pb2_grpc.add_CoordinatorServicer_to_server(servicer, server)
        else:
            secagg_pb2_grpc.add_SecureAggregationServicer_to_server(servicer, server)
    bound = bind(server, f"127.0.0.1:{port}", tls)
    await server.start()
    return server, bound


# ---- the reference -----------------------------------------------------------------------------


def reference_ring(plan: Plan, trainers: Mapping[int, Any], seeds: Mapping[int, int],
                   contributors: set[int], broadcasts: Mapping[str, dict]) -> dict[str, np.ndarray]:
    """Each sum as the contributors' devices compute it, added mod 2**bits in process."""
    _, client_half = algorithms.make(plan.algorithm, plan.options)
    totals = {}
    states: dict[int, Any] = {}
    rngs = {i: np.random.default_rng(seeds[i]) for i in contributors}
    for step, spec in zip(plan.steps, plan.config.sums):
        schema = plan.schemas[spec.sum_id]
        total = np.zeros(spec.dim, np.uint64)
        for i in sorted(contributors):
            values, states[i] = client_half.contribute(step.name, broadcasts[spec.sum_id], trainers[i], states.get(i))
            total += to_ring(schema.encode(values, rngs[i]).vector, spec.bits).astype(np.uint64)
        totals[spec.sum_id] = total & np.uint64(ring_mask(spec.bits))
    return totals


def device(address: str, name: str, trainer: Any, seed: int, tls: TLSConfig = PLAIN, **kwargs: Any) -> Device:
    return Device(address, tls, name, trainer, rng_seed=seed, retry=FAST, **kwargs)


async def run_cohort(plan: Plan, trainers: dict[int, Any], *, dropouts: Mapping[int, DropoutPlan] | None = None,
                     coordinator_options: Mapping[str, Any] | None = None, announced: SessionConfig | None = None,
                     cache_dirs: Mapping[int, Any] | None = None, aggregator: FakeSessionStreams | None = None,
                     tls: tuple[TLSConfig, TLSConfig] = (PLAIN, PLAIN)):
    """``tls``: the servers' and the devices' TLS configuration."""
    aggregator = aggregator or FakeSessionStreams(plan, announced)
    coordinator = FakeCoordinator(plan, {f"dev-{i}": i for i in trainers}, **(coordinator_options or {}))
    server, port = await serve(coordinator, aggregator, tls=tls[0])
    coordinator.aggregator = f"127.0.0.1:{port}"
    devices = {
        i: device(f"127.0.0.1:{port}", f"dev-{i}", t, seed=100 + i, tls=tls[1],
                  hooks=SimulatedDevice(f"dev-{i}", dropout=dropouts[i]) if i in (dropouts or {}) else None,
                  cache_dir=(cache_dirs or {}).get(i), identity=identities(plan.config.n)[i], policy=LAX)
        for i, t in trainers.items()
    }
    try:
        stats = await asyncio.gather(*(d.run(max_tasks=1) for d in devices.values()))
        await asyncio.wait_for(aggregator.done.wait(), TIMEOUT)
    finally:
        await server.stop(None)
    return aggregator, coordinator, devices, dict(zip(devices, stats))


# ---- tests -------------------------------------------------------------------------------------


def test_cohort_sum_is_exact_through_chunked_resumed_download(tmp_path):
    override = {"b": np.full(4, 0.25, np.float32)}  # Step.broadcast overrides the model blob
    plan = fedavg_plan(4, first_broadcast=override)
    trainers = {i: ShiftTrainer(0.01 * i - 0.03, examples=10 * i) for i in range(1, 5)}
    aggregator, coordinator, devices, stats = run(run_cohort(
        plan, trainers, coordinator_options={"break_after_chunks": 2, "corrupt_first": frozenset({"dev-3"})},
        cache_dirs={1: tmp_path / "cache"},
    ))

    result = aggregator.server.results["update"]
    assert result.contributors == (1, 2, 3, 4) and result.dropped == ()
    broadcast = {**small_model(), **override}
    expected = reference_ring(plan, trainers, {i: 100 + i for i in trainers}, {1, 2, 3, 4}, {"update": broadcast})
    np.testing.assert_array_equal(result.total.astype(np.uint64), expected["update"])

    blob_size = len(plan.blob)
    for i, s in stats.items():
        assert (s.tasks_done, s.sessions_completed, s.sessions_aborted, s.dropouts) == (1, 1, 0, 0)
        assert s.contributed == [(JOB, 3)] and s.last_model_version == "v3"
        assert s.bytes_down > blob_size and s.bytes_up > 0
        assert coordinator.checkins[f"dev-{i}"] == 2  # RetryAfter first, then the task
        offsets = [o for d, _, o in coordinator.downloads if d == f"dev-{i}"]
        # The first stream broke after 2 chunks; the device resumed where it stopped.
        assert offsets[:2] == [0, 2 * coordinator.chunk_size]
    # dev-3's first blob failed the SHA-256 check: discarded and downloaded again from 0.
    assert [o for d, _, o in coordinator.downloads if d == "dev-3"] == [0, 64, 0]
    assert devices[3].metrics.digest_mismatches._value.get() == 1
    assert (tmp_path / "cache" / plan.digest).read_bytes() == plan.blob
    assert ModelCache(tmp_path / "cache").get(plan.digest) == plan.blob


@pytest.mark.parametrize("phase", ["advertise_keys", "share_keys", "masked_input", "consistency_check", "unmask"])
def test_planned_dropout_leaves_in_its_phase_and_the_others_sum_is_exact(phase):
    plan = fedavg_plan(5, t=3, min_survivors=3)
    trainers = {i: ShiftTrainer(0.02 * i - 0.05, examples=5 + i) for i in range(1, 6)}
    aggregator, _, _, stats = run(run_cohort(plan, trainers, dropouts={2: DropoutPlan(1.0, (phase,), seed=1)}))

    assert stats[2].dropouts == 1 and stats[2].sessions_completed == 0 and stats[2].contributed == []
    for i in (1, 3, 4, 5):
        assert stats[i].sessions_completed == 1 and stats[i].contributed == [(JOB, 3)]
    sent_by_2 = {type(m).__name__ for m in aggregator.received if m.sender == 2}
    expected_sent = {
        "advertise_keys": set(),
        "share_keys": {"AdvertiseKeys"},
        "masked_input": {"AdvertiseKeys", "ShareKeysResponse", "ShareComplaints"},
        "consistency_check": {"AdvertiseKeys", "ShareKeysResponse", "ShareComplaints", "MaskedInputResponse"},
        "unmask": {"AdvertiseKeys", "ShareKeysResponse", "ShareComplaints", "MaskedInputResponse",
                   "ConsistencyCheckResponse"},
    }[phase]
    assert sent_by_2 == expected_sent
    result = aggregator.server.results["update"]
    # Leaving at unmask is after the masked input was counted: the device is in the sum.
    contributors = {1, 2, 3, 4, 5} if phase in ("consistency_check", "unmask") else {1, 3, 4, 5}
    assert set(result.contributors) == contributors
    if phase in ("masked_input",):
        assert result.dropped == (2,)
    expected = reference_ring(plan, trainers, {i: 100 + i for i in trainers}, contributors, {"update": small_model()})
    np.testing.assert_array_equal(result.total.astype(np.uint64), expected["update"])


def test_aggregator_abort_ends_the_session_without_advancing_local_state():
    plan = fedavg_plan(3, t=2, min_survivors=3)  # one dropout leaves too few devices
    aggregator, _, devices, stats = run(run_cohort(
        plan, {i: ShiftTrainer(0.1, 4) for i in range(1, 4)}, dropouts={3: DropoutPlan(1.0, ("share_keys",))}
    ))
    assert aggregator.server.aborted is not None and aggregator.server.results == {}
    assert stats[3].dropouts == 1
    for i in (1, 2):
        assert (stats[i].sessions_aborted, stats[i].sessions_completed, stats[i].contributed) == (1, 0, [])
        assert devices[i].local_state(JOB) is None
        assert devices[i].metrics.registry.get_sample_value("tally_client_sessions_total", {"outcome": "aborted"}) == 1


def test_a_device_sends_one_input_per_round_whatever_it_is_asked_and_reports_every_task():
    """Issue 12 (the retry rule, device side) and issue 9 item 2: a coordinator that assigns the
    same round again is refused by every device that already sent an input in it (dev-3 left in
    Unmask, after its input), while dev-2, which left before sending one, may take it. Each
    task's end reaches the coordinator at the next check-in, with whether an input was sent."""
    plan = fedavg_plan(6, t=3, min_survivors=3)
    trainers = {i: ShiftTrainer(0.02 * i - 0.05, examples=5 + i) for i in range(1, 7)}
    aggregator = FakeSessionStreams(plan)
    # Repeated tasks name an aggregator that is gone: a device that takes one fails fast.
    coordinator = FakeCoordinator(plan, {f"dev-{i}": i for i in trainers}, reassign="127.0.0.1:1")
    dropouts = {2: DropoutPlan(1.0, ("masked_input",), seed=1), 3: DropoutPlan(1.0, ("unmask",), seed=1)}

    async def scenario():
        server, port = await serve(coordinator, aggregator)
        coordinator.aggregator = f"127.0.0.1:{port}"
        devices = {i: device(f"127.0.0.1:{port}", f"dev-{i}", t, seed=100 + i,
                             hooks=SimulatedDevice(f"dev-{i}", dropout=dropouts[i]) if i in dropouts else None,
                             identity=identities(6)[i], policy=LAX) for i, t in trainers.items()}
        try:
            stats = await asyncio.gather(*(d.run(max_tasks=3) for d in devices.values()))
            await asyncio.wait_for(aggregator.done.wait(), TIMEOUT)
            return stats
        finally:
            await server.stop(None)

    stats = run(scenario())
    assert aggregator.server.aborted is None, aggregator.server.aborted
    assert set(aggregator.server.results["update"].contributors) == {1, 3, 4, 5, 6}
    TR = coordinator_pb2.TaskReport
    seen = {d: [(TR.Outcome.Name(r.outcome), r.reason, r.sent_input, r.round) for r in reports]
            for d, reports in coordinator.reports.items()}
    refused = ("REFUSED", "already_sent_input", True, 3)
    for i in (1, 4, 5, 6):
        assert seen[f"dev-{i}"] == [("COMPLETED", "", True, 3), refused]
        assert stats[i - 1].sessions_completed == 1 and stats[i - 1].tasks_done == 3
    assert seen["dev-3"] == [("DROPPED", "dropped", True, 3), refused]
    first, second = seen["dev-2"]
    assert first == ("DROPPED", "dropped", False, 3)
    assert second == ("ABORTED", "session_aborted", False, 3)  # it took the task; no input left
    assert all(r.task_id == f"task-{d[-1]}" for d, rs in coordinator.reports.items() for r in rs)


async def one_device_against(coordinator, plan) -> None:
    """Device dev-1 of ``plan`` run against ``coordinator`` for up to two tasks."""
    server, port = await serve(coordinator, FakeSessionStreams(plan))
    try:
        await device(f"127.0.0.1:{port}", "dev-1", ShiftTrainer(0.01, examples=5), seed=101,
                     identity=identities(3)[1], policy=LAX).run(max_tasks=2)
    finally:
        await server.stop(None)


def test_a_device_declares_its_algorithms_and_refuses_another_version_by_name():
    """Issue 41: every check-in declares the algorithms installed (name and version); a task of a
    version other than the device's own is refused, reported as "algorithm_version" with both
    versions named, before anything is downloaded or joined."""
    plan = fedavg_plan(3, t=2, min_survivors=3)
    coordinator = FakeCoordinator(plan, {"dev-1": 1}, reassign="127.0.0.1:1",
                                  installs={"algorithm_version": "0.0.1-other"})

    run(one_device_against(coordinator, plan))
    assert coordinator.declared["dev-1"] == packages.versions() and "fedavg" in coordinator.declared["dev-1"]
    [report] = coordinator.reports["dev-1"]
    assert coordinator_pb2.TaskReport.Outcome.Name(report.outcome) == "REFUSED"
    assert report.reason == "algorithm_version" and not report.sent_input
    assert f"version '0.0.1-other'; this device has version '{packages.versions()['fedavg']}'" in report.detail
    assert coordinator.downloads == []


@pytest.mark.parametrize("installs,reason,detail", [
    ({"model_kind": "mlp", "model_kind_version": "0.0.1-other"}, "model_version",
     "the job runs model kind 'mlp' version '0.0.1-other'; this device has version '{mlp}'"),
    ({"model_kind": "tiny", "model_kind_version": "1"}, "model_version",
     "the job runs model kind 'tiny' version '1'; this device does not have it installed"),
], ids=["other-version", "not-installed"])
def test_a_device_declares_its_model_kinds_and_refuses_one_it_lacks_by_name(installs, reason, detail):
    """Every check-in declares the model kinds installed (name and version) and the trainer's
    capabilities; a task whose model kind the device lacks at the coordinator's version is refused,
    reported as "model_version" naming both, before anything is downloaded or joined."""
    from tally import models

    plan = fedavg_plan(3, t=2, min_survivors=3)
    coordinator = FakeCoordinator(plan, {"dev-1": 1}, reassign="127.0.0.1:1",
                                  installs={"algorithm_version": packages.versions()["fedavg"], **installs})

    run(one_device_against(coordinator, plan))
    assert coordinator.declared_models["dev-1"] == models.versions() and "mlp" in coordinator.declared_models["dev-1"]
    assert coordinator.declared_capabilities["dev-1"] == []  # a plain trainer offers none
    [report] = coordinator.reports["dev-1"]
    assert coordinator_pb2.TaskReport.Outcome.Name(report.outcome) == "REFUSED"
    assert report.reason == reason and not report.sent_input
    assert detail.format(mlp=models.versions()["mlp"]) in report.detail
    assert coordinator.downloads == []


def test_a_restarted_device_still_sends_one_input_per_round(tmp_path):
    """Third security review, finding 6: the ledger is written to the state directory before the
    input leaves, so a device restarted after the round (a new process: a new ``Device`` on the
    same state directory) refuses a second task of it. Without a state directory nothing can
    survive, and a fresh device takes the task."""
    plan = fedavg_plan(3, t=2, min_survivors=3)
    trainers = {i: ShiftTrainer(0.01 * i, examples=5) for i in range(1, 4)}
    aggregator = FakeSessionStreams(plan)
    coordinator = FakeCoordinator(plan, {f"dev-{i}": i for i in trainers}, reassign="127.0.0.1:1")

    async def scenario():
        server, port = await serve(coordinator, aggregator)
        coordinator.aggregator = f"127.0.0.1:{port}"

        def fleet(with_state: bool):
            return {i: device(f"127.0.0.1:{port}", f"dev-{i}", t, seed=100 + i, identity=identities(3)[i],
                              policy=LAX, state_dir=tmp_path / f"dev-{i}" if with_state or i != 3 else None)
                    for i, t in trainers.items()}

        try:
            first = await asyncio.gather(*(d.run(max_tasks=1) for d in fleet(with_state=True).values()))
            await asyncio.wait_for(aggregator.done.wait(), TIMEOUT)
            # Restarted: new objects; dev-3 had no state directory. The second task's report rides
            # on the check-in after it, hence two tasks.
            restarted = fleet(with_state=False)
            await asyncio.gather(*(d.run(max_tasks=2) for d in restarted.values()))
            return first
        finally:
            await server.stop(None)

    first = run(scenario())
    assert all(s.sessions_completed == 1 for s in first)
    TR = coordinator_pb2.TaskReport
    # The first tasks ended with their fleet (no check-in after them): the reports are the second.
    second = {d: (TR.Outcome.Name(rs[0].outcome), rs[0].reason) for d, rs in coordinator.reports.items()}
    assert second["dev-1"] == second["dev-2"] == ("REFUSED", "already_sent_input")
    assert second["dev-3"] != ("REFUSED", "already_sent_input")  # nothing remembered it
    ledger = json.loads((tmp_path / "dev-1" / LEDGER_FILE).read_text())
    assert ledger["latest_round"] == {JOB: 3}


def test_the_input_ledger_is_durable_and_refuses_to_forget(tmp_path):
    path = tmp_path / LEDGER_FILE
    ledger = InputLedger(path)
    ledger.sent("job-a", 4)
    ledger.sent("job-a", 2)  # an older round never moves it back
    ledger.sent("job-b", 1)
    again = InputLedger(path)
    assert again.already_sent("job-a", 4) and again.already_sent("job-b", 1)
    # Issue 38, problem 8: any round up to the latest is refused (an older one may have had an
    # input too), not only the latest; a later round and another job are not.
    assert again.already_sent("job-a", 2) and again.already_sent("job-a", 1)
    assert not again.already_sent("job-a", 5) and not again.already_sent("job-c", 4)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    path.write_text("{not json")
    with pytest.raises(ValueError, match="input ledger .* is unreadable"):
        InputLedger(path)
    path.write_text('{"job-a": "4"}')
    with pytest.raises(ValueError, match="not a mapping of job ids to rounds"):
        InputLedger(path)
    path.write_text('{"ledger_id": 7, "latest_round": {}}')
    with pytest.raises(ValueError, match="no valid ledger_id"):
        InputLedger(path)


def test_a_ledger_states_its_id_and_a_lost_one_is_a_new_ledger(tmp_path):
    """Issue 38, problem 2: a missing ledger file is a new ledger, written with a fresh random id
    when first stated, and every statement carries the id, so the coordinator can tell it from
    the one a device was seated with; the id survives restarts. A file written before ledgers had
    ids keeps its rounds and gets a new id (it may be younger than any seat, as far as anyone can
    tell)."""
    path = tmp_path / "dev" / LEDGER_FILE
    path.parent.mkdir()
    ledger = InputLedger(path)
    assert not path.exists()  # nothing written while nothing was stated or sent
    first = ledger.statement()
    assert path.exists() and len(ledger.ledger_id) == 32 and first.ledger_id == ledger.ledger_id
    ledger.sent("job-a", 3)
    statement = InputLedger(path).statement()
    assert statement.ledger_id == ledger.ledger_id and dict(statement.latest_round) == {"job-a": 3}
    path.unlink()  # the state directory wiped under the same identity
    wiped = InputLedger(path).statement()
    assert wiped.ledger_id != ledger.ledger_id and dict(wiped.latest_round) == {}
    path.write_text('{"job-b": 2}')  # an older SDK's ledger
    upgraded = InputLedger(path)
    assert upgraded.already_sent("job-b", 2) and upgraded.statement().ledger_id not in ("", wiped.ledger_id)
    assert json.loads(path.read_text()) == {"ledger_id": upgraded.ledger_id, "latest_round": {"job-b": 2}}


@settings(max_examples=40, deadline=None)
@given(sends=st.lists(st.tuples(st.integers(0, 30), st.integers(1, 9)), max_size=80))
def test_a_check_in_states_the_durable_ledger_of_the_most_recently_updated_jobs(tmp_path_factory, sends):
    """Issue 25, item 1: a check-in carries what the ledger on disk says (at most 16 jobs, those
    updated last, each with its latest round), read back the same after a restart; a ledger in
    memory says nothing, as a restarted device without one cannot know what it sent."""
    path = tmp_path_factory.mktemp("ledger") / LEDGER_FILE
    ledger, latest, order = InputLedger(path), {}, []
    assert InputLedger().statement() is None and ledger.statement().latest_round == {}
    for job, round_ in sends:
        ledger.sent(f"job-{job}", round_)
        if round_ > latest.get(f"job-{job}", 0):
            latest[f"job-{job}"] = round_
            order = [j for j in order if j != f"job-{job}"] + [f"job-{job}"]
    expected = {j: latest[j] for j in order[-MAX_LEDGER_JOBS:]}
    assert dict(ledger.statement().latest_round) == expected
    assert dict(InputLedger(path).statement().latest_round) == expected


def test_directories_the_sdk_creates_are_private_whatever_the_umask(tmp_path):
    """Third security review, finding 8: state, cache and identity directories are 0700 even
    under umask 000 (parents the SDK creates too)."""
    old = os.umask(0)
    try:
        LocalStateStore(tmp_path / "state" / "dev-1")
        ModelCache(tmp_path / "cache" / "models")
        AdaptedModels(tmp_path / "adapted" / "dev-1", ClientMetrics())
        load_or_create_identity(tmp_path / "keys" / "dev-1.identity")
        InputLedger(private_dir(tmp_path / "ledger" / "dev-1") / LEDGER_FILE).sent("j", 1)
    finally:
        os.umask(old)
    made = [tmp_path / d for d in ("state", "state/dev-1", "cache", "cache/models", "adapted", "adapted/dev-1",
                                    "keys", "ledger", "ledger/dev-1")]
    assert {str(d.relative_to(tmp_path)): oct(stat.S_IMODE(d.stat().st_mode)) for d in made} == {
        str(d.relative_to(tmp_path)): "0o700" for d in made}


@dataclasses.dataclass(frozen=True)
class TwoStepOptions(Options):
    options_of: ClassVar[str] = "twostep"


class TwoStepClient:
    """Sum 1: each device's value and a count; sum 2: the value centred on the broadcast mean,
    which the coordinator only knows after sum 1. Local state counts contributed steps."""

    def __init__(self, options: TwoStepOptions) -> None:
        pass

    def contribute(self, step, broadcast, device, local_state):
        count = (local_state or 0) + 1
        if step == "stats":
            return {"value": np.float64(device.value), "n": np.int64(1)}, count
        return {"centred": np.float64(device.value - float(broadcast["mean"]))}, count


def test_multi_sum_session_fetches_later_steps_with_get_step():
    twostep = Algorithm("twostep", "1", TwoStepOptions, lambda options: None, TwoStepClient,
                        ("value", "n", "centred"), dict.fromkeys(("value", "n", "centred"), "clipped"))
    with packages.installed(twostep):
        _multi_sum_session_fetches_later_steps_with_get_step()


def _multi_sum_session_fetches_later_steps_with_get_step():
    stats_schema = PayloadSchema((Field("value", (), clip=10.0, frac_bits=12),
                                  Field("n", (), kind=Kind.COUNT, clip=10)))
    centred_schema = PayloadSchema((Field("centred", (), clip=10.0, frac_bits=12),))
    mean = {"mean": np.float64(1.5)}
    plan = make_plan(3, {"unused": np.zeros(1)}, [("stats", "s1", stats_schema), ("centre", "s2", centred_schema)],
                     algorithm="twostep", options={}, later_broadcasts={"s2": mean}, t=2)
    trainers = {i: ShiftTrainer(0.0, examples=1, value=float(i)) for i in range(1, 4)}
    aggregator, coordinator, devices, stats = run(run_cohort(plan, trainers, coordinator_options={"step_polls": 2}))

    expected = reference_ring(plan, trainers, {i: 100 + i for i in trainers}, {1, 2, 3},
                              {"s1": {"unused": np.zeros(1)}, "s2": mean})
    for sum_id in ("s1", "s2"):
        np.testing.assert_array_equal(aggregator.server.results[sum_id].total.astype(np.uint64), expected[sum_id])
    decoded = stats_schema.decode_sum(aggregator.server.results["s1"].total, plan.config.sums[0].bits)
    assert decoded["n"] == 3 and decoded["value"] == pytest.approx(6.0, abs=3 * 2**-12)
    for i in range(1, 4):
        # Asked twice (RetryAfter) then served; no device asked for the first sum's step.
        assert coordinator.polls[(f"dev-{i}", "s2")] == 3 and (f"dev-{i}", "s1") not in coordinator.polls
        assert devices[i].local_state(JOB) == 2 and stats[i].sessions_completed == 1


def test_session_config_other_than_assigned_is_refused():
    plan = fedavg_plan(3)
    other = dataclasses.replace(plan.config, graph_seed=b"\x06" * 32)
    aggregator, _, devices, stats = run(run_cohort(plan, {1: ShiftTrainer(0.1, 4), 2: ShiftTrainer(0.2, 4),
                                                          3: ShiftTrainer(0.3, 4)}, announced=other))
    assert aggregator.received == []  # nobody advertised keys into the wrong session
    assert aggregator.server.aborted is not None
    for s in stats.values():
        assert (s.sessions_aborted, s.sessions_completed, s.contributed) == (1, 0, [])


@pytest.fixture
def retry_events():
    """An asyncio.Event-like latch set when the device logs a retry of a given status."""
    logger = logging.getLogger("tally.client.device")
    seen: list[str] = []
    waiters: list[tuple[str, asyncio.Event]] = []

    class Handler(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.getMessage() == "rpc retry":
                seen.append(record.fields["code"])
                for code, event in waiters:
                    if code == record.fields["code"]:
                        event.set()

    def wait_for(code: str) -> asyncio.Event:
        event = asyncio.Event()
        waiters.append((code, event))
        return event

    handler, level = Handler(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    yield wait_for, seen
    logger.removeHandler(handler)
    logger.setLevel(level)


def test_device_outlives_a_late_start_and_a_coordinator_restart(retry_events):
    wait_for_retry, seen = retry_events

    async def scenario():
        probe, port = await serve(FakeCoordinator())
        await probe.stop(None)  # the port is known; nothing listens on it yet
        address = f"127.0.0.1:{port}"
        stop = asyncio.Event()
        d = device(address, "dev-1", ShiftTrainer(0.1, 3), seed=1)
        unavailable = wait_for_retry("UNAVAILABLE")
        runner = asyncio.ensure_future(d.run(stop))
        await asyncio.wait_for(unavailable.wait(), TIMEOUT)

        cancelled = wait_for_retry("CANCELLED")
        first = FakeCoordinator(cancel_checkins=True)
        server, _ = await serve(first, port=port)  # started late, and about to shut down
        await asyncio.wait_for(cancelled.wait(), TIMEOUT)
        unavailable = wait_for_retry("UNAVAILABLE")
        await server.stop(None)
        await asyncio.wait_for(unavailable.wait(), TIMEOUT)

        second = FakeCoordinator(assign=False)  # a new token secret: the old token is refused
        server, _ = await serve(second, port=port)
        await asyncio.wait_for(second.checked_in.wait(), TIMEOUT)
        stop.set()
        stats = await asyncio.wait_for(runner, TIMEOUT)
        await server.stop(None)
        return first, second, stats

    first, second, stats = run(scenario())
    assert first.registrations["dev-1"] == 1 and second.registrations["dev-1"] == 1
    assert second.checkins["dev-1"] >= 1 and stats.retries >= 3 and {"UNAVAILABLE", "CANCELLED"} <= set(seen)
    assert stats.tasks_done == 0


@pytest.fixture
def one_torch_thread():
    """Tiny models: torch's intra-op threads only contend (as in tally.training.single_threaded)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_device_speaks_tls_with_the_deployment_ca_alone(tmp_path):
    """Devices hold the CA and no certificate of their own: nothing is shared by every device."""
    certs.write_deployment(tmp_path)

    async def scenario():
        coordinator = FakeCoordinator(assign=False)
        server_tls = TLSConfig.from_dir(tmp_path / "coordinator", "coordinator")
        server, port = await serve(coordinator, tls=server_tls)
        stop = asyncio.Event()
        d = Device(f"localhost:{port}", TLSConfig.from_dir(tmp_path / "device", None), "tls-dev", ShiftTrainer(0, 1),
                   retry=FAST)
        runner = asyncio.ensure_future(d.run(stop))
        try:
            await asyncio.wait_for(coordinator.checked_in.wait(), TIMEOUT)
        finally:
            stop.set()
            stats = await asyncio.wait_for(runner, TIMEOUT)
            await server.stop(None)
        return coordinator, stats

    coordinator, stats = run(scenario())
    assert coordinator.registrations["tls-dev"] == 1 and stats.checkins >= 1 and stats.retries == 0


def test_a_device_refuses_neighbour_keys_the_aggregator_substituted(tmp_path):
    """Attack 1 against the real SDK over TLS: the aggregator hands device 1 its own keys in place
    of neighbour 2's. Device 1 checks them against the coordinator-signed roster, refuses, and
    sends no share at all (so nothing of its mask key or seed reaches the aggregator); the
    others' session completes without it and their sum is exact."""
    certs.write_deployment(tmp_path)
    plan = fedavg_plan(5)
    # Fresh session key pairs of the aggregator's own, posing as device 2's (it keeps device 2's
    # signature: it has no identity key that the roster lists).
    forged_keys = SecAggClient(plan.config, 2, identities(5)[2], policy=LAX).start()[0].keys

    def substitute(recipient: int, message: Any) -> Any:
        if recipient != 1 or not isinstance(message, ShareKeysRequest):
            return message
        return dataclasses.replace(message, neighbours=tuple(
            dataclasses.replace(n, keys=forged_keys) if n.index == 2 else n for n in message.neighbours))

    trainers = {i: ShiftTrainer(0.1 * i, 4) for i in range(1, 6)}
    aggregator = FakeSessionStreams(plan, rewrite=substitute)
    tls = (TLSConfig.from_dir(tmp_path / "coordinator", "coordinator"), TLSConfig.from_dir(tmp_path / "device", None))
    aggregator, _, _, stats = run(run_cohort(plan, trainers, aggregator=aggregator, tls=tls))
    assert stats[1].sessions_aborted == 1 and stats[1].sessions_completed == 0
    assert not any(isinstance(m, ShareKeysResponse) and m.sender == 1 for m in aggregator.received)
    assert all(stats[i].sessions_completed == 1 for i in range(2, 6))
    result = aggregator.server.results["update"]
    assert result.contributors == (2, 3, 4, 5)
    expected = reference_ring(plan, trainers, {i: 100 + i for i in trainers}, {2, 3, 4, 5}, {"update": small_model()})
    np.testing.assert_array_equal(result.total.astype(np.uint64), expected["update"])


def test_a_device_whose_shares_were_withheld_sends_no_input(tmp_path):
    """Attack 8 against the real SDK over TLS: the aggregator delivers device 1 only one share
    (t is 3). Had device 1 masked its input anyway, its neighbours would later release its seed
    and its input would be exposed; it refuses instead, and never sends a masked input."""
    certs.write_deployment(tmp_path)
    plan = fedavg_plan(5)
    assert plan.config.params.t > 1

    def withhold(recipient: int, message: Any) -> Any:
        if recipient != 1 or not isinstance(message, ShareDelivery):
            return message
        return dataclasses.replace(message, shares=message.shares[:1])

    trainers = {i: ShiftTrainer(0.1 * i, 4) for i in range(1, 6)}
    tls = (TLSConfig.from_dir(tmp_path / "coordinator", "coordinator"), TLSConfig.from_dir(tmp_path / "device", None))
    aggregator, _, _, stats = run(
        run_cohort(plan, trainers, aggregator=FakeSessionStreams(plan, rewrite=withhold), tls=tls))
    assert stats[1].sessions_aborted == 1 and stats[1].sessions_completed == 0
    assert not any(isinstance(m, MaskedInputResponse) and m.sender == 1 for m in aggregator.received)
    assert aggregator.server.results["update"].contributors == (2, 3, 4, 5)


@pytest.mark.parametrize("settled", [True, False])
def test_a_session_leaving_collects_a_read_that_failed_meanwhile(settled):
    """A session that leaves while its stream read has already failed (an aggregator killed
    while the device was sending) collects that failure and cancels what still runs: nothing
    is reported as "Task exception was never retrieved". Without ``settle`` (the control) it is."""
    reported: list[str] = []

    async def scenario() -> None:
        asyncio.get_running_loop().set_exception_handler(lambda loop, context: reported.append(context["message"]))

        async def broken_read() -> None:
            raise grpc.aio.UsageError("stream removed")

        reading = asyncio.ensure_future(broken_read())
        computing = asyncio.ensure_future(asyncio.sleep(3600))
        await asyncio.sleep(0)  # the read fails
        if settled:
            await settle(reading, None, computing)
            assert computing.cancelled()
        else:
            computing.cancel()
        del reading, computing
        gc.collect()

    asyncio.run(scenario())
    assert (reported == []) == settled, reported


def test_plaintext_channels_only_to_loopback():
    async def open_(target: str) -> None:
        await open_aio_channel(target, PLAIN).close()

    run(open_("127.0.0.1:1"))
    with pytest.raises(ValueError, match="loopback"):
        run(open_("192.0.2.1:443"))


def test_fleet_of_torch_devices_on_digits_shards(one_torch_thread):
    fed = digits(4, alpha=1.0, seed=0)
    factory = lambda: mlp(fed.num_features, fed.num_classes, hidden=8, seed=0)  # noqa: E731
    params = get_params(factory())
    server_half, client_half = algorithms.make("fedavg", FEDAVG_OPTIONS)
    step = server_half.steps(server_half.init(params))[0]
    ids = [f"sim-{i:05d}" for i in range(4)]
    plan = make_plan(4, params, [(step.name, step.name, step.schema)],
                     roster_keys=tuple(simulated_identity(ENROLMENT_KEY, d).public for d in ids))

    def trainers():
        return [TorchTrainer(factory, X, y, seed=i, device=torch.device("cpu")) for i, (X, y) in enumerate(fed.clients)]

    async def scenario():
        aggregator = FakeSessionStreams(plan)
        coordinator = FakeCoordinator(plan, {d: i + 1 for i, d in enumerate(ids)})
        coordinator.job_state = lambda: (common_pb2.JOB_STATE_SUCCEEDED if aggregator.done.is_set()
                                         else common_pb2.JOB_STATE_RUNNING)
        server, port = await serve(coordinator, aggregator)
        coordinator.aggregator = f"127.0.0.1:{port}"
        fleet = Fleet(f"127.0.0.1:{port}", PLAIN, trainers(), seed=5, retry=FAST, training_threads=2,
                      enrolment_key=ENROLMENT_KEY, device_policy=LAX)
        out = io.StringIO()
        try:
            stats = await fleet.run(max_tasks_per_device=1, progress=True, console=Console(file=out, width=200))
            done = await fleet.until_job_done(JOB)(stats)
        finally:
            fleet.close()
            await server.stop(None)
        return aggregator, stats, done, out.getvalue(), fleet.metrics

    aggregator, stats, done, shown, metrics = run(scenario())
    assert done  # the fake coordinator reports the job finished
    assert (stats.devices, stats.tasks_done, stats.sessions_completed, stats.dropouts) == (4, 4, 4, 0)
    assert stats.rounds == {JOB: [3]} and stats.last_model_version == "v3" and stats.bytes_up > 0
    assert "fleet" in shown and "sessions ok 4" in shown
    assert metrics.registry.get_sample_value("tally_client_sessions_total", {"outcome": "completed"}) == 4

    result = aggregator.server.results[step.name]
    total = step.schema.decode_sum(result.total, plan.config.sums[0].bits)
    reference = [client_half.contribute(step.name, params, t, None)[0] for t in trainers()]
    bound = step.schema.quantisation_bound(4)
    for f in step.schema.fields:
        np.testing.assert_allclose(total[f.name], sum(np.asarray(r[f.name], np.float64) for r in reference),
                                   atol=bound[f.name] + 1e-9)


def test_fetch_onnx_verifies_the_announced_digest_and_evaluates(tmp_path):
    X, y = digits(2, seed=0).test
    model = mlp(64, 10, hidden=16, seed=3)
    onnx_bytes = export_onnx(model, tmp_path / "model.onnx")

    async def scenario():
        coordinator = FakeCoordinator(files={"latest": onnx_bytes}, corrupt_first=frozenset({"app"}),
                                      break_after_chunks=3, chunk_size=1024)
        server, port = await serve(coordinator)
        try:
            app = device(f"127.0.0.1:{port}", "app", ShiftTrainer(0, 1), seed=0)
            return await app.fetch_onnx(), coordinator
        finally:
            await server.stop(None)

    fetched, coordinator = run(scenario())
    assert fetched == onnx_bytes
    # Broken after 3 chunks, resumed, found corrupt (first byte flipped), fetched again from 0.
    assert [o for _, _, o in coordinator.downloads] == [0, 3072, 0]
    assert all(v == "latest.onnx" for _, v, _ in coordinator.downloads)
    served = OnnxModel.from_bytes(fetched)
    loss, accuracy = served.evaluate(X, y)
    torch_loss, torch_accuracy = TorchTrainer(lambda: mlp(64, 10, hidden=16), X, y,
                                              device=torch.device("cpu")).evaluate(get_params(model))
    assert loss == pytest.approx(torch_loss, rel=1e-4) and accuracy == pytest.approx(torch_accuracy)


def export_onnx(model: torch.nn.Module, path) -> bytes:
    """The legacy TorchScript exporter (the dynamo one needs onnxscript, not installed here)."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        torch.onnx.export(model, (torch.zeros(1, 64),), str(path), dynamo=False, input_names=["features"],
                          output_names=["logits"], dynamic_axes={"features": {0: "batch"}, "logits": {0: "batch"}})
    return path.read_bytes()


def test_onnx_model_matches_torch_predictions(tmp_path):
    X, y = digits(2, seed=1).test
    model = mlp(64, 10, hidden=32, seed=4)
    export_onnx(model, tmp_path / "m.onnx")
    onnx_model = OnnxModel.from_path(tmp_path / "m.onnx")
    with torch.no_grad():
        logits = model(torch.as_tensor(X)).numpy()
    np.testing.assert_allclose(onnx_model.logits(X), logits, rtol=1e-4, atol=1e-5)
    np.testing.assert_array_equal(onnx_model.predict(X), logits.argmax(axis=1))
    proba = onnx_model.predict_proba(X[:5])
    np.testing.assert_allclose(proba.sum(axis=1), 1.0)
    np.testing.assert_allclose(proba, torch.softmax(torch.as_tensor(logits[:5]), 1).numpy(), rtol=1e-4, atol=1e-6)
    assert onnx_model.predict(X[0]).shape == (1,)


def test_onnx_model_module_does_not_need_torch():
    code = ("import sys, tally.client.onnx_model, tally.client; "
            "assert 'torch' not in sys.modules, 'torch was imported'")
    subprocess.run([sys.executable, "-c", code], check=True,
                   cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))


def test_dropout_plan_is_deterministic_per_device_and_validated():
    plan = DropoutPlan(0.3, seed=9)
    first = [next(plan.draws("a")) for _ in range(1)]
    a = plan.draws("a")
    draws = [next(a) for _ in range(400)]
    assert draws[:1] == first and draws == [d for d, _ in zip(plan.draws("a"), range(400))]
    assert draws != [d for d, _ in zip(plan.draws("b"), range(400))]
    dropped = [d for d in draws if d is not None]
    assert 0.2 < len(dropped) / len(draws) < 0.4 and set(dropped) == set(plan.phases)
    with pytest.raises(ValueError):
        DropoutPlan(1.5)
    with pytest.raises(ValueError):
        DropoutPlan(0.1, ("reboot",))


def test_model_cache_verifies_disk_entries(tmp_path):
    blob = b"model bytes"
    digest = hashlib.sha256(blob).hexdigest()
    ModelCache(tmp_path).put(digest, blob)
    (tmp_path / digest).write_bytes(b"tampered")
    assert ModelCache(tmp_path).get(digest) is None and not (tmp_path / digest).exists()
    with pytest.raises(ValueError):
        ModelCache(tmp_path).put("0" * 64, blob)


def test_stream_timeout_covers_every_phase_of_every_sum():
    assert stream_timeout(secagg_pb2.PhaseDeadlines(), 2) is None
    assert stream_timeout(DEADLINES, 2) == pytest.approx(20 + 20 + 2 * (20 + 20) + 30)


@pytest.mark.parametrize("command", ["client", "fleet"])
def test_cli_help(command, capsys):
    parser = argparse.ArgumentParser(prog="tally")
    client_cli.register(parser.add_subparsers())
    with pytest.raises(SystemExit) as exit_:
        parser.parse_args([command, "--help"])
    assert exit_.value.code == 0
    text = capsys.readouterr().out
    for flag in ("--coordinator", "--dataset", "--insecure", "--tls-dir",
                 *(("--device-id", "--shard", "--shards", "--max-tasks") if command == "client" else
                   ("--devices", "--alpha", "--dropout", "--seed", "--max-tasks-per-device", "--until-job-done"))):
        assert flag in text


@pytest.fixture
def tally_logger():
    """The CLI configures the ``tally`` logger for the process; give other tests theirs back."""
    logger = logging.getLogger("tally")
    saved = (list(logger.handlers), logger.level, logger.propagate)
    yield
    logger.handlers[:], logger.level, logger.propagate = saved[0], saved[1], saved[2]


class BackgroundLoop:
    """Fake servers on their own event loop thread, so a CLI can own the main thread's loop."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(TIMEOUT)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(TIMEOUT)
        self.loop.close()


@pytest.mark.parametrize("until", [["--max-tasks-per-device", "1"], []], ids=["max-tasks", "job-done"])
def test_fleet_command_runs_devices_against_a_coordinator(until, tmp_path, one_torch_thread, tally_logger):
    """Without a stopping flag the fleet exits once every job it was given tasks of has
    finished (issue 9, item 6: it used to run forever)."""
    params = get_params(mlp(64, 10, hidden=8))
    server_half, _ = algorithms.make("fedavg", FEDAVG_OPTIONS)
    step = server_half.steps(server_half.init(params))[0]
    ids = [f"cli-{i:05d}" for i in range(3)]
    plan = make_plan(3, params, [(step.name, step.name, step.schema)],
                     roster_keys=tuple(simulated_identity(ENROLMENT_KEY, d).public for d in ids))
    (tmp_path / "enrolment.key").write_bytes(ENROLMENT_KEY)

    async def start():
        aggregator = FakeSessionStreams(plan)
        coordinator = FakeCoordinator(plan, {d: i + 1 for i, d in enumerate(ids)})
        server, port = await serve(coordinator, aggregator)
        coordinator.aggregator = f"127.0.0.1:{port}"
        return aggregator, server, port

    background = BackgroundLoop()
    try:
        aggregator, server, port = background.call(start())
        parser = argparse.ArgumentParser(prog="tally")
        client_cli.register(parser.add_subparsers())
        args = parser.parse_args([
            "fleet", "--coordinator", f"127.0.0.1:{port}", "--insecure", "--devices", "3", "--hidden", "8",
            "--id-prefix", "cli", "--dropout", "0", *until, "--no-progress",
            "--json", str(tmp_path / "fleet.json"), "--enrolment-key", str(tmp_path / "enrolment.key"),
        ])
        assert args.run(args) == 0
        background.call(server.stop(None))
    finally:
        background.close()
    report = json.loads((tmp_path / "fleet.json").read_text())
    assert (report["devices"], report["tasks_done"], report["sessions_completed"]) == (3, 3, 3)
    assert report["rounds"] == {JOB: [3]} and aggregator.server.results[step.name].contributors == (1, 2, 3)


def test_a_fleet_never_selected_exits_when_its_population_has_no_job_left(one_torch_thread):
    """A shard of a large fleet may never be selected: it has no job to wait for, so it ends once
    a job of its population has run (its devices were told to wait) and none runs now. It does
    not end before any job ran."""

    async def scenario(coordinator: FakeCoordinator, timeout: float):
        server, port = await serve(coordinator)
        fleet = Fleet(f"127.0.0.1:{port}", PLAIN, [ShiftTrainer(0.1, 4) for _ in range(3)], retry=FAST,
                      enrolment_key=ENROLMENT_KEY)
        try:
            return await asyncio.wait_for(fleet.run(until=fleet.until_jobs_done(every_seconds=0.01)), timeout)
        finally:
            fleet.close()
            await server.stop(None)

    stats = run(scenario(FakeCoordinator(assign=False, idle_from_checkin=4), 10))
    assert stats.jobs_over and stats.tasks_done == 0 and stats.jobs == []
    never_busy = FakeCoordinator(assign=False, idle_from_checkin=1)
    with pytest.raises(TimeoutError):
        run(scenario(never_busy, 1.0))  # idle from the start: nothing ran, so it keeps waiting
    assert min(never_busy.checkins.values()) > 1


def _pointed_at_nothing(argv: list[str]) -> tuple[str, argparse.Namespace]:
    """A free loopback address nothing listens on, and ``tally ARGV`` parsed to dial it."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{probe.getsockname()[1]}"
    parser = argparse.ArgumentParser(prog="tally")
    client_cli.register(parser.add_subparsers())
    return dead, parser.parse_args([argv[0], "--coordinator", dead, "--insecure", *argv[1:]])


def test_a_fleet_pointed_at_nothing_says_so_and_exits(capsys, tally_logger):
    """Issue 9, item 6: a fleet pointed at a dead address printed nothing, forever."""
    dead, args = _pointed_at_nothing(["fleet", "--devices", "2", "--hidden", "8", "--connect-timeout", "1",
                                      "--no-progress"])
    assert args.run(args) == 1
    err = " ".join(capsys.readouterr().err.split())
    assert f"no device reached the coordinator at {dead} within 1 s" in err
    assert "Register: UNAVAILABLE" in err


def test_cli_rejects_bad_shard(capsys):
    parser = argparse.ArgumentParser(prog="tally")
    client_cli.register(parser.add_subparsers())
    args = parser.parse_args(["client", "--coordinator", "127.0.0.1:1", "--insecure", "--device-id", "d",
                              "--shard", "4", "--shards", "4"])
    assert args.run(args) == 2 and "--shard" in capsys.readouterr().err


def test_client_metrics_names_are_tally_client_base_units():
    names = {m.name for m in ClientMetrics().registry.collect() if m.name.startswith("tally_")} - {"tally_build_info"}
    assert names and all(n.startswith("tally_client_") for n in names)
    assert {"tally_client_upload_bytes", "tally_client_download_seconds"} <= names


def test_a_client_given_a_state_directory_keeps_its_identity_key_there(tmp_path, monkeypatch):
    """Issue 25, item 7: `tally client --state-dir D` wrote its identity key to ~/.tally, outside
    the one directory it was given; now it lives in D unless --identity says otherwise."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    parser = argparse.ArgumentParser(prog="tally")
    client_cli.register(parser.add_subparsers())
    base = ["client", "--coordinator", "127.0.0.1:1", "--insecure", "--device-id", "dev-7",
            "--shard", "0", "--shards", "1"]
    in_state = parser.parse_args([*base, "--state-dir", str(tmp_path / "state")])
    assert client_run._identity_path(in_state) == tmp_path / "state" / "identity.key"
    given = parser.parse_args([*base, "--state-dir", str(tmp_path / "state"), "--identity", str(tmp_path / "k")])
    assert client_run._identity_path(given) == tmp_path / "k"
    assert client_run._identity_path(parser.parse_args(base)) == tmp_path / "home" / ".tally" / "dev-7.identity"


def test_a_client_pointed_at_nothing_says_so_and_exits(capsys, tally_logger, tmp_path):
    """Issue 25, item 4: `tally client` at a dead address printed nothing for 150 s (19 retries)."""
    dead, args = _pointed_at_nothing(["client", "--device-id", "d", "--shard", "0", "--shards", "2", "--hidden", "8",
                                      "--state-dir", str(tmp_path), "--connect-timeout", "1"])
    assert args.run(args) == 1
    err = " ".join(capsys.readouterr().err.split())
    assert f"tally client: the device did not reach the coordinator at {dead} within 1 s" in err
    assert "Register: UNAVAILABLE" in err


def test_pause_sleeps_its_time_or_ends_every_sleeper_when_stopped():
    """Many devices pause on one stop event (a fleet's): each sleeps its own time, and setting the
    event ends all of them at once, also after it was cleared and set again."""
    from tally.client.retry import Stopped, pause

    async def sleeper(stop: asyncio.Event, seconds: float) -> str:
        try:
            await pause(seconds, stop)
        except Stopped:
            return "stopped"
        return "slept"

    async def main():
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        started = loop.time()
        short = await asyncio.gather(*(sleeper(stop, 0.01 * i) for i in range(1, 6)))
        slept = loop.time() - started
        long = [asyncio.ensure_future(sleeper(stop, 600)) for _ in range(2000)]
        await asyncio.sleep(0)  # they start pausing; one that has not would be stopped just the same
        stop.set()
        stopped = await asyncio.wait_for(asyncio.gather(*long), 10)
        stop.clear()
        again = asyncio.ensure_future(sleeper(stop, 600))
        await asyncio.sleep(0)
        stop.set()
        return short, slept, stopped, await asyncio.wait_for(again, 10)

    short, slept, stopped, again = asyncio.run(main())
    assert short == ["slept"] * 5 and slept >= 0.05
    assert stopped == ["stopped"] * 2000
    assert again == "stopped"
