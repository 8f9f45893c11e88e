"""Enrolment (issue 12, attack 4): registering needs a provisioning credential and a signature by
the identity key being enrolled; a taken device id cannot be registered under another key, a
recorded registration cannot be replayed, one key cannot name many devices, and a source that
floods Register or CheckIn is refused. Each refusal is a gRPC status naming the field or rule,
and is counted in ``tally_coordinator_refusals_total``."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import time
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from support.enrolment import provisioned_request
from support.stack import in_process
from tally.cli import coordinator as coordinator_cli
from tally.cli import enrol as enrol_cli
from tally.cli import main as tally
from tally.client.channels import open_aio_channel
from tally.client.enrolment import load_or_create_identity, register_request
from tally.coordinator.faces.ratelimit import RateLimit, SourceRateLimiter
from tally.coordinator.service import CoordinatorService
from tally.secagg import SigningKey
from tally.security import TLSConfig, bearer_metadata, load_or_create_ticket_key
from tally.security.certs import write_deployment
from tally.security.enrolment import (
    REGISTRATION_WINDOW_S,
    EnrolmentClaim,
    SharedKeyEnrolment,
    load_or_create_enrolment_key,
)
from tally.security.peers import source_of
from tally.wire.v1 import coordinator_pb2, coordinator_pb2_grpc


class Clock:
    """The coordinator's clock, moved by the test (rate limits refill with it)."""

    def __init__(self) -> None:
        self.now = time.time()

    def __call__(self) -> float:
        return self.now


@dataclasses.dataclass
class Coordinator:
    service: CoordinatorService
    stub: coordinator_pb2_grpc.CoordinatorStub
    clock: Clock

    async def register(self, request: coordinator_pb2.RegisterRequest) -> tuple[grpc.StatusCode, str, object]:
        try:
            reply = await self.stub.Register(request, timeout=10)
        except grpc.aio.AioRpcError as exc:
            return exc.code(), exc.details(), None
        return grpc.StatusCode.OK, "", reply

    def refusals(self, reason: str, rpc: str = "Register") -> float:
        value = self.service._metrics_server.registry.get_sample_value(
            "tally_coordinator_refusals_total", {"rpc": rpc, "reason": reason}
        )
        return value or 0.0


@contextlib.asynccontextmanager
async def coordinator(tmp_path: Path, **kwargs) -> AsyncIterator[Coordinator]:
    """A real coordinator over TLS (``tally certs`` identities), devices dialling it as devices do."""
    pki = tmp_path / "pki"
    if not pki.exists():
        write_deployment(pki)
    clock = Clock()
    async with in_process() as services:
        service = await services.coordinator(TLSConfig.from_dir(pki / "coordinator", "coordinator"), tmp_path / "state",
                                             clock=clock, **kwargs)
        async with open_aio_channel(f"localhost:{service.port}", TLSConfig.from_dir(pki / "device", None)) as channel:
            yield Coordinator(service, coordinator_pb2_grpc.CoordinatorStub(channel), clock)


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 60))


def test_a_provisioned_device_registers_and_learns_the_coordinators_ticket_key(tmp_path):
    async def main():
        async with coordinator(tmp_path) as c:
            code, _, reply = await c.register(provisioned_request(c.service, "d1"))
            checkin = await c.stub.CheckIn(coordinator_pb2.CheckInRequest(), metadata=bearer_metadata(reply.token),
                                           timeout=10)
            return code, reply, checkin

    code, reply, checkin = run(main())
    assert code == grpc.StatusCode.OK and reply.token
    assert reply.coordinator_key == load_or_create_ticket_key(tmp_path / "state").public_key().public_bytes_raw()
    assert checkin.WhichOneof("result") == "retry_after"


def test_registration_without_a_valid_credential_or_signature_is_refused(tmp_path):
    async def main():
        async with coordinator(tmp_path) as c:
            good = provisioned_request(c.service, "d1")
            cases = {
                "no credential": with_fields(good, enrolment_credential=b""),
                "another device's credential": with_fields(
                    good, enrolment_credential=provisioned_request(c.service, "d2").enrolment_credential),
                "another population": with_fields(good, population="other"),
                "forged signature": with_fields(good, signature=bytes(64)),
                "short key": with_fields(good, identity_public=good.identity_public[:31]),
                "no device id": with_fields(good, device_id=""),
                "stale": provisioned_request(c.service, "d1", now=c.clock.now - 2 * REGISTRATION_WINDOW_S),
            }
            answers = {name: (await c.register(request))[:2] for name, request in cases.items()}
            counted = {r: c.refusals(r) for r in ("not_enrolled", "bad_signature", "malformed", "stale")}
            # None of those enrolled the id: the genuine device still can.
            code, _, _ = await c.register(good)
            return answers, counted, code

    answers, counted, code = run(main())
    assert answers["no credential"] == (grpc.StatusCode.UNAUTHENTICATED,
                                        "RegisterRequest.enrolment_credential is required")
    for name in ("another device's credential", "another population"):
        assert answers[name][0] == grpc.StatusCode.PERMISSION_DENIED and "enrolment_credential" in answers[name][1]
    assert answers["forged signature"] == (grpc.StatusCode.UNAUTHENTICATED,
                                           "RegisterRequest.signature does not verify with identity_public")
    assert answers["short key"] == (grpc.StatusCode.INVALID_ARGUMENT,
                                    "RegisterRequest.identity_public: exactly 32 bytes")
    assert answers["no device id"][0] == grpc.StatusCode.INVALID_ARGUMENT and "device_id" in answers["no device id"][1]
    assert answers["stale"][0] == grpc.StatusCode.INVALID_ARGUMENT and "timestamp" in answers["stale"][1]
    assert counted == {"not_enrolled": 3, "bad_signature": 1, "malformed": 2, "stale": 1}
    assert code == grpc.StatusCode.OK


def test_a_taken_device_id_cannot_be_registered_again_without_its_key(tmp_path):
    """Attack 4: impersonation. The victim's credential alone (say, leaked) does not let another
    key take over its id; the victim itself re-registers (token renewal) with a fresh statement,
    while a recorded registration replayed verbatim is refused."""

    async def main():
        async with coordinator(tmp_path) as c:
            victim = SigningKey.generate()
            first = provisioned_request(c.service, "victim", identity=victim)
            answers = {"first": await c.register(first)}
            answers["another key, valid credential"] = await c.register(provisioned_request(c.service, "victim"))
            answers["replayed"] = await c.register(first)
            c.clock.now += 1
            answers["renewal"] = await c.register(provisioned_request(c.service, "victim", identity=victim,
                                                                      now=c.clock.now))
            answers["same key, second id"] = await c.register(provisioned_request(c.service, "sybil", identity=victim))
            stored = c.service.store.devices.identities(["victim"]).get("victim") == victim.public
            return ({name: a[:2] for name, a in answers.items()}, stored,
                    {r: c.refusals(r) for r in ("id_taken", "replay", "key_taken")})

    answers, stored, counted = run(main())
    assert answers["first"][0] == answers["renewal"][0] == grpc.StatusCode.OK
    assert answers["another key, valid credential"] == (
        grpc.StatusCode.PERMISSION_DENIED, "device id 'victim' is enrolled with another identity key")
    assert answers["replayed"][0] == grpc.StatusCode.PERMISSION_DENIED and "timestamp" in answers["replayed"][1]
    assert answers["same key, second id"] == (
        grpc.StatusCode.PERMISSION_DENIED, "this identity key is enrolled for another device id")
    assert counted == {"id_taken": 1, "replay": 1, "key_taken": 1}
    assert stored, "the id must stay bound to the victim's key"


def test_register_and_checkin_are_rate_limited_per_source(tmp_path):
    """A burst of 3 then 1 per second: the fourth Register from the same address is refused with
    RESOURCE_EXHAUSTED and counted, and allowed again once the bucket refills."""
    limit = RateLimit(rate_per_s=1.0, burst=3.0)

    async def main():
        async with coordinator(tmp_path, register_limit=limit, checkin_limit=limit) as c:
            codes = [(await c.register(provisioned_request(c.service, f"d{i}")))[0] for i in range(4)]
            c.clock.now += 1.0
            code, _, reply = await c.register(provisioned_request(c.service, "d4", now=c.clock.now))
            codes.append(code)
            checkins = []
            for _ in range(4):
                try:
                    await c.stub.CheckIn(coordinator_pb2.CheckInRequest(), metadata=bearer_metadata(reply.token),
                                         timeout=10)
                    checkins.append(grpc.StatusCode.OK)
                except grpc.aio.AioRpcError as exc:
                    checkins.append(exc.code())
            return codes, checkins, c.refusals("rate_limited"), c.refusals("rate_limited", "CheckIn")

    codes, checkins, register_refused, checkin_refused = run(main())
    ok, exhausted = grpc.StatusCode.OK, grpc.StatusCode.RESOURCE_EXHAUSTED
    assert codes == [ok, ok, ok, exhausted, ok]
    assert checkins == [ok, ok, ok, exhausted]
    assert (register_refused, checkin_refused) == (1, 1)


@settings(max_examples=200, deadline=None)
@given(
    rate=st.floats(0.5, 50), burst=st.integers(1, 20),
    gaps=st.lists(st.floats(0, 2), min_size=1, max_size=200),
)
def test_a_source_never_gets_more_than_burst_plus_rate_times_elapsed(rate, burst, gaps):
    now = [0.0]
    limiter = SourceRateLimiter(RateLimit(rate, burst), lambda: now[0])
    allowed = []
    for gap in gaps:
        now[0] += gap
        if limiter.allow("ipv4:10.0.0.1"):
            allowed.append(now[0])
    for i, start in enumerate(allowed):
        for j in range(i, len(allowed)):
            assert j - i + 1 <= burst + rate * (allowed[j] - start) + 1e-6
    # Another source has its own bucket.
    assert limiter.allow("ipv4:10.0.0.2")


def test_coordinator_cli_takes_rate_limits_and_names_a_bad_one(capsys):
    parser = argparse.ArgumentParser(prog="tally")
    coordinator_cli.register(parser.add_subparsers())
    args = parser.parse_args(["coordinator", "--state-dir", "s", "--register-limit", "5/10"])
    assert args.register_limit == RateLimit(5.0, 10.0) and args.checkin_limit.burst >= 1
    with pytest.raises(SystemExit):
        parser.parse_args(["coordinator", "--state-dir", "s", "--checkin-limit", "0/10"])
    assert "--checkin-limit" in capsys.readouterr().err


def test_the_source_table_is_bounded():
    now = [0.0]
    limiter = SourceRateLimiter(RateLimit(1.0, 5.0), lambda: now[0], max_sources=3)
    assert all(limiter.allow(f"ipv4:10.0.0.{i}") for i in range(3))
    assert not limiter.allow("ipv4:10.0.0.9")  # a fourth source while three are active
    now[0] += 10.0  # every bucket is full again: forgotten
    assert limiter.allow("ipv4:10.0.0.9")


def test_source_of_drops_the_port():
    assert source_of("ipv4:127.0.0.1:5000") == "ipv4:127.0.0.1"
    assert source_of("ipv6:[::1]:5000") == "ipv6:[::1]"
    assert source_of("unix:/tmp/s") == "unix:/tmp/s"


@settings(max_examples=100, deadline=None)
@given(a=st.tuples(st.text(min_size=1, max_size=20), st.text(min_size=1, max_size=20)),
       b=st.tuples(st.text(min_size=1, max_size=20), st.text(min_size=1, max_size=20)))
def test_a_credential_admits_only_its_own_device_and_population(a, b):
    enrolment = SharedKeyEnrolment(b"k" * 32)
    identity = bytes(32)
    credential = enrolment.credential(*a)
    enrolment.admit(EnrolmentClaim(a[1], a[0], identity, credential, ""))
    if a != b:
        with pytest.raises(Exception, match="not valid"):
            enrolment.admit(EnrolmentClaim(b[1], b[0], identity, credential, ""))


def test_tally_enrol_prints_credentials_a_device_registers_with(tmp_path, capsys):
    parser = argparse.ArgumentParser(prog="tally")
    enrol_cli.register(parser.add_subparsers())
    state = tmp_path / "state"
    load_or_create_enrolment_key(state)
    args = parser.parse_args(["enrol", "--key", str(state / "enrolment.key"), "--population", "p", "phone-1"])
    assert args.run(args) == 0
    line = json.loads(capsys.readouterr().out)
    assert line["device_id"] == "phone-1" and line["population"] == "p"
    identity = load_or_create_identity(tmp_path / "phone-1.identity")
    assert oct((tmp_path / "phone-1.identity").stat().st_mode & 0o777) == "0o600"

    async def main():
        async with coordinator(tmp_path) as c:
            request = register_request(identity, "phone-1", "p", bytes.fromhex(line["credential"]), c.clock.now)
            return (await c.register(request))[0]

    assert run(main()) == grpc.StatusCode.OK
    missing = parser.parse_args(["enrol", "--key", str(tmp_path / "nope"), "d"])
    assert missing.run(missing) == 2
    assert "--key" in capsys.readouterr().err


def test_the_coordinator_state_is_private(tmp_path):
    async def main():
        async with coordinator(tmp_path) as c:
            await c.register(provisioned_request(c.service, "d1"))

    run(main())
    state = tmp_path / "state"
    assert state.stat().st_mode & 0o777 == 0o700
    for path in state.rglob("*"):
        expected = 0o700 if path.is_dir() else 0o600
        if path.name == "ticket.pub":
            expected = 0o644  # the aggregators' copy of the ticket key: public by design
        assert path.stat().st_mode & 0o777 == expected, path


def with_fields(request: coordinator_pb2.RegisterRequest, **fields) -> coordinator_pb2.RegisterRequest:
    copy = coordinator_pb2.RegisterRequest()
    copy.CopyFrom(request)
    for name, value in fields.items():
        setattr(copy, name, value)
    return copy


def test_revoking_one_device_refuses_it_everywhere_and_touches_no_other(tmp_path, capsys):
    """Issue 23, finding 9: devices share no secret, so one can be revoked alone (`tally device
    revoke`, the Admin API over TLS): its unexpired token no longer checks in, its own key no
    longer registers, and the other device goes on; the revocation survives a restart."""
    keys = {d: SigningKey.generate() for d in ("d1", "d2")}

    async def checkin(c: Coordinator, token: str) -> grpc.StatusCode:
        try:
            await c.stub.CheckIn(coordinator_pb2.CheckInRequest(), metadata=bearer_metadata(token), timeout=10)
        except grpc.aio.AioRpcError as exc:
            return exc.code()
        return grpc.StatusCode.OK

    def revoke(c: Coordinator, device: str) -> int:
        return tally(["device", "revoke", device, "--coordinator", f"localhost:{c.service.port}",
                      "--state-dir", str(tmp_path / "state"), "--tls-dir", str(tmp_path / "pki" / "device"), "--json"])

    async def main():
        async with coordinator(tmp_path) as c:
            tokens = {}
            for device, key in keys.items():
                _, _, reply = await c.register(provisioned_request(c.service, device, identity=key))
                tokens[device] = reply.token
            revoked = await asyncio.to_thread(revoke, c, "d1")
            unknown = await asyncio.to_thread(revoke, c, "never-enrolled")
            codes = {d: await checkin(c, t) for d, t in tokens.items()}
            again = await c.register(provisioned_request(c.service, "d1", identity=keys["d1"], now=time.time() + 1))
            refusals = c.refusals("revoked", "CheckIn"), c.refusals("revoked")
        async with coordinator(tmp_path) as restarted:
            after_restart = await checkin(restarted, tokens["d1"]), await checkin(restarted, tokens["d2"])
        return revoked, unknown, codes, again, refusals, after_restart

    revoked, unknown, codes, again, refusals, after_restart = run(main())
    out, err = capsys.readouterr()
    first, second = (json.loads(line) for line in out.splitlines())
    assert revoked == 0 and first == {"device_id": "d1", "revoked": True}
    assert unknown == 1 and second == {"error": "NOT_FOUND", "message": "no enrolled device 'never-enrolled'"}
    assert "NOT_FOUND" not in err  # with --json the error is said once, as JSON (err may hold log lines)
    assert codes == {"d1": grpc.StatusCode.PERMISSION_DENIED, "d2": grpc.StatusCode.OK}
    assert again[0] == grpc.StatusCode.PERMISSION_DENIED and "revoked" in again[1]
    assert refusals == (1, 1)
    assert after_restart == (grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.OK)


class _LoseTheFirstRegisterAnswer(grpc.GenericRpcHandler):
    """A plaintext loopback relay to the coordinator that passes the first Register on and then
    tells the device UNAVAILABLE: the coordinator has recorded a registration whose answer the
    device never saw, as when a reply is lost on the way or comes after the device's deadline."""

    def __init__(self, channel: grpc.aio.Channel) -> None:
        self.channel, self.lost = channel, 0

    def service(self, details: grpc.HandlerCallDetails):
        method = details.method

        async def relay(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
            carried = [(k, v) for k, v in context.invocation_metadata() if k == "authorization"]
            try:
                reply = await self.channel.unary_unary(method)(request, metadata=carried, timeout=10)
            except grpc.aio.AioRpcError as refused:
                await context.abort(refused.code(), refused.details() or "")
            if method.endswith("/Register") and not self.lost:
                self.lost += 1
                await context.abort(grpc.StatusCode.UNAVAILABLE, "the answer was lost")
            return reply

        return grpc.unary_unary_rpc_method_handler(relay)


def test_a_registration_whose_answer_was_lost_is_retried_as_a_new_statement(tmp_path):
    """Retrying the same signed statement would be refused as a replay (the coordinator took the
    first one): the device signs a new one per attempt, and goes on to its authenticated call."""
    from tally.client.device import Device
    from tally.client.retry import RetryPolicy

    async def main():
        async with coordinator(tmp_path) as c:
            upstream = open_aio_channel(f"localhost:{c.service.port}",
                                        TLSConfig.from_dir(tmp_path / "pki" / "device", None))
            relay = _LoseTheFirstRegisterAnswer(upstream)
            server = grpc.aio.server()
            server.add_generic_rpc_handlers((relay,))
            port = server.add_insecure_port("127.0.0.1:0")
            await server.start()
            credential = SharedKeyEnrolment(c.service.enrolment_key).credential("default", "d1")
            device = Device(f"127.0.0.1:{port}", TLSConfig.plaintext(), "d1", None, enrolment_credential=credential,
                            retry=RetryPolicy(initial_seconds=0.01, max_seconds=0.05))
            try:
                with pytest.raises(grpc.aio.AioRpcError) as answer:
                    await device.round_status("no-such-job")
            finally:
                await server.stop(0)
                await upstream.close()
            return relay.lost, answer.value.code(), c.refusals("replay")

    lost, code, replays = run(main())
    assert lost == 1
    assert code == grpc.StatusCode.NOT_FOUND  # registered, and the call itself reached the coordinator
    assert replays == 0
