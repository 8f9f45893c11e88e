"""The secure-aggregator service over real gRPC and real TLS on 127.0.0.1, driven from both sides:
the test plays the coordinator (signs tickets, opens sessions, awaits sums) and the devices (a small
asyncio pump around ``SecAggClient`` per device stream; dropouts cancel their stream when a given
phase's request arrives). The aggregator's functional tests and its attack tests share this.
"""

from __future__ import annotations

import asyncio
import hashlib
import secrets
import time
import urllib.request
from collections.abc import Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from cryptography.hazmat.primitives import serialization

from support.secagg import identities, roster
from tally.aggregator import AggregatorService
from tally.client.session import stream_status
from tally.codec import Field, Kind, PayloadSchema, to_ring
from tally.secagg import DevicePolicy, SecAggClient, SessionConfig, SessionRef, ThreatModel
from tally.secagg.messages import Abort
from tally.secagg.phases import DEADLINED, asked_for
from tally.security import (
    OwnerTokens,
    SessionTicket,
    TicketSigner,
    TLSConfig,
    config_digest,
    owner_metadata,
)
from tally.security.certs import write_deployment
from tally.security.tls import channel_credentials, channel_options
from tally.security.tokens import load_or_create_ticket_key
from tally.wire.chunks import split_masked_input
from tally.wire.join import join_metadata
from tally.wire.protocol import (
    device_envelope,
    from_proto,
    open_envelope,
    session_config_bytes,
    to_proto,
)
from tally.wire.sums import cohort_sum_from_proto, schema_to_proto
from tally.wire.v1 import aggregator_pb2, aggregator_pb2_grpc, secagg_pb2, secagg_pb2_grpc

TEST_TIMEOUT_S = 50
SCHEMAS = {
    "update": PayloadSchema((Field("w", (40,), Kind.COUNT, clip=1000),)),
    "count": PayloadSchema((Field("n", (1,), Kind.COUNT, clip=100),)),
}
# t = 2 for 8 devices: the cohort tolerates the dropouts below, and Unmask closes early.
THREAT = ThreatModel(dropout_rate=0.4, corrupt_rate=0.0, malicious_server=False)
CODE = grpc.StatusCode


# ---- the coordinator's side ------------------------------------------------------------------


@dataclass(frozen=True)
class Deployment:
    tls_dir: Path
    signer: TicketSigner
    public_key: bytes

    def server_tls(self, require_client_auth: bool = False) -> TLSConfig:
        return TLSConfig.from_dir(self.tls_dir / "aggregator-1", "aggregator", require_client_auth=require_client_auth)

    def channel(self, target: str, identity: str | None = None) -> grpc.aio.Channel:
        """A channel presenting ``identity``'s certificate (``coordinator``), or none (a device)."""
        directory = self.tls_dir / (identity or "device")
        credentials = channel_credentials(TLSConfig.from_dir(directory, identity))
        return grpc.aio.secure_channel(target, credentials, options=channel_options(8 << 20))


OWNER_TOKENS = OwnerTokens(b"coordinator token secret for tests")


def new_deployment(directory: Path) -> Deployment:
    """``tally certs`` identities in ``directory`` and the coordinator's ticket signer."""
    write_deployment(directory)
    signer = TicketSigner(load_or_create_ticket_key(directory / "coordinator"))
    public = signer.public_key.public_bytes(
        serialization.Encoding.Raw, serialization.PublicFormat.Raw
    )
    return Deployment(directory, signer, public)


@dataclass
class PlannedCohort:
    """One session as the coordinator planned it, and every device's private values."""

    config: SessionConfig
    ticket: bytes
    tokens: dict[int, str]
    values: dict[int, dict[str, dict[str, np.ndarray]]]
    request: aggregator_pb2.OpenSessionRequest
    owner: bytes  # the coordinator's owner token for the session

    @property
    def owner_md(self) -> tuple[tuple[str, bytes], ...]:
        return owner_metadata(self.owner)

    def ring_inputs(self, index: int) -> dict[str, np.ndarray]:
        rng = np.random.default_rng(index)
        return {
            spec.sum_id: to_ring(SCHEMAS[spec.sum_id].encode(self.values[index][spec.sum_id],
                                                             rng).vector, spec.bits)
            for spec in self.config.sums
        }

    def expected(self, sum_id: str, contributors) -> np.ndarray:
        (name,) = self.values[1][sum_id]
        return sum(self.values[i][sum_id][name] for i in contributors)


def sign(deployment: Deployment, config: SessionConfig, *, aggregator_id: str = "agg-a",
         expires_in: float = 300.0, **overrides) -> bytes:
    fields = dict(
        job_id=config.ref.job_id, round=config.ref.round, session_id=config.ref.session_id,
        sum_ids=tuple(s.sum_id for s in config.sums), cohort_size=config.n,
        config_digest=config_digest(session_config_bytes(config)),
        aggregator_id=aggregator_id, expires_at=time.time() + expires_in,
    )
    fields.update(overrides)
    return deployment.signer.sign(SessionTicket(**fields))


def deadlines(seconds: float, **by_phase: float) -> secagg_pb2.PhaseDeadlines:
    values = {p.deadline_field: seconds for p in DEADLINED}
    values.update({f"{p}_seconds": s for p, s in by_phase.items()})
    return secagg_pb2.PhaseDeadlines(**values)


def plan(deployment: Deployment, session_id: str, *, n: int = 8, seconds: float = 2.0,
         aggregator_id: str = "agg-a", phase_seconds: dict | None = None) -> PlannedCohort:
    config = SessionConfig.plan(SessionRef("job-1", 3, session_id), list(SCHEMAS.items()), n,
                                THREAT, identities=roster(n))
    rng = np.random.default_rng(abs(hash(session_id)) % 2**32)
    values = {
        i: {"update": {"w": rng.integers(0, 1000, size=40)},
            "count": {"n": rng.integers(1, 100, size=1)}}
        for i in range(1, n + 1)
    }
    tokens = {i: secrets.token_urlsafe(16) for i in range(1, n + 1)}
    ticket = sign(deployment, config, aggregator_id=aggregator_id)
    request = aggregator_pb2.OpenSessionRequest(
        session_ticket=ticket,
        config=to_proto(config),
        schemas=[schema_to_proto(sum_id, schema) for sum_id, schema in SCHEMAS.items()],
        deadlines=deadlines(seconds, **(phase_seconds or {})),
        devices=[aggregator_pb2.DeviceGrant(device_index=i,
                                            token_sha256=hashlib.sha256(t.encode()).digest())
                 for i, t in tokens.items()],
    )
    owner = OWNER_TOKENS.token(aggregator_id, session_id)
    request.owner_token_sha256 = hashlib.sha256(owner).digest()
    return PlannedCohort(config, ticket, tokens, values, request, owner)


@asynccontextmanager
async def connected(deployment: Deployment, service: AggregatorService, identity: str | None = None):
    """A channel to the device port, or with the coordinator's identity to the control port."""
    port = service.control_port if identity == "coordinator" else service.port
    async with deployment.channel(f"127.0.0.1:{port}", identity) as channel:
        yield channel, aggregator_pb2_grpc.AggregatorControlStub(channel)


async def rpc_error(call) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await call
    return err.value.code(), err.value.details()


def run(coroutine_fn: Callable, *args) -> None:
    asyncio.run(asyncio.wait_for(coroutine_fn(*args), TEST_TIMEOUT_S))


# ---- the devices' side -------------------------------------------------------------------------


@dataclass
class DeviceRun:
    """What one device saw: ``outcome`` is done, aborted, dropped or error."""

    outcome: str = ""
    detail: str = ""
    code: grpc.StatusCode | None = None
    joined: asyncio.Event = field(default_factory=asyncio.Event)


async def device(channel: grpc.aio.Channel, cohort: PlannedCohort, index: int,
                 drop_at: tuple[str, str] | None = None, seen: DeviceRun | None = None,
                 tamper: Callable[[Any], Any] = lambda message: message,
                 split: Callable[[Any], list] = split_masked_input) -> DeviceRun:
    """Run device ``index`` through the session; with ``drop_at`` (phase, sum id), cancel the
    stream when that phase's request arrives (AdvertiseKeys: right after Joined); ``tamper``
    rewrites what the device sends (a misbehaving device); ``split`` turns an envelope into the
    envelopes that go on the stream (masked inputs in chunks)."""
    seen = seen or DeviceRun()
    call = secagg_pb2_grpc.SecureAggregationStub(channel).Session(metadata=join_metadata(join(cohort, index)))
    client = SecAggClient(cohort.config, index, identities(cohort.config.n)[index],
                          policy=DevicePolicy(threat=THREAT))
    for sum_id, vector in cohort.ring_inputs(index).items():
        client.provide_input(sum_id, vector)
    try:
        while (reply := await call.read()) is not grpc.aio.EOF:
            message = open_envelope(reply)
            if isinstance(message, secagg_pb2.Joined):
                assert from_proto(message.config) == cohort.config
                seen.joined.set()
                if drop_at == ("advertise_keys", ""):
                    return _drop(call, seen)
                outgoing = client.start()
            elif isinstance(message, secagg_pb2.SessionDone):
                assert list(message.sum_ids) == [s.sum_id for s in cohort.config.sums]
                seen.outcome = "done"
                continue
            elif drop_at is not None and asked_for(message) == drop_at:
                return _drop(call, seen)
            else:
                if isinstance(message, Abort):
                    seen.outcome, seen.detail = "aborted", message.reason
                outgoing = client.receive(message)
            for m in outgoing:
                for envelope in split(device_envelope(tamper(m))):
                    await call.write(envelope)
        seen.code = await call.code()
    except (grpc.aio.AioRpcError, asyncio.InvalidStateError) as exc:
        seen.outcome, seen.code, seen.detail = "error", *await stream_status(call, exc)
    return seen


def _drop(call, seen: DeviceRun) -> DeviceRun:
    call.cancel()
    seen.outcome = "dropped"
    return seen


async def misbehave(channel: grpc.aio.Channel, *messages) -> tuple[grpc.StatusCode, str]:
    """Send ``messages`` on one stream and read until the server ends it: its status. A leading
    Join goes in the stream's metadata, as devices send it."""
    metadata = ()
    if messages and isinstance(messages[0], secagg_pb2.Join):
        metadata, messages = join_metadata(messages[0]), messages[1:]
    call = secagg_pb2_grpc.SecureAggregationStub(channel).Session(metadata=metadata)
    for m in messages:
        await call.write(m if isinstance(m, secagg_pb2.DeviceToAggregator) else device_envelope(m))
    await call.done_writing()
    try:
        while await call.read() is not grpc.aio.EOF:
            pass
    except grpc.aio.AioRpcError as exc:
        return exc.code(), exc.details()
    return await call.code(), await call.details()


def join(cohort: PlannedCohort, index: int, token: str | None = None,
         ticket: bytes | None = None) -> secagg_pb2.Join:
    return secagg_pb2.Join(session_ticket=cohort.ticket if ticket is None else ticket,
                           device_index=index,
                           session_token=cohort.tokens[index] if token is None else token)


async def await_sum(stub, cohort: PlannedCohort, sum_id: str, timeout: float = 20.0):
    reply = await stub.AwaitResult(aggregator_pb2.AwaitResultRequest(
        session_id=cohort.config.ref.session_id, sum_id=sum_id), timeout=timeout,
        metadata=cohort.owner_md)
    return reply, cohort_sum_from_proto(reply)


async def until_not_found(stub, cohort: PlannedCohort, timeout: float = 10.0) -> None:
    """Ask until the aggregator no longer knows the session (its results expired)."""
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    session_id = cohort.config.ref.session_id
    request = aggregator_pb2.AwaitResultRequest(session_id=session_id, sum_id="update")
    while loop.time() < end:
        try:
            await stub.AwaitResult(request, timeout=timeout, metadata=cohort.owner_md)
        except grpc.aio.AioRpcError as exc:
            assert exc.code() == CODE.NOT_FOUND, exc
            return
        await asyncio.sleep(0.05)  # the TTL is wall-clock time: nothing to await but time
    raise AssertionError(f"session {session_id} was still held after {timeout} s")


def assert_sum(cohort: PlannedCohort, sum_id: str, result, contributors, dropped=()) -> None:
    assert result.contributors == tuple(contributors)
    assert result.dropped == tuple(dropped)
    bits = cohort.config.sum_spec(sum_id).bits
    (decoded,) = SCHEMAS[sum_id].decode_sum(result.total, bits).values()
    np.testing.assert_array_equal(decoded, cohort.expected(sum_id, contributors))


def scrape(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    samples = {}
    for line in text.splitlines():
        if line.startswith("tally_aggregator_"):
            name, _, value = line.rpartition(" ")
            samples[name] = float(value)
    return samples
