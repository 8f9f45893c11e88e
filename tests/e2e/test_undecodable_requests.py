"""Third security review, finding 7: bytes that are not a request message get INVALID_ARGUMENT
naming the method on every unary RPC of every service (they used to get ``UNKNOWN: Unexpected
DecodeError``), and a registration timestamp that is not a finite number is refused as invalid
(NaN passed the freshness window and surfaced as a database error)."""

from __future__ import annotations

import asyncio
import math

import grpc
import pytest

from support.stack import in_process, run
from tally.client.enrolment import register_request
from tally.secagg import SigningKey
from tally.security.enrolment import enrolment_credential
from tally.wire.v1 import admin_pb2, aggregator_pb2, coordinator_pb2

NOT_A_MESSAGE = b"\xff\xff\xff\xff"  # field 31 with wire type 7: no protobuf parses it


def _unary_methods(descriptor, service: str) -> list[tuple[str, bool]]:
    methods = descriptor.services_by_name[service].methods
    return [(f"/{m.containing_service.full_name}/{m.name}", m.server_streaming)
            for m in methods if not m.client_streaming]


SERVICES = {
    "coordinator": _unary_methods(coordinator_pb2.DESCRIPTOR, "Coordinator")
    + _unary_methods(admin_pb2.DESCRIPTOR, "Admin"),
    "aggregator": _unary_methods(aggregator_pb2.DESCRIPTOR, "AggregatorControl"),
}


async def _call(target: str, method: str, streaming: bool) -> grpc.aio.AioRpcError:
    async with grpc.aio.insecure_channel(target) as channel:
        kind = channel.unary_stream if streaming else channel.unary_unary
        call = kind(method)(NOT_A_MESSAGE, timeout=10)
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            if streaming:
                async for _ in call:
                    pass
            else:
                await call
        return caught.value


def test_undecodable_requests_are_invalid_arguments_on_every_service(tmp_path):
    assert all(SERVICES.values())

    async def main():
        async with in_process().whole_system(tmp_path) as s:
            targets = {"coordinator": s.target, "aggregator": s.aggregators[0].address}
            return {(service, method): await _call(targets[service], method, streaming)
                    for service, methods in SERVICES.items() for method, streaming in methods}

    errors = run(main())
    for (service, method), error in errors.items():
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, (service, method, error.code(), error.details())
        assert method in error.details() and "4-byte request is not a valid request message" in error.details()


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_a_registration_timestamp_that_is_not_finite_is_invalid(tmp_path, value):
    async def main():
        async with in_process().whole_system(tmp_path) as s:
            identity = SigningKey.generate()
            credential = enrolment_credential(s.coordinator.enrolment_key, "default", "dev-nan")
            request = register_request(identity, "dev-nan", "default", credential, value)
            async with grpc.aio.insecure_channel(s.target) as channel:
                register = channel.unary_unary("/tally.v1.Coordinator/Register",
                                               request_serializer=coordinator_pb2.RegisterRequest.SerializeToString,
                                               response_deserializer=coordinator_pb2.RegisterResponse.FromString)
                with pytest.raises(grpc.aio.AioRpcError) as caught:
                    await asyncio.wait_for(register(request, timeout=10), 20)
            return caught.value

    error = run(main())
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "RegisterRequest.timestamp: a finite number of seconds" in error.details()
