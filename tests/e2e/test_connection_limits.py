"""Connections that end (issue 38, problem 3): a connection that completes TLS and the HTTP/2
preface and opens no stream needs only the public CA, and every device-facing port used to keep
it for good; 1,000 of them from one host left an aggregator under ``ulimit -n 1024`` without a
descriptor for devices. Every device-facing port now closes idle connections, bounds their age,
caps their number below the descriptor limit and per source (``tally.security.connections``).

The attacker's connections come from 127.0.0.2, the devices' from 127.0.0.1: two sources on one
host."""

from __future__ import annotations

import asyncio
import contextlib
import math
import re
import ssl
import sys
import time
from pathlib import Path

import grpc
import psutil
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from support.stack import PLAINTEXT, in_process, scrape_text
from tally.client.enrolment import register_request, simulated_identity
from tally.security import TLSConfig, bearer_metadata, load_or_create_ticket_key
from tally.security.certs import write_deployment
from tally.security.connections import SWEEP_S, ConnectionLimits
from tally.security.enrolment import ENROLMENT_KEY_FILE, enrolment_credential, read_enrolment_key
from tally.security.tls import open_aio_channel
from tally.wire.v1 import coordinator_pb2, coordinator_pb2_grpc

ATTACKER = "127.0.0.2"
# The client's HTTP/2 connection preface and an empty SETTINGS frame: a connection gRPC accepts,
# on which no stream is ever opened.
PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes.fromhex("000000040000000000")
SLACK_S = 1.0  # scheduling on a loaded machine, on top of the limits themselves


async def _idle_connection(port: int, opened: asyncio.Event | None = None,
                           tls: ssl.SSLContext | None = None) -> float:
    """A connection from ATTACKER that completes TLS (with ``tls``) and the preface, then waits:
    the seconds from the preface until the server closed it (0 for a connection refused before).
    ``opened`` is set once it is open or refused."""
    start, writer = math.inf, None
    try:
        reader, writer = await asyncio.open_connection(
            "127.0.0.1", port, local_addr=(ATTACKER, 0), ssl=tls, server_hostname="localhost" if tls else None)
        writer.write(PREFACE)
        await writer.drain()
        start = time.monotonic()
        if opened is not None:
            opened.set()
        while await reader.read(1 << 16):
            pass
    except (OSError, ssl.SSLError):
        pass
    finally:
        if opened is not None:
            opened.set()
        if writer is not None:
            writer.close()
            with contextlib.suppress(OSError, ssl.SSLError):
                await writer.wait_closed()
    return max(0.0, time.monotonic() - start)


def _counter(text: str, name: str) -> float:
    match = re.search(rf"^{name} (\S+)$", text, re.MULTILINE)
    return float(match.group(1)) if match else 0.0


LIMITS = ConnectionLimits(idle_s=1.0, per_source=4)


async def _serve(services, tmp_path: Path, role: str) -> tuple[int, int]:
    """``role``'s device port, with LIMITS, on plaintext loopback: (port, metrics port)."""
    state = tmp_path / "state"
    if role == "aggregator":
        service = await services.aggregator(PLAINTEXT, load_or_create_ticket_key(state).public_key(), "agg",
                                            connection_limits=LIMITS)
        return service.port, service.metrics_port
    coordinator = await services.coordinator(PLAINTEXT, state, connection_limits=LIMITS,
                                             device_processes=2 if role == "front" else 1)
    if role == "coordinator":
        return coordinator.port, coordinator.metrics_port
    front, port = await services.front(coordinator.front_config(99, "127.0.0.1:0"))
    return port, front.metrics_port


@pytest.mark.parametrize("role", ["coordinator", "front", "aggregator"])
def test_every_device_port_closes_idle_connections_and_caps_a_source(tmp_path, role):
    """Twelve idle connections from one source against a cap of four (a front: its half) and an
    idle limit of 1 s: the surplus is shut by the next sweep and counted, the rest close when
    idle, all within the idle limit; a device from another source is served throughout."""

    async def main():
        async with in_process() as services:
            port, metrics_port = await _serve(services, tmp_path, role)
            attack = [asyncio.create_task(_idle_connection(port)) for _ in range(12)]
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                health = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
            closed_after = await asyncio.gather(*attack)
            return health.status, closed_after, scrape_text(metrics_port)

    status, closed_after, metrics = asyncio.run(asyncio.wait_for(main(), 120))
    assert status == health_pb2.HealthCheckResponse.SERVING
    assert max(closed_after) < LIMITS.idle_s + SWEEP_S + SLACK_S, sorted(closed_after)
    # A front holds its share of the cap: the kernel spreads a source's connections over the
    # coordinator's processes (two here).
    cap = LIMITS.resolved(processes=2 if role == "front" else 1).per_source
    name = "tally_aggregator" if role == "aggregator" else "tally_coordinator"
    assert _counter(metrics, f"{name}_connections_over_source_cap_total") == 12 - cap


# Runs a role's command under a 1,024-descriptor limit of its own.
LAUNCH = ("import resource, sys; resource.setrlimit(resource.RLIMIT_NOFILE, (1024, 1024)); "
          "from tally.cli import main; sys.exit(main())")


async def _registered_and_checked_in(port: int, certs: Path, device_id: str) -> bool:
    """A device on its own connection registers and checks in (no job: a come-back time)."""
    key = read_enrolment_key(certs / "coordinator" / ENROLMENT_KEY_FILE)
    async with open_aio_channel(f"localhost:{port}", TLSConfig.from_dir(certs / "device", None)) as channel:
        stub = coordinator_pb2_grpc.CoordinatorStub(channel)
        request = register_request(simulated_identity(key, device_id), device_id, "default",
                                   enrolment_credential(key, "default", device_id), time.time())
        token = (await stub.Register(request, timeout=60)).token
        reply = await stub.CheckIn(coordinator_pb2.CheckInRequest(), metadata=bearer_metadata(token), timeout=60)
    return reply.HasField("retry_after")


async def _health_checked(port: int, certs: Path, device_id: str) -> bool:
    """A device on its own connection reaches the aggregator's port (its health service: a
    session stream needs a cohort)."""
    async with open_aio_channel(f"localhost:{port}", TLSConfig.from_dir(certs / "device", None)) as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=60)
    return reply.status == health_pb2.HealthCheckResponse.SERVING


ROLES = {
    "coordinator": (lambda tmp: ["coordinator", "--state-dir", str(tmp / "state"), "--tls-dir",
                                 str(tmp / "certs" / "coordinator")],
                    r"coordinator on port (\d+)", _registered_and_checked_in),
    "aggregator": (lambda tmp: ["aggregator", "--id", "agg-1", "--tls-dir", str(tmp / "certs" / "aggregator-1")],
                   r"\(port (\d+)", _health_checked),
}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("role", list(ROLES))
def test_a_thousand_idle_connections_end_within_the_idle_limit_while_devices_are_served(tmp_path, role):
    """The finding's attack over TLS against a server limited to 1,024 descriptors, with its
    default caps (three quarters of the limit in all, an eighth of that per source) and an idle
    limit of 5 s: 1,000 idle connections from one host, and meanwhile 40 devices, each on its own
    connection, from another (to the coordinator they register and check in). Every device is
    served, every attacking connection is closed within the idle limit, and the server's
    descriptors are back where they started."""
    certs = tmp_path / "certs"
    write_deployment(certs, aggregators=1)
    idle_s = 5.0
    tls = ssl.create_default_context(cafile=str(certs / "device" / "ca.pem"))
    tls.set_alpn_protocols(["h2"])
    args, ready, device = ROLES[role]

    async def main():
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-c", LAUNCH, *args(tmp_path), "--listen", "127.0.0.1:0", "--metrics-port", "0",
            "--connection-idle", str(idle_s), stdout=asyncio.subprocess.PIPE,
            stderr=(tmp_path / f"{role}.log").open("wb"))
        try:
            line = (await asyncio.wait_for(process.stdout.readline(), 120)).decode()
            port = int(re.search(ready, line).group(1))
            metrics_port = int(re.search(r"metrics on (?:http://\S*:|port )(\d+)", line).group(1))
            server = psutil.Process(process.pid)
            assert server.rlimit(psutil.RLIMIT_NOFILE) == (1024, 1024)
            before = server.num_fds()
            opened = [asyncio.Event() for _ in range(1000)]
            attack = [asyncio.create_task(_idle_connection(port, event, tls)) for event in opened]
            await asyncio.gather(*(event.wait() for event in opened))
            served = await asyncio.gather(*(device(port, certs, f"dev-{i}") for i in range(40)))
            closed_after = await asyncio.gather(*attack)
            return served, closed_after, before, server.num_fds(), scrape_text(metrics_port)
        finally:
            process.terminate()
            await process.wait()

    served, closed_after, before, after, metrics = asyncio.run(asyncio.wait_for(main(), 280))
    assert all(served)
    assert max(closed_after) < idle_s + SWEEP_S + SLACK_S, sorted(closed_after)[-10:]
    assert after <= before + 5, (before, after)  # a device's connection may not have gone yet
    # The one source was held to its eighth of 768 connections: the surplus the server accepted
    # was shut by a sweep (the rest it refused at the total cap).
    assert _counter(metrics, f"tally_{role}_connections_over_source_cap_total") > 0
