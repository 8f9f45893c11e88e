"""The secure-aggregator service over real gRPC and real TLS on 127.0.0.1.

The test plays the coordinator (signs tickets, opens sessions, awaits sums) and the devices (a
small asyncio pump around ``SecAggClient`` per device stream). Dropouts are devices that cancel
their stream when a given phase's request arrives.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import re
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import grpc
import pytest
from cryptography.hazmat.primitives.asymmetric import ed25519
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from support.aggregator import (
    CODE,
    OWNER_TOKENS,
    SCHEMAS,
    THREAT,
    DeviceRun,
    assert_sum,
    await_sum,
    connected,
    deadlines,
    device,
    join,
    misbehave,
    plan,
    rpc_error,
    run,
    scrape,
    sign,
    until_not_found,
)
from support.secagg import roster
from support.stack import in_process
from tally.aggregator import AggregatorService
from tally.aggregator.admission import admit
from tally.aggregator.errors import Rejected
from tally.aggregator.metrics import AggregatorMetrics
from tally.aggregator.session import Session
from tally.cli.aggregator import register
from tally.client.session import CORRUPT_MESSAGE
from tally.codec import Field, Kind, PayloadSchema, packed_size
from tally.ops.cluster import ProcessCluster
from tally.secagg import SessionConfig
from tally.secagg.messages import (
    AdvertiseKeys,
    MaskedInputResponse,
    SessionAborted,
    SumPublicKeys,
)
from tally.security import (
    SessionTicket,
    TicketSigner,
    TicketVerifier,
    TLSConfig,
    config_digest,
    owner_metadata,
)
from tally.security.certs import write_deployment, write_file_atomic
from tally.security.tls import open_aio_channel
from tally.security.tokens import load_or_create_ticket_key
from tally.wire.chunks import split_masked_input
from tally.wire.join import join_metadata
from tally.wire.protocol import session_config_bytes
from tally.wire.sums import schema_to_proto
from tally.wire.v1 import aggregator_pb2, aggregator_pb2_grpc, secagg_pb2

# ---- tests -------------------------------------------------------------------------------------


def test_a_session_sums_exactly_the_survivors_of_dropouts_in_every_phase(deployment):
    async def scenario():
        async with in_process().aggregator_alone(deployment) as service, connected(deployment, service) as (ch, stub):
            cohort = plan(deployment, "s-dropouts")
            opened = await stub.OpenSession(cohort.request)
            assert opened.session_id == "s-dropouts"
            assert opened.address == f"127.0.0.1:{service.port}"
            drops = {8: ("advertise_keys", ""), 7: ("share_keys", ""),
                     6: ("masked_input", "update"), 5: ("unmask", "update"),
                     4: ("unmask", "count")}
            runs = await asyncio.gather(
                *(device(ch, cohort, i, drops.get(i)) for i in range(1, 9)),
                await_sum(stub, cohort, "update"), await_sum(stub, cohort, "count"),
            )
            devices, (_, update), (_, count) = runs[:8], runs[8], runs[9]
            assert_sum(cohort, "update", update, [1, 2, 3, 4, 5], [6])
            assert_sum(cohort, "count", count, [1, 2, 3, 4], [5, 6])
            assert [d.outcome for d in devices] == ["done"] * 3 + ["dropped"] * 5
            assert all(d.code == CODE.OK for d in devices[:3])
            metrics = scrape(service.metrics_port)
            assert metrics['tally_aggregator_sessions_finished_total{outcome="completed"}'] == 1
            assert metrics['tally_aggregator_dropouts_total{phase="advertise_keys"}'] == 1
            assert metrics['tally_aggregator_dropouts_total{phase="share_keys"}'] == 1
            assert metrics['tally_aggregator_dropouts_total{phase="masked_input"}'] == 2
            assert metrics["tally_aggregator_late_messages_total"] >= 1
            assert metrics["tally_aggregator_active_sessions"] == 0

    run(scenario)


def _bad_chunks(spoil: Callable[[list], None]) -> Callable[[Any], list]:
    """A ``split`` that chunks masked inputs into 16 bytes and then lets ``spoil`` break them (the
    last chunk, so that no write races the aggregator's end of the stream)."""
    def split(envelope):
        parts = split_masked_input(envelope, chunk_bytes=16)
        if len(parts) > 1:
            spoil(parts)
        return parts
    return split


def _one_chunk_too_many(parts: list) -> None:
    last = parts[-1].masked_input_response
    last.more = True
    parts.append(secagg_pb2.DeviceToAggregator(masked_input_response=secagg_pb2.MaskedInputResponse(
        ref=last.ref, sum_id=last.sum_id, sender=last.sender, data=b"\0" * 16,
        offset=last.offset + len(last.data))))


def test_bytes_that_are_no_message_end_the_stream_with_a_clear_status(deployment):
    """A device that sends garbage after joining (issue 8's campaign: corrupt messages) is refused
    with INVALID_ARGUMENT naming what was wrong; nothing else is affected. (Before joining nothing
    it sends is read: ``test_aggregator_attacks``.)"""
    async def scenario():
        async with in_process().aggregator_alone(deployment) as service, connected(deployment, service) as (ch, stub):
            cohort = plan(deployment, "s-corrupt")
            await stub.OpenSession(cohort.request)
            raw = ch.stream_stream("/tally.v1.SecureAggregation/Session", request_serializer=lambda data: data,
                                   response_deserializer=secagg_pb2.AggregatorToDevice.FromString)
            outcomes = []
            for index in (1, 2):
                call = raw(metadata=join_metadata(join(cohort, index)))
                for data in [CORRUPT_MESSAGE] * index:
                    await call.write(data)
                await call.done_writing()
                with contextlib.suppress(grpc.aio.AioRpcError):
                    while await call.read() is not grpc.aio.EOF:
                        pass
                outcomes.append((await call.code(), await call.details()))
            rejected = service.metrics.rejected.labels(reason="malformed", status="INVALID_ARGUMENT")._value.get()
            return outcomes, rejected

    outcomes, rejected = asyncio.run(scenario())
    assert [code for code, _ in outcomes] == [CODE.INVALID_ARGUMENT] * 2, outcomes
    assert all("not a DeviceToAggregator" in details for _, details in outcomes)
    assert rejected == 2


def test_masked_inputs_travel_in_chunks_and_bad_chunks_end_only_their_stream(deployment):
    """Issue 12, finding 10: masked inputs arrive in chunks, so the device port's receive limit
    (4 MiB by default) is far below the largest vector; a bigger message is refused, and a device
    whose chunks are out of order, of another sum or too many loses its own stream only."""
    async def scenario():
        async with in_process().aggregator_alone(deployment) as service, connected(deployment, service) as (ch, stub):
            cohort = plan(deployment, "s-chunks")
            await stub.OpenSession(cohort.request)
            huge = secagg_pb2.DeviceToAggregator(masked_input_response=secagg_pb2.MaskedInputResponse(
                sum_id="update", sender=8, data=bytes(5 << 20)))
            code, message = await misbehave(ch, join(cohort, 8), huge)
            assert code == CODE.RESOURCE_EXHAUSTED, message
            update_spec = cohort.config.sum_spec("update")
            assert packed_size(update_spec.dim, update_spec.wire_bits) > 16  # several chunks

            def gap(parts):
                parts[-1].masked_input_response.offset += 1

            def other_sum(parts):
                parts[-1].masked_input_response.sum_id = "count"

            spoilt = {5: gap, 6: other_sum, 7: _one_chunk_too_many}  # 8 sent the huge message
            runs = await asyncio.gather(
                *(device(ch, cohort, i, split=partial(split_masked_input, chunk_bytes=7))
                  for i in range(1, 5)),
                *(device(ch, cohort, i, split=_bad_chunks(spoil)) for i, spoil in spoilt.items()),
                await_sum(stub, cohort, "update"), await_sum(stub, cohort, "count"),
            )
            devices, (_, update), (_, count) = runs[:7], runs[7], runs[8]
            assert_sum(cohort, "update", update, [1, 2, 3, 4], [5, 6, 7])  # 8 left before its keys
            assert_sum(cohort, "count", count, [1, 2, 3, 4], [5, 6, 7])
            assert [d.outcome for d in devices] == ["done"] * 4 + ["error"] * 3
            assert {d.code for d in devices[4:]} == {CODE.INVALID_ARGUMENT}
            assert re.search(r"chunk at offset (\d+), expected (?!\1)\d+", devices[4].detail)
            assert "chunk for sum 'count' arrived before the last chunk" in devices[5].detail
            assert "larger than its" in devices[6].detail
            metrics = scrape(service.metrics_port)
            assert metrics['tally_aggregator_rejected_total{reason="malformed",'
                           'status="INVALID_ARGUMENT"}'] == 3

    run(scenario)


def test_the_control_api_can_have_a_port_of_its_own(deployment):
    """With --control-listen, devices' port serves no control API and the control port no device
    streams; only the control port takes messages above the 4 MiB request cap (a very large
    cohort's OpenSession), and a session runs across the two."""
    async def scenario():
        async with in_process().aggregator_alone(deployment, control_listen="127.0.0.1:0") as service:
            assert service.control_port != service.port
            big = aggregator_pb2.OpenSessionRequest(session_ticket=b"\0" * (5 << 20))
            async with connected(deployment, service) as (device_channel, on_device_port):
                code, _ = await rpc_error(on_device_port.OpenSession(big))
                assert code == CODE.UNIMPLEMENTED
                async with deployment.channel(f"127.0.0.1:{service.control_port}") as control:
                    stub = aggregator_pb2_grpc.AggregatorControlStub(control)
                    code, message = await rpc_error(stub.OpenSession(big))
                    assert code == CODE.PERMISSION_DENIED, message  # read whole, then refused
                    code, _ = await misbehave(control, join(plan(deployment, "unused"), 1))
                    assert code == CODE.UNIMPLEMENTED
                    cohort = plan(deployment, "s-split")
                    opened = await stub.OpenSession(cohort.request)
                    assert opened.address == f"127.0.0.1:{service.port}"
                    runs = await asyncio.gather(
                        *(device(device_channel, cohort, i) for i in range(1, 9)),
                        await_sum(stub, cohort, "update"))
            assert_sum(cohort, "update", runs[-1][1], list(range(1, 9)))

    run(scenario)


def test_bad_tickets_and_bad_devices_get_clear_statuses_and_the_session_still_completes(
        deployment):
    async def scenario():
        async with in_process().aggregator_alone(deployment) as service, connected(deployment, service) as (ch, stub):
            cohort = plan(deployment, "s-bad", phase_seconds={"advertise_keys": 3.0})
            config = cohort.config

            async def refused(ticket: bytes, **changes) -> tuple[grpc.StatusCode, str]:
                request = aggregator_pb2.OpenSessionRequest()
                request.CopyFrom(cohort.request)
                request.session_ticket = ticket
                for name, value in changes.items():
                    getattr(request, name).CopyFrom(value)
                return await rpc_error(stub.OpenSession(request))

            forged = TicketSigner(ed25519.Ed25519PrivateKey.generate())
            ticket = dict(job_id="job-1", round=3, session_id="s-bad",
                          sum_ids=("update", "count"), cohort_size=8,
                          config_digest=config_digest(session_config_bytes(config)),
                          aggregator_id="agg-a", expires_at=time.time() + 60)
            other = SessionConfig.plan(config.ref, list(SCHEMAS.items()), 8, THREAT, identities=roster(8))
            assert await refused(forged.sign(SessionTicket(**ticket))) == (
                CODE.PERMISSION_DENIED, "session ticket signature invalid")
            assert await refused(sign(deployment, config, expires_in=-1)) == (
                CODE.PERMISSION_DENIED, "session ticket expired")
            assert await refused(sign(deployment, config, aggregator_id="agg-b")) == (
                CODE.PERMISSION_DENIED, "session ticket is for another aggregator")
            code, message = await refused(sign(deployment, other))
            assert code == CODE.PERMISSION_DENIED and "config digest" in message
            code, message = await refused(sign(deployment, config, session_id="s-other"))
            assert code == CODE.PERMISSION_DENIED and "session_id 's-other'" in message
            wrong_dim = schema_to_proto("update", PayloadSchema((Field("w", (41,), Kind.COUNT,
                                                                       clip=1000),)))
            request = aggregator_pb2.OpenSessionRequest()
            request.CopyFrom(cohort.request)
            request.schemas[0].CopyFrom(wrong_dim)
            code, message = await rpc_error(stub.OpenSession(request))
            assert code == CODE.INVALID_ARGUMENT and "41 values" in message
            code, message = await refused(cohort.ticket, deadlines=deadlines(0.0))
            assert code == CODE.INVALID_ARGUMENT and "advertise_keys_seconds" in message

            await stub.OpenSession(cohort.request)
            code, message = await rpc_error(stub.OpenSession(cohort.request))
            assert code == CODE.ALREADY_EXISTS and "s-bad" in message

            # Joins that fail, before the honest devices start.
            assert await misbehave(ch, join(cohort, 2, token="guess")) == (
                CODE.UNAUTHENTICATED, "session token is not valid for device 2")
            code, message = await misbehave(ch, join(cohort, 2, ticket=sign(
                deployment, other, session_id="s-unknown")))
            assert code == CODE.NOT_FOUND and "s-unknown" in message
            code, _ = await misbehave(ch, join(cohort, 2, ticket=forged.sign(
                SessionTicket(**ticket))))
            assert code == CODE.PERMISSION_DENIED
            code, message = await misbehave(ch, AdvertiseKeys(config.ref, 2, (), bytes(64)))
            assert code == CODE.UNAUTHENTICATED and "Join in its 'tally-join-bin' metadata" in message
            # Devices 6, 7 and 8 join and misbehave: each loses its own stream only.
            malformed = secagg_pb2.DeviceToAggregator(
                advertise_keys=secagg_pb2.AdvertiseKeys(sender=6))
            code, message = await misbehave(ch, join(cohort, 6), malformed)
            assert code == CODE.INVALID_ARGUMENT and "AdvertiseKeys.ref is missing" in message
            keys = tuple(SumPublicKeys(s.sum_id, bytes(32), bytes(32), bytes(32)) for s in config.sums)
            assert await misbehave(ch, join(cohort, 7), AdvertiseKeys(config.ref, 1, keys, bytes(64))) == (
                CODE.PERMISSION_DENIED, "device 7 cannot send as device 1")
            code, message = await misbehave(
                ch, join(cohort, 8), MaskedInputResponse(config.ref, "update", 8, b"\0" * 8))
            assert code == CODE.FAILED_PRECONDITION
            assert "MaskedInputResponse received while the session is in advertise_keys" in message

            first = DeviceRun()
            honest = [asyncio.ensure_future(device(ch, cohort, 1, seen=first))]
            await asyncio.wait_for(first.joined.wait(), 10)
            code, message = await misbehave(ch, join(cohort, 1))
            assert code == CODE.ALREADY_EXISTS and "device 1 already joined" in message
            honest += [asyncio.ensure_future(device(ch, cohort, i)) for i in range(2, 6)]
            (_, update), (_, count) = await asyncio.gather(
                await_sum(stub, cohort, "update"), await_sum(stub, cohort, "count"))
            assert_sum(cohort, "update", update, [1, 2, 3, 4, 5])
            assert_sum(cohort, "count", count, [1, 2, 3, 4, 5])
            assert [d.outcome for d in await asyncio.gather(*honest)] == ["done"] * 5
            metrics = scrape(service.metrics_port)
            assert metrics['tally_aggregator_rejected_total{reason="wrong_sender",'
                           'status="PERMISSION_DENIED"}'] == 1
            assert metrics['tally_aggregator_rejected_total{reason="out_of_phase",'
                           'status="FAILED_PRECONDITION"}'] == 1

    run(scenario)


def test_control_calls_need_the_owner_token_the_session_was_opened_with(deployment):
    """Attack 2: every cohort member holds the session ticket (and its own session token), so
    neither lets a caller await or close a session; only the coordinator's owner token does."""

    async def scenario():
        async with in_process().aggregator_alone(deployment) as service, connected(deployment, service) as (ch, stub):
            mine, theirs = plan(deployment, "s-mine", seconds=0.3), plan(deployment, "s-theirs")
            await stub.OpenSession(mine.request)
            await stub.OpenSession(theirs.request)
            never_opened = plan(deployment, "s-never")

            def await_mine(metadata=()):
                return stub.AwaitResult(aggregator_pb2.AwaitResultRequest(
                    session_id="s-mine", sum_id="update"), metadata=metadata, timeout=10)

            def close(session_id: str, metadata=()):
                return stub.CloseSession(aggregator_pb2.CloseSessionRequest(
                    session_id=session_id, reason="test"), metadata=metadata, timeout=10)

            missing = (CODE.UNAUTHENTICATED,
                       "control calls need the session's owner token (32 bytes in tally-owner-token-bin)")
            assert await rpc_error(await_mine()) == missing
            assert await rpc_error(close("s-mine")) == missing
            # Unauthenticated callers cannot tell open sessions from unknown ones.
            assert await rpc_error(close("s-never")) == missing
            # What a device holds: the ticket (where the old API wanted it, or as the token) and
            # its session token.
            device_ticket = (("tally-session-ticket-bin", mine.ticket),)
            assert await rpc_error(await_mine(device_ticket)) == missing
            assert await rpc_error(close("s-mine", owner_metadata(mine.ticket))) == missing
            device_token = owner_metadata(hashlib.sha256(mine.tokens[1].encode()).digest())
            not_owner = (CODE.PERMISSION_DENIED,
                         "not the owner of session 's-mine': only the coordinator that opened it may "
                         "await or close it")
            assert await rpc_error(close("s-mine", device_token)) == not_owner
            assert await rpc_error(await_mine(theirs.owner_md)) == not_owner
            code, _ = await rpc_error(stub.AwaitResult(aggregator_pb2.AwaitResultRequest(
                session_id="s-never", sum_id="update"), metadata=never_opened.owner_md))
            assert code == CODE.NOT_FOUND
            # Closing stays idempotent for the owner.
            await close("s-never", never_opened.owner_md)

            # None of the refusals touched the sessions; the right tokens work.
            reply, _ = await await_sum(stub, mine, "update")
            assert "advertise_keys: 0 devices answered" in reply.aborted_reason
            await close("s-theirs", theirs.owner_md)
            code, _ = await rpc_error(stub.AwaitResult(aggregator_pb2.AwaitResultRequest(
                session_id="s-theirs", sum_id="update"), metadata=theirs.owner_md))
            assert code == CODE.NOT_FOUND
            await close("s-mine", mine.owner_md)
            await close("s-mine", mine.owner_md)
            metrics = scrape(service.metrics_port)
            assert metrics['tally_aggregator_rejected_total{reason="not_owner",'
                           'status="UNAUTHENTICATED"}'] == 5
            assert metrics['tally_aggregator_rejected_total{reason="not_owner",'
                           'status="PERMISSION_DENIED"}'] == 2

    run(scenario)


def test_a_session_nobody_joins_aborts_at_its_deadline(deployment):
    async def scenario():
        async with in_process().aggregator_alone(deployment) as service, connected(deployment, service) as (ch, stub):
            cohort = plan(deployment, "s-empty", seconds=0.3)
            await stub.OpenSession(cohort.request)
            reply, result = await await_sum(stub, cohort, "count", timeout=10)
            assert reply.aborted_reason == result.reason
            assert "advertise_keys: 0 devices answered" in reply.aborted_reason
            assert reply.total == b"" and not reply.contributors
            code, message = await misbehave(ch, join(cohort, 1))
            assert code == CODE.FAILED_PRECONDITION and "is over" in message
            metrics = scrape(service.metrics_port)
            assert metrics['tally_aggregator_sessions_finished_total{outcome="aborted"}'] == 1
            assert metrics['tally_aggregator_dropouts_total{phase="advertise_keys"}'] == 8

    run(scenario)


def test_two_aggregators_run_sessions_at_once_with_metrics_health_and_reflection(deployment):
    async def session_on(service: AggregatorService, session_id: str) -> None:
        async with connected(deployment, service) as (ch, stub):
            cohort = plan(deployment, session_id, aggregator_id=service.id)
            await stub.OpenSession(cohort.request)
            runs = await asyncio.gather(*(device(ch, cohort, i) for i in range(1, 9)))
            assert [r.outcome for r in runs] == ["done"] * 8
            for sum_id in SCHEMAS:
                _, result = await await_sum(stub, cohort, sum_id)
                assert_sum(cohort, sum_id, result, range(1, 9))
            await stub.CloseSession(aggregator_pb2.CloseSessionRequest(
                session_id=session_id, reason="round committed"),
                metadata=cohort.owner_md)
            code, _ = await rpc_error(stub.AwaitResult(aggregator_pb2.AwaitResultRequest(
                session_id=session_id, sum_id="update"), metadata=cohort.owner_md))
            assert code == CODE.NOT_FOUND

    async def scenario():
        async with in_process().aggregator_alone(deployment, "agg-a") as a, \
                in_process().aggregator_alone(deployment, "agg-b") as b:
            await asyncio.gather(session_on(a, "s-a"), session_on(b, "s-b"))
            for service in (a, b):
                metrics = await asyncio.to_thread(scrape, service.metrics_port)
                assert metrics["tally_aggregator_sessions_opened_total"] == 1
                assert metrics['tally_aggregator_sessions_finished_total{outcome="completed"}'] == 1
                assert metrics["tally_aggregator_received_bytes_total"] > 0
                assert metrics["tally_aggregator_late_messages_total"] > 0
                assert metrics["tally_aggregator_unmask_seconds_count"] == 2
                assert metrics['tally_aggregator_phase_duration_seconds_count{phase="unmask"}'] == 2
                assert metrics['tally_aggregator_phase_devices_sum{phase="advertise_keys"}'] == 8
                async with deployment.channel(f"127.0.0.1:{service.port}") as channel:
                    check = await health_pb2_grpc.HealthStub(channel).Check(
                        health_pb2.HealthCheckRequest(service="tally.v1.SecureAggregation"))
                    assert check.status == health_pb2.HealthCheckResponse.SERVING
                    call = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo()
                    await call.write(reflection_pb2.ServerReflectionRequest(list_services=""))
                    reply = await call.read()
                    await call.done_writing()
                    names = {s.name for s in reply.list_services_response.service}
                    assert {"tally.v1.AggregatorControl", "tally.v1.SecureAggregation",
                            "grpc.health.v1.Health"} <= names

    run(scenario)


def test_close_session_aborts_its_devices_and_keeps_nothing(deployment):
    async def scenario():
        async with in_process().aggregator_alone(deployment, result_ttl_s=0.2) as service, \
                connected(deployment, service) as (ch, stub):
            cohort = plan(deployment, "s-close", seconds=5.0)
            await stub.OpenSession(cohort.request)
            seen = [DeviceRun(), DeviceRun()]
            devices = [asyncio.ensure_future(device(ch, cohort, i + 1, seen=s))
                       for i, s in enumerate(seen)]
            await asyncio.gather(*(s.joined.wait() for s in seen))
            await stub.CloseSession(aggregator_pb2.CloseSessionRequest(
                session_id="s-close", reason="round cancelled"),
                metadata=cohort.owner_md)
            for run_ in await asyncio.gather(*devices):
                assert run_.outcome == "aborted" and "round cancelled" in run_.detail
                assert run_.code == CODE.OK
            code, _ = await rpc_error(stub.AwaitResult(aggregator_pb2.AwaitResultRequest(
                session_id="s-close", sum_id="update"), metadata=cohort.owner_md))
            assert code == CODE.NOT_FOUND
            # Closing again is harmless; an unclosed finished session expires after the TTL.
            await stub.CloseSession(aggregator_pb2.CloseSessionRequest(session_id="s-close"),
                                    metadata=cohort.owner_md)
            expiring = plan(deployment, "s-expire", seconds=0.1)
            await stub.OpenSession(expiring.request)
            reply, _ = await await_sum(stub, expiring, "update")
            assert reply.aborted_reason
            await until_not_found(stub, expiring)
            metrics = scrape(service.metrics_port)
            assert metrics['tally_aggregator_sessions_finished_total{outcome="closed"}'] == 1

    run(scenario)


def test_closing_a_session_resolves_its_pending_results_with_the_reason(deployment):
    async def scenario():
        cohort = plan(deployment, "s-unit")
        admitted = admit(cohort.request, TicketVerifier(deployment.public_key), "agg-a",
                         time.time())
        finished = []
        session = Session(admitted, AggregatorMetrics(), finished.append)
        session.start()
        pending = session.result("update")
        session.close("round cancelled")
        assert await asyncio.wait_for(pending, 5) == SessionAborted(
            "session closed: round cancelled")
        assert finished == [session] and session.outcome == "closed"
        with pytest.raises(Rejected) as err:
            session.result("nope")
        assert err.value.status == "NOT_FOUND"

    run(scenario)


def test_stopping_the_aggregator_aborts_running_sessions_for_their_devices(deployment):
    async def scenario():
        async with in_process().aggregator_alone(deployment) as service, connected(deployment, service) as (ch, stub):
            cohort = plan(deployment, "s-stop", seconds=10.0)
            await stub.OpenSession(cohort.request)
            seen = DeviceRun()
            joined = asyncio.ensure_future(device(ch, cohort, 1, seen=seen))
            await asyncio.wait_for(seen.joined.wait(), 10)
            await service.stop(5)
            result = await joined
            assert result.outcome == "aborted" and "shutting down" in result.detail
            assert result.code == CODE.OK

    run(scenario)


def test_cli_serves_until_sigterm_and_stops_gracefully(tmp_path):
    """``tally aggregator`` with a --tls-dir: ticket.pub is found there, health answers over TLS,
    SIGTERM ends it with status 0."""

    async def scenario() -> None:
        async with ProcessCluster(tmp_path, aggregators=1, replicas=0) as cluster:
            aggregator = cluster.processes["aggregator-1"]
            async with open_aio_channel(f"127.0.0.1:{cluster.ports['aggregator-1']}",
                                        cluster.tls) as channel:
                reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(),
                                                                        timeout=10)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
            await aggregator.stop()  # SIGTERM
            assert aggregator.exit_code() == 0, (tmp_path / "logs" / "aggregator-1.log").read_text()

    run(scenario)


def test_cli_refuses_to_start_without_a_ticket_key(capsys):
    parser = argparse.ArgumentParser(prog="tally")
    register(parser.add_subparsers())
    args = parser.parse_args(["aggregator", "--listen", "127.0.0.1:0", "--id", "a", "--insecure"])
    assert args.run(args) == 2
    assert "--ticket-public-key is required" in capsys.readouterr().err
    help_text = parser.format_help() + parser._subparsers._group_actions[0].choices[
        "aggregator"].format_help()
    for flag in ("--listen", "--id", "--advertise", "--ticket-public-key", "--tls-dir",
                 "--insecure", "--metrics-port", "--metrics-addr"):
        assert flag in help_text


def test_the_coordinator_follows_a_certificate_rotation_without_a_restart(tmp_path):
    """Issue 7: certificates are renewed in place (cert-manager rewrites the mounted Secrets).
    Here even the CA rotates: the aggregator serves the new files from its next handshake, and
    the coordinator's pool reconnects with its renewed client certificate at its next health
    check, so an aggregator restarted after the rotation is reachable at once."""
    from tally.coordinator.rounds.aggregators import AggregatorPool

    old, new = tmp_path / "old", tmp_path / "new"
    write_deployment(old)
    write_deployment(new)
    public = load_or_create_ticket_key(old / "coordinator").public_key()
    served = TLSConfig.from_dir(old / "aggregator-1", "aggregator", require_client_auth=True)

    async def scenario():
        async with in_process() as services:
            first = await services.aggregator(served, public, "agg-1", control_listen="127.0.0.1:0")
            port, control = first.port, first.control_port
            pool = AggregatorPool([("agg-1", f"localhost:{control}")],
                                  TLSConfig.from_dir(old / "coordinator", "coordinator"), 1 << 20, OWNER_TOKENS)
            try:
                assert await pool.healthy() == ["agg-1"]
                for role, names in (("aggregator-1", ("ca.pem", "aggregator.pem", "aggregator.key")),
                                    ("coordinator", ("ca.pem", "coordinator.pem", "coordinator.key"))):
                    for name in names:
                        source = new / role / name
                        write_file_atomic(old / role / name, source.read_bytes(), source.stat().st_mode & 0o777)
                await services.stop(first)
                await services.aggregator(served, public, "agg-1", listen=f"127.0.0.1:{port}",
                                          control_listen=f"127.0.0.1:{control}")
                assert await pool.healthy() == ["agg-1"]
            finally:
                await pool.close()

    run(scenario)
