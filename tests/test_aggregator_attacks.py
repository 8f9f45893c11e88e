"""Attacks on the real aggregator over gRPC with TLS (issue 12): a key of small order or wrong
Unmask shares from one device leave the others' sum exact (item 3); under mutual TLS a device's
certificate cannot reach the control API (item 12)."""

from __future__ import annotations

import asyncio
import dataclasses

import grpc
import pytest

from aggregator.errors import Rejected
from aggregator.gate import MAX_JOIN_BYTES, StreamLimits, UnjoinedStreams
from secagg_helpers import identities
from tally.secagg.messages import AdvertiseKeys, UnmaskResponse
from tally.wire.v1 import secagg_pb2
from tally.wire.v1.aggregator_pb2 import AwaitResultRequest, CloseSessionRequest
from tally.secagg.wire import advertise_statement
from test_aggregator import (  # noqa: F401  (deployment is a fixture)
    CODE,
    rpc_error,
    assert_sum,
    await_sum,
    connected,
    deployment,
    device,
    plan,
    run,
    running,
    scrape,
)


def _small_order_key(message):
    if not isinstance(message, AdvertiseKeys):
        return message
    keys = tuple(dataclasses.replace(k, cipher_public=bytes(32)) for k in message.keys)
    signature = identities(8)[message.sender].sign(advertise_statement(message.ref, message.sender, keys))
    return AdvertiseKeys(message.ref, message.sender, keys, signature)


def _zeroed_shares(message):
    if not isinstance(message, UnmaskResponse):
        return message
    return dataclasses.replace(message, seed_shares=bytes(len(message.seed_shares)),
                               key_shares=bytes(len(message.key_shares)))


def test_a_zero_key_excludes_its_sender_and_wrong_shares_are_decoded_around(deployment):
    async def scenario():
        async with running(deployment) as service, connected(deployment, service) as (ch, stub):
            cohort = plan(deployment, "s-attacks")
            await stub.OpenSession(cohort.request)
            tamper = {3: _small_order_key, 2: _zeroed_shares}
            runs = await asyncio.gather(
                *(device(ch, cohort, i, tamper=tamper.get(i, lambda m: m)) for i in range(1, 9)),
                await_sum(stub, cohort, "update"), await_sum(stub, cohort, "count"),
            )
            devices, (_, update), (_, count) = runs[:8], runs[8], runs[9]
            # Device 3's stream is refused with a clear status; nobody else is affected.
            assert devices[2].outcome == "error" and devices[2].code == CODE.INVALID_ARGUMENT
            assert "small order" in devices[2].detail
            others = [1, 2, 4, 5, 6, 7, 8]
            assert_sum(cohort, "update", update, others)
            assert_sum(cohort, "count", count, others)
            assert all(devices[i - 1].outcome == "done" for i in others)
            metrics = scrape(service.metrics_port)
            assert metrics["tally_aggregator_misbehaving_devices_total"] == 1
            assert metrics['tally_aggregator_sessions_finished_total{outcome="completed"}'] == 1

    run(scenario)


def test_under_mutual_tls_the_control_api_admits_only_the_coordinators_certificate(deployment):
    """Attack 12: a device's certificate (valid, same CA) is refused on every AggregatorControl
    call; the coordinator's is admitted; devices still join and the sum is exact."""

    async def scenario():
        async with running(deployment, mutual=True) as service, \
                connected(deployment, service, "coordinator") as (_, control), \
                connected(deployment, service, "device") as (devices, as_device):
            cohort = plan(deployment, "s-mtls")
            refused = (CODE.PERMISSION_DENIED,
                       "AggregatorControl admits only the coordinator's certificate (tally-coordinator), "
                       "not 'tally-device'")
            assert await rpc_error(as_device.OpenSession(cohort.request)) == refused
            await control.OpenSession(cohort.request)
            assert await rpc_error(as_device.AwaitResult(
                AwaitResultRequest(session_id="s-mtls", sum_id="update"), metadata=cohort.owner_md)) == refused
            assert await rpc_error(as_device.CloseSession(
                CloseSessionRequest(session_id="s-mtls"), metadata=cohort.owner_md)) == refused
            runs = await asyncio.gather(
                *(device(devices, cohort, i) for i in range(1, 9)),
                await_sum(control, cohort, "update"),
            )
            assert [r.outcome for r in runs[:8]] == ["done"] * 8
            assert_sum(cohort, "update", runs[8][1], range(1, 9))
            metrics = scrape(service.metrics_port)
            assert metrics['tally_aggregator_rejected_total{reason="not_controller",status="PERMISSION_DENIED"}'] == 3

    run(scenario)


# ---- third review, findings 4 and 5: streams that never join -----------------------------------

SESSION = "/tally.v1.SecureAggregation/Session"


async def _status(call) -> tuple[CODE, str]:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        async for _ in call:
            pass
    return err.value.code(), err.value.details()


def test_a_stream_that_never_joins_is_closed_at_the_join_deadline(deployment):
    async def scenario():
        async with running(deployment, stream_limits=StreamLimits(join_timeout_s=0.5)) as service, \
                connected(deployment, service) as (channel, _):
            code, detail = await _status(channel.stream_stream(SESSION)())
            assert (code, detail) == (CODE.DEADLINE_EXCEEDED, "no Join within 0.5 s of opening the stream")
            metrics = scrape(service.metrics_port)
            assert metrics['tally_aggregator_rejected_total{reason="join_timeout",status="DEADLINE_EXCEEDED"}'] == 1
            assert metrics["tally_aggregator_unjoined_streams"] == 0

    run(scenario)


def test_a_first_message_larger_than_a_join_is_refused_unparsed(deployment):
    """Anyone with a device certificate may open a stream: before its Join is checked, its one
    message may not exceed what a Join needs (bench/stream_memory.py measures what that saves)."""
    message = secagg_pb2.DeviceToAggregator(masked_input_response=secagg_pb2.MaskedInputResponse(
        sum_id="x", sender=1, data=bytes(MAX_JOIN_BYTES)))

    async def scenario():
        async with running(deployment) as service, connected(deployment, service) as (channel, _):
            call = channel.stream_stream(SESSION, request_serializer=secagg_pb2.DeviceToAggregator.SerializeToString)()
            await call.write(message)
            code, detail = await _status(call)
            assert code == CODE.INVALID_ARGUMENT
            assert detail == (f"the first message of a session stream must be a Join of at most {MAX_JOIN_BYTES} "
                              f"bytes, got {message.ByteSize()} bytes")
            metrics = scrape(service.metrics_port)
            assert metrics['tally_aggregator_rejected_total{reason="not_joined",status="INVALID_ARGUMENT"}'] == 1

    run(scenario)


def test_unjoined_streams_are_capped_per_source_and_in_all():
    """The caps hold before anything is read: the stream over the cap is refused at once, and a
    stream that joins or ends makes room again."""
    gate = UnjoinedStreams(StreamLimits(per_source=2, total=3))
    gate.admit("ipv4:10.0.0.1")
    gate.admit("ipv4:10.0.0.1")
    with pytest.raises(Rejected, match="ipv4:10.0.0.1 already holds 2 streams") as err:
        gate.admit("ipv4:10.0.0.1")
    assert (err.value.status, err.value.reason) == ("RESOURCE_EXHAUSTED", "too_many_unjoined_from_source")
    gate.admit("ipv4:10.0.0.2")
    with pytest.raises(Rejected, match="already holds 3 streams") as err:
        gate.admit("ipv4:10.0.0.3")
    assert err.value.reason == "too_many_unjoined"
    gate.release("ipv4:10.0.0.1")
    gate.admit("ipv4:10.0.0.3")
    assert gate.open == 3
    with pytest.raises(ValueError, match="must lie in 1..total"):
        StreamLimits(per_source=5, total=4)


def test_streams_over_the_per_source_cap_are_refused_by_the_service(deployment):
    async def scenario():
        limits = StreamLimits(join_timeout_s=30, per_source=2, total=10)
        async with running(deployment, stream_limits=limits) as service, \
                connected(deployment, service) as (channel, _):
            held = [channel.stream_stream(SESSION)() for _ in range(2)]
            for call in held:
                await call.wait_for_connection()
            while service.metrics.unjoined_streams._value.get() < 2:  # both handlers admitted
                await asyncio.sleep(0.01)
            code, detail = await _status(channel.stream_stream(SESSION)())
            assert code == CODE.RESOURCE_EXHAUSTED and "already holds 2 streams" in detail
            for call in held:
                call.cancel()
            metrics = scrape(service.metrics_port)
            assert metrics['tally_aggregator_rejected_total{reason="too_many_unjoined_from_source",'
                           'status="RESOURCE_EXHAUSTED"}'] == 1

    run(scenario)
