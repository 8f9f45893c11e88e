"""TLS failures named as TLS failures (issue 25, item 4): with the wrong CA, `tally client` showed
only gRPC's raw `CERTIFICATE_VERIFY_FAILED` line and `tally fleet` blamed the address. Real
handshakes against a real TLS server: a CA the client does not trust, a certificate that does not
name the host dialled, an expired one; then both commands as processes against a coordinator."""

from __future__ import annotations

import asyncio
import datetime as dt
import sys
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from support.stack import in_process
from tally.client.device import Device, DeviceStats
from tally.client.retry import CoordinatorUnreachable, RetryPolicy
from tally.loadtest import FleetStats
from tally.loadtest.synthetic import SyntheticUpdates
from tally.security import TLSConfig, certs
from tally.security.tls import bind, open_aio_channel
from tally.security.tls_failures import tls_failure

REPO = Path(__file__).resolve().parents[2]


def _named_only(pki: Path, name: str) -> Path:
    """A CA and a server certificate naming ``name`` only (not the loopback the test dials)."""
    ca_key, ca_cert = certs.make_ca()
    key, cert = certs.make_leaf(ca_key, ca_cert, name, server=True, dns=[name])
    pki.mkdir()
    for file, data in (("ca.pem", certs._cert_pem(ca_cert)), ("server.pem", certs._cert_pem(cert)),
                       ("server.key", certs._key_pem(key))):
        (pki / file).write_bytes(data)
    return pki


def _mismatches(tmp_path: Path) -> dict[str, tuple[TLSConfig, TLSConfig]]:
    """Per handshake failure, the server's identity and the device's trust that cause it."""
    certs.write_deployment(tmp_path / "good")
    certs.write_deployment(tmp_path / "other")
    certs.write_deployment(tmp_path / "old", now=dt.datetime.now(dt.UTC) - dt.timedelta(days=10), days=2)
    named = _named_only(tmp_path / "named", "elsewhere.example")
    coordinator = lambda pki: TLSConfig.from_dir(pki / "coordinator", "coordinator")  # noqa: E731
    device = lambda pki: TLSConfig.from_dir(pki / "device", None)  # noqa: E731
    return {
        "not signed by the CA this client trusts": (coordinator(tmp_path / "good"), device(tmp_path / "other")),
        "does not name the host dialled": (TLSConfig(ca=named / "ca.pem", cert=named / "server.pem",
                                                     key=named / "server.key"), TLSConfig(ca=named / "ca.pem")),
        "has expired": (coordinator(tmp_path / "old"), device(tmp_path / "old")),
    }


async def _handshake_error(server_tls: TLSConfig, client_tls: TLSConfig) -> str:
    """The status details of one call from ``client_tls`` to a server with ``server_tls``."""
    server = grpc.aio.server()
    health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
    port = bind(server, "127.0.0.1:0", server_tls)
    await server.start()
    channel = open_aio_channel(f"127.0.0.1:{port}", client_tls)
    try:
        await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        return ""
    except grpc.aio.AioRpcError as exc:
        assert exc.code() == grpc.StatusCode.UNAVAILABLE
        return exc.details() or ""
    finally:
        await channel.close()
        await server.stop(0)


def test_each_handshake_failure_is_named_by_its_cause(tmp_path):
    cases = _mismatches(tmp_path)
    trusted = TLSConfig.from_dir(tmp_path / "good" / "device", None)
    cases["does not speak TLS"] = (TLSConfig.plaintext(), trusted)

    async def main():
        good = TLSConfig.from_dir(tmp_path / "good" / "coordinator", "coordinator")
        assert await _handshake_error(good, trusted) == ""
        return {cause: await _handshake_error(*pair) for cause, pair in cases.items()}

    for cause, details in asyncio.run(main()).items():
        named_as = tls_failure(details)
        assert named_as is not None and named_as.startswith("TLS: ") and cause in named_as, (cause, details)
    assert tls_failure("failed to connect to all addresses; last error: UNKNOWN: Connection refused") is None


@pytest.mark.parametrize("command", [
    ["client", "--device-id", "d", "--shard", "0", "--shards", "2"],
    ["fleet", "--devices", "2", "--no-progress"],
])
def test_client_and_fleet_with_the_wrong_ca_say_tls_not_address(tmp_path, command):
    certs.write_deployment(tmp_path / "pki")
    certs.write_deployment(tmp_path / "other")

    async def main() -> tuple[int, str]:
        async with in_process() as services:
            service = await services.coordinator(TLSConfig.from_dir(tmp_path / "pki" / "coordinator", "coordinator"),
                                                 tmp_path / "state")
            process = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "tally.cli", *command, "--hidden", "8", "--connect-timeout", "2",
                "--coordinator", f"127.0.0.1:{service.port}", "--tls-dir", str(tmp_path / "other" / "device"),
                "--state-dir", str(tmp_path / "device-state"), cwd=REPO, stderr=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.DEVNULL)
            _, err = await asyncio.wait_for(process.communicate(), 120)
            return process.returncode, err.decode()

    code, err = asyncio.run(main())
    assert code == 1, err
    last = " ".join(err[err.rindex("tally "):].split())  # the closing message, unwrapped
    assert "TLS: the server's certificate is not signed by the CA this client trusts" in last, err
    assert "it answers, but the TLS handshake fails" in last and "is the address right" not in last
    assert "ssl_transport_security" not in err  # gRPC's raw handshake lines are not the message


@pytest.fixture(scope="module")
def mismatches(tmp_path_factory) -> dict[str, tuple[TLSConfig, TLSConfig]]:
    return _mismatches(tmp_path_factory.mktemp("pki"))


@pytest.mark.parametrize("run", range(5))
@pytest.mark.parametrize("cause", ["not signed by the CA this client trusts", "does not name the host dialled",
                                   "has expired"])
def test_the_tls_cause_survives_later_vaguer_retries(mismatches, cause, run):
    """Issue 39, item 3: a wrong CA named in 1 of 6 fleet runs; later retries said a bare
    `UNAVAILABLE` and the final message quoted the last one, reading like a wrong address. A
    device keeps the most specific error since its last call that succeeded: here the handshake
    fails, then the server is gone (connection refused), and the TLS cause is still what
    `DeviceStats.last_error` and the closing message carry."""
    server_tls, device_tls = mismatches[cause]

    async def main() -> DeviceStats:
        server = grpc.aio.server()
        health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
        port = bind(server, "127.0.0.1:0", server_tls)
        await server.start()
        retry = RetryPolicy(initial_seconds=0.01, max_seconds=0.05, max_attempts=3)
        device = Device(f"127.0.0.1:{port}", device_tls, f"d{run}", SyntheticUpdates(f"d{run}", run), retry=retry)
        try:
            with pytest.raises(grpc.aio.AioRpcError):  # three handshakes fail: the attempts are spent
                await device.run(asyncio.Event())
            assert cause in device.stats.last_error
        finally:
            await server.stop(0)
        with pytest.raises(grpc.aio.AioRpcError) as refused:  # nothing listens now
            await device.run(asyncio.Event())
        assert tls_failure(refused.value.details() or "") is None
        return device.stats

    stats = asyncio.run(main())
    assert stats.retries == 4 and stats.checkins == 0
    assert stats.last_error.startswith("Register: UNAVAILABLE (TLS: ") and cause in stats.last_error
    message = str(CoordinatorUnreachable.after("no device reached", "c:1", 1, stats.last_error))
    assert cause in message and "it answers, but the TLS handshake fails" in message
    # A fleet's closing message quotes the most specific error of any device, not the first device's.
    vague = DeviceStats("other", retries=1, last_error="Register: UNAVAILABLE")
    assert FleetStats.collect([vague, stats], "", 1.0).last_error == stats.last_error
