"""Attacks on the real aggregator over gRPC with TLS (issue 12): a key of small order or wrong
Unmask shares from one device leave the others' sum exact (item 3); under mutual TLS only the
coordinator's certificate reaches the control API (item 12); devices hold no shared certificate,
and a stream without a valid Join is refused before anything it sends is read (issue 23,
findings 4, 5 and 9)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from pathlib import Path

import grpc
import pytest
from cryptography.hazmat.primitives import serialization

from support.aggregator import (
    CODE,
    assert_sum,
    await_sum,
    connected,
    device,
    join,
    plan,
    rpc_error,
    run,
    scrape,
)
from support.secagg import identities
from support.stack import in_process
from tally.aggregator import AggregatorService
from tally.secagg.layouts import advertise_statement
from tally.secagg.messages import AdvertiseKeys, UnmaskResponse
from tally.security import TLSConfig, certs
from tally.security.tls import channel_credentials
from tally.wire.join import JOIN_METADATA, join_metadata
from tally.wire.v1 import secagg_pb2
from tally.wire.v1.aggregator_pb2 import AwaitResultRequest, CloseSessionRequest
from tally.wire.v1.aggregator_pb2_grpc import AggregatorControlStub


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
        async with in_process().aggregator_alone(deployment) as service, connected(deployment, service) as (ch, stub):
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


def test_under_mutual_tls_only_the_coordinator_reaches_the_control_api_and_devices_need_no_certificate(
        deployment, tmp_path):
    """Attack 12 and the third review's finding 9: the control API has a port of its own that
    demands a client certificate (a device has none: no handshake) and admits only the
    coordinator's CN (another certificate of the same CA is refused on every call); the device
    port serves no control API; devices present no certificate, each stream authenticated by
    its Join, and the sum is exact."""
    ca_key = serialization.load_pem_private_key((deployment.tls_dir / "ca" / "ca.key").read_bytes(), None)
    ca_cert = certs.load_certificate(deployment.tls_dir / "ca" / "ca.pem")
    key, cert = certs.make_leaf(ca_key, ca_cert, "tally-impostor", server=False, client=True)
    (tmp_path / "impostor.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (tmp_path / "impostor.key").write_bytes(key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    impostor = TLSConfig(ca=deployment.tls_dir / "ca" / "ca.pem", cert=tmp_path / "impostor.pem",
                         key=tmp_path / "impostor.key")

    async def scenario():
        async with in_process().aggregator_alone(deployment, mutual=True) as service, \
                connected(deployment, service, "coordinator") as (_, control), \
                connected(deployment, service) as (devices, on_device_port):
            cohort = plan(deployment, "s-mtls")
            control_target = f"127.0.0.1:{service.control_port}"
            async with deployment.channel(control_target) as no_certificate:
                code, _ = await rpc_error(AggregatorControlStub(no_certificate).OpenSession(cohort.request))
                assert code == CODE.UNAVAILABLE  # the TLS handshake itself fails
            async with grpc.aio.secure_channel(control_target, channel_credentials(impostor)) as other:
                as_impostor = AggregatorControlStub(other)
                refused = (CODE.PERMISSION_DENIED,
                           "AggregatorControl admits only the coordinator's certificate (tally-coordinator), "
                           "not 'tally-impostor'")
                assert await rpc_error(as_impostor.OpenSession(cohort.request)) == refused
                await control.OpenSession(cohort.request)
                assert await rpc_error(as_impostor.AwaitResult(
                    AwaitResultRequest(session_id="s-mtls", sum_id="update"), metadata=cohort.owner_md)) == refused
                assert await rpc_error(as_impostor.CloseSession(
                    CloseSessionRequest(session_id="s-mtls"), metadata=cohort.owner_md)) == refused
            code, _ = await rpc_error(on_device_port.OpenSession(cohort.request))
            assert code == CODE.UNIMPLEMENTED
            runs = await asyncio.gather(
                *(device(devices, cohort, i) for i in range(1, 9)),
                await_sum(control, cohort, "update"),
            )
            assert [r.outcome for r in runs[:8]] == ["done"] * 8
            assert_sum(cohort, "update", runs[8][1], range(1, 9))
            metrics = scrape(service.metrics_port)
            assert metrics['tally_aggregator_rejected_total{reason="not_controller",status="PERMISSION_DENIED"}'] == 3

    run(scenario)


def test_mutual_tls_without_a_control_port_is_refused():
    """Devices present no certificate, so an aggregator that demands client certificates must
    keep them to the coordinator's port."""
    with pytest.raises(ValueError, match="control API its own port"):
        AggregatorService("127.0.0.1:0", TLSConfig(ca=Path("ca.pem"), require_client_auth=True), bytes(32), "agg")


# ---- third review, findings 4, 5 and 9: streams that are not a selected device's ---------------

SESSION = "/tally.v1.SecureAggregation/Session"


async def _status(call) -> tuple[CODE, str]:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        async for _ in call:
            pass
    return err.value.code(), err.value.details()


def test_a_stream_without_a_valid_join_is_refused_before_any_message_is_read(deployment):
    """The Join rides in the stream's metadata and is checked first: a stream without one, with
    bytes that are no Join, or with a Join for no session is refused at once, and none of the
    4 MiB messages they sent was read (the received-bytes counter stays at zero)."""
    big = secagg_pb2.DeviceToAggregator(masked_input_response=secagg_pb2.MaskedInputResponse(
        sum_id="x", sender=1, data=bytes((4 << 20) - 64)))

    async def scenario():
        async with in_process().aggregator_alone(deployment) as service, connected(deployment, service) as (channel, _):
            cohort = plan(deployment, "s-nojoin")
            attempts = {
                "none": (),
                "not a join": ((JOIN_METADATA, b"\xff\xff\xff"),),
                "two joins": join_metadata(join(cohort, 1)) * 2,
                "no session": join_metadata(join(cohort, 1)),  # the session was never opened
            }
            outcomes = {}
            for name, metadata in attempts.items():
                call = channel.stream_stream(
                    SESSION, request_serializer=secagg_pb2.DeviceToAggregator.SerializeToString)(metadata=metadata)
                with contextlib.suppress(grpc.aio.AioRpcError, asyncio.InvalidStateError):
                    await call.write(big)
                outcomes[name] = await _status(call)
            metrics = scrape(service.metrics_port)
            return outcomes, metrics

    outcomes, metrics = asyncio.run(asyncio.wait_for(scenario(), 60))
    # The server refuses at the metadata; the client may still be writing its 4 MiB, and then the
    # stream's reset can reach it before the status does (gRPC reports INTERNAL). What the server
    # answered is in its counters, whichever way the race went.
    expected = {
        "none": (CODE.UNAUTHENTICATED,
                 f"a session stream must carry exactly one Join in its {JOIN_METADATA!r} metadata"),
        "two joins": (CODE.UNAUTHENTICATED, None),
        "not a join": (CODE.UNAUTHENTICATED, "the stream's Join metadata is not a Join message"),
        "no session": (CODE.NOT_FOUND, None),
    }
    for name, (code, details) in expected.items():
        got_code, got_details = outcomes[name]
        assert got_code == CODE.INTERNAL or (got_code == code and details in (None, got_details)), (
            name, outcomes[name])
    assert metrics['tally_aggregator_rejected_total{reason="not_joined",status="UNAUTHENTICATED"}'] == 3
    assert metrics['tally_aggregator_rejected_total{reason="unknown_session",status="NOT_FOUND"}'] == 1
    assert metrics["tally_aggregator_received_bytes_total"] == 0
