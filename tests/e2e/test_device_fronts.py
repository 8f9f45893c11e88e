"""Device fronts (issue 28): processes beside the coordinator, on its port, that answer
registrations and idle check-ins themselves and forward every other call to the coordinator,
which alone plans rounds.

A front started in the test on a port of its own is reached deterministically; the processes a
coordinator spawns share its port, and the kernel decides which serves a connection, so those
tests open many connections and read every process's metrics.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import sqlite3
import time

import grpc
import pytest

from support.enrolment import provisioned_request
from support.stack import PLAINTEXT, in_process, run, scrape_text, spec, trainers
from tally.cli import main as tally
from tally.client.channels import open_aio_channel
from tally.coordinator.faces import device_front
from tally.coordinator.faces.device_front import REFRESH_S, refuse_port_in_use, shares
from tally.coordinator.faces.ratelimit import RateLimit
from tally.coordinator.service import CoordinatorService
from tally.loadtest import Fleet
from tally.security import bearer_metadata
from tally.wire.v1 import admin_pb2, admin_pb2_grpc, common_pb2, coordinator_pb2, coordinator_pb2_grpc

CHECK_IN = coordinator_pb2.CheckInRequest()


def _counter(text: str, name: str, **labels: str) -> float:
    """The sample of ``name`` with ``labels`` in an exposition (0 when absent)."""
    wanted = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    for line in text.splitlines():
        if line.startswith(f"{name}{{{wanted}}} ") or (not labels and line.startswith(f"{name} ")):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


async def _register(s, target: str, device_id: str, population: str = "default"):
    """A device on its own channel: (channel, stub, metadata with its token)."""
    channel = open_aio_channel(target, s.client_tls)
    stub = coordinator_pb2_grpc.CoordinatorStub(channel)
    reply = await stub.Register(provisioned_request(s.coordinator, device_id, population), timeout=10)
    return channel, stub, bearer_metadata(reply.token)


async def _until(predicate, seconds: float, what: str) -> None:
    """Poll ``predicate`` (a coroutine function) until it holds, failing after ``seconds``."""
    deadline = time.monotonic() + seconds
    while not await predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {seconds} s: {what}")
        await asyncio.sleep(0.05)


class _Front:
    """A front in the test's own process, on a port of its own, forwarding to ``s``'s coordinator."""

    def __init__(self, s) -> None:
        self.s = s

    async def __aenter__(self):
        self.front, self.port = await self.s.services.front(self.s.coordinator.front_config(99, "127.0.0.1:0"))
        self.target = f"127.0.0.1:{self.port}"
        return self

    async def __aexit__(self, *exc) -> None:
        await self.s.services.stop(self.front)

    def metrics(self) -> str:
        return scrape_text(self.front.metrics_port)


def test_a_front_answers_idle_check_ins_and_refuses_bad_ones_itself(tmp_path):
    async def main() -> None:
        async with in_process().whole_system(tmp_path, tls=True, device_processes=2) as s, _Front(s) as front:
            channel, stub, md = await _register(s, front.target, "dev-1")
            reply = await stub.CheckIn(CHECK_IN, metadata=md, timeout=10)
            assert reply.retry_after.population_idle
            assert "no running job" in reply.retry_after.reason
            assert _counter(front.metrics(), "tally_coordinator_checkins_total", outcome="retry") == 1
            # Issue 38, problem 4: an SDK device states its input ledger at every check-in; with
            # no job in its population there is no seat to release, and the front answers it too.
            ledger = coordinator_pb2.InputLedger(latest_round={"job-0": 3}, ledger_id="ab" * 16)
            reply = await stub.CheckIn(coordinator_pb2.CheckInRequest(input_ledger=ledger), metadata=md, timeout=10)
            assert reply.retry_after.population_idle
            assert _counter(front.metrics(), "tally_coordinator_checkins_total", outcome="retry") == 2
            assert _counter(front.metrics(), "tally_coordinator_forwarded_calls_total", method="CheckIn") == 0
            assert _counter(scrape_text(s.coordinator.metrics_port), "tally_coordinator_checkins_total",
                            outcome="retry") == 0
            assert s.coordinator.store.devices.identities(["dev-1"])  # the front's write, in the store
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stub.CheckIn(CHECK_IN, timeout=10)  # no token
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
            raw = channel.unary_unary("/tally.v1.Coordinator/Register")
            with pytest.raises(grpc.aio.AioRpcError) as undecodable:
                await raw(b"\xff\xff\xff", timeout=10)
            assert undecodable.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            again = provisioned_request(s.coordinator, "dev-1")  # the id, under another key
            with pytest.raises(grpc.aio.AioRpcError) as taken:
                await stub.Register(again, timeout=10)
            assert taken.value.code() == grpc.StatusCode.PERMISSION_DENIED
            assert _counter(front.metrics(), "tally_coordinator_refusals_total",
                            rpc="Register", reason="id_taken") == 1
            await channel.close()

    run(main())


# `make test` runs a job through a front in tests/e2e/test_replicas.py (a follower's); CI runs this too
@pytest.mark.full
def test_a_job_runs_through_a_front(tmp_path):
    """Every device registers, checks in, downloads and reports through the front: the check-ins
    of the job's population and every other call are forwarded, and the rounds commit."""

    async def main() -> None:
        async with in_process().whole_system(tmp_path, tls=True, device_processes=2) as s, _Front(s) as front:
            devices, _ = trainers(10)
            job_id = await s.submit(spec("through-front", rounds=2, cohort=10))
            fleet = Fleet(front.target, s.client_tls, devices, enrolment_key=s.coordinator.enrolment_key, seed=1)
            try:
                await fleet.run(until=fleet.until_job_done(job_id, every_seconds=0.2))
            finally:
                fleet.close()
            job = await s.job(job_id)
            assert job.state == common_pb2.JOB_STATE_SUCCEEDED, job.message
            assert job.committed_round == 2
            channel, stub, md = await _register(s, front.target, "late-device")
            status = await stub.RoundStatus(coordinator_pb2.RoundStatusRequest(job_id=job_id), metadata=md,
                                            timeout=10)
            assert status.committed_round == 2 and status.model_version == f"{job_id}/v2"
            await channel.close()
            text = front.metrics()
            for method in ("CheckIn", "DownloadModel", "RoundStatus"):
                assert _counter(text, "tally_coordinator_forwarded_calls_total", method=method) > 0, method

    run(main())


def test_a_revocation_reaches_a_front_and_admin_calls_pass_through_it(tmp_path):
    async def main() -> None:
        async with in_process().whole_system(tmp_path, tls=True, device_processes=2) as s, _Front(s) as front:
            channel, stub, md = await _register(s, front.target, "dev-1")
            await stub.CheckIn(CHECK_IN, metadata=md, timeout=10)
            admin = admin_pb2_grpc.AdminStub(channel)  # the Admin API, forwarded by the front
            admin_md = bearer_metadata(s.coordinator.admin_token)
            await admin.RevokeDevice(admin_pb2.RevokeDeviceRequest(device_id="dev-1"), metadata=admin_md,
                                     timeout=10)
            with pytest.raises(grpc.aio.AioRpcError) as no_admin:
                await admin.ListJobs(admin_pb2.ListJobsRequest(), timeout=10)
            assert no_admin.value.code() == grpc.StatusCode.UNAUTHENTICATED

            async def refused() -> bool:
                try:
                    await stub.CheckIn(CHECK_IN, metadata=md, timeout=10)
                except grpc.aio.AioRpcError as exc:
                    assert exc.code() == grpc.StatusCode.PERMISSION_DENIED, exc
                    return True
                return False

            await _until(refused, 10 * REFRESH_S, "the front refuses the revoked device")
            await channel.close()

    run(main())


def test_the_internal_port_admits_fronts_only(tmp_path):
    async def main() -> None:
        async with in_process().whole_system(tmp_path, tls=True, device_processes=2) as s:
            channel = grpc.aio.insecure_channel(s.coordinator.internal_target)
            stub = coordinator_pb2_grpc.CoordinatorStub(channel)
            for metadata in ((), (("tally-front-key", "0" * 64),)):
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await stub.CheckIn(CHECK_IN, metadata=metadata, timeout=10)
                assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
            await channel.close()

    run(main())


def test_device_processes_share_the_port_and_a_killed_front_comes_back(tmp_path):
    async def main() -> None:
        async with in_process().whole_system(tmp_path, tls=True, device_processes=3) as s:
            assert len(s.coordinator.fronts) == 2

            async def check_in_on_new_connections(prefix: str, count: int) -> None:
                for i in range(count):
                    channel, stub, md = await _register(s, s.target, f"{prefix}-{i}")
                    reply = await stub.CheckIn(CHECK_IN, metadata=md, timeout=10)
                    assert reply.retry_after.population_idle
                    await channel.close()

            def served() -> list[float]:
                ports = [s.coordinator.metrics_port, *(f.metrics_port for f in s.coordinator.fronts)]
                return [_counter(scrape_text(p), "tally_coordinator_checkins_total", outcome="retry")
                        for p in ports]

            await check_in_on_new_connections("first", 30)
            counts = served()
            assert sum(counts) == 30
            assert sum(c > 0 for c in counts) >= 2, counts  # 30 connections, 3 processes

            killed = s.coordinator.fronts[0].pid
            os.kill(killed, signal.SIGKILL)

            async def replaced() -> bool:
                return s.coordinator.fronts[0].pid != killed and s.coordinator.fronts[0].ready

            await _until(replaced, 60, "the coordinator starts the killed front again")
            await check_in_on_new_connections("second", 30)  # none of them fails
            assert sum(served()) >= 30  # the new front counts from zero

    run(main())


def test_a_process_share_of_a_rate_limit():
    assert shares(RateLimit(500, 5000), 4) == RateLimit(125, 1250)
    assert shares(RateLimit(3, 2), 4) == RateLimit(0.75, 1)


def test_device_processes_must_be_positive(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        tally(["coordinator", "--state-dir", str(tmp_path / "s"), "--device-processes", "0", "--insecure"])
    assert exit_.value.code == 2
    assert "--device-processes" in capsys.readouterr().err


# `make test` runs a job through a front in tests/e2e/test_replicas.py (a follower's); CI runs this too
@pytest.mark.full
def test_a_job_survives_its_device_front_killed_between_rounds(tmp_path):
    """Six fleets, each on its own connection to the shared port, run a 3-round job; the front is
    killed as round 1 commits. Its devices reconnect (to the coordinator or the restarted front)
    and every round commits."""

    async def main() -> None:
        async with in_process().whole_system(tmp_path, tls=True, device_processes=2) as s:
            devices, _ = trainers(18)
            job_id = await s.submit(spec("front-killed", rounds=3, cohort=12))
            fleets = [s.fleet(devices[i::6], seed=1, id_prefix=f"f{i}") for i in range(6)]
            killed = s.coordinator.fronts[0].pid

            async def kill_after_round_1() -> None:
                await s.committed(job_id, 1)
                os.kill(killed, signal.SIGKILL)

            try:
                await asyncio.gather(kill_after_round_1(), *(
                    fleet.run(until=fleet.until_job_done(job_id, every_seconds=0.2)) for fleet in fleets))
            finally:
                for fleet in fleets:
                    fleet.close()
            job = await s.job(job_id)
            assert job.state == common_pb2.JOB_STATE_SUCCEEDED, job.message
            assert job.committed_round == 3
            assert s.coordinator.fronts[0].pid != killed

    run(main())


def test_the_pace_is_split_so_a_population_with_a_job_arrives_at_the_whole_rate(tmp_path):
    """Each process paces its own devices' idle check-ins at 1/N of the rate; the coordinator
    paces what the fronts forward (their devices of populations with a job) at their share."""
    service = CoordinatorService("127.0.0.1:0", PLAINTEXT, tmp_path / "state", [], checkin_rate=100.0,
                                 device_processes=4)
    assert service.pacer.rate_per_s == 25.0 and service.forwarded_pacer.rate_per_s == 75.0
    alone = CoordinatorService("127.0.0.1:0", PLAINTEXT, tmp_path / "state", [], checkin_rate=100.0)
    assert alone.pacer.rate_per_s == 100.0 and alone.forwarded_pacer.rate_per_s is None


def test_a_front_that_cannot_read_the_store_stops_rather_than_answer_from_stale_state(tmp_path, monkeypatch):
    monkeypatch.setattr(device_front, "STALE_S", 0.3)

    async def main() -> None:
        async with in_process().whole_system(tmp_path, tls=True, device_processes=2) as s, _Front(s) as front:
            def unreadable() -> None:
                raise sqlite3.OperationalError("database is locked")

            monkeypatch.setattr(front.front, "_refresh_once", unreadable)
            await asyncio.wait_for(front.front.stale.wait(), 10)

    run(main())


def test_a_coordinator_refuses_a_port_another_service_listens_on(monkeypatch):
    monkeypatch.setattr(device_front, "ORPHAN_EXIT_S", 0.3)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(RuntimeError, match="another service listening"):
            asyncio.run(refuse_port_in_use(f"127.0.0.1:{port}"))
    asyncio.run(refuse_port_in_use(f"127.0.0.1:{port}"))  # closed: free again
    asyncio.run(refuse_port_in_use("127.0.0.1:0"))
