"""Coordinator replicas over PostgreSQL (issue 28): the store on a real PostgreSQL server answers
as the embedded SQLite one does, one replica leads (an advisory lock) and the others follow as
device fronts, a new leader fences the old one's writes, and a job survives its leader killed
mid-round: a follower takes over, resumes it from the store, and every cohort sum stays exact."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import grpc
import pytest

from support.deploy import free_port
from support.stack import TIMEOUT, in_process, scrape_text, spec, trainers
from tally.client.channels import open_aio_channel
from tally.coordinator.state.enrolled_devices import EnrolmentRefused
from tally.coordinator.state.leadership import Leadership
from tally.coordinator.state.store import CohortSumRecord, LeadershipLost, ModelVersion, Store
from tally.loadtest import Fleet
from tally.loadtest.sum_audit import EXACT, SumAudit, check_committed, outcome_counts
from tally.ops.cluster import ProcessCluster
from tally.ops.processes import Process
from tally.security import bearer_metadata
from tally.security.tls import open_channel
from tally.wire.v1 import admin_pb2, admin_pb2_grpc, common_pb2


def _exercise(store: Store) -> dict:
    """The same writes on any store, and everything they can be read back as."""
    t = 1_700_000_000.123456
    digest = store.put_blob(b"model bytes", "model")
    store.put_blob(b"model bytes", "model")  # written once
    for i in range(3):
        store.create_job(f"job-{i}", f"name-{i}", "fedavg", "pop" if i < 2 else "other", "spec", t + i)
    store.set_job_state("job-1", "RUNNING", t + 10, "started")
    store.add_model_version(ModelVersion("job-0", 0, digest, None, None, t))
    attempt = store.start_attempt("job-0", 1, t + 1)
    again = store.start_attempt("job-0", 1, t + 2)
    store.finish_attempt("job-0", 1, attempt, t + 3, "deadline")
    store.set_attempt_sessions("job-0", 1, again, [{"aggregator_id": "a", "session_id": "s"}])
    store.add_seated("job-0", 1, [("d1", "t1"), ("d2", "t2"), ("d3", "t3")])
    store.add_seated("job-0", 1, [("d1", "t4")])  # a later attempt's task replaces the seat's
    released = store.release_seats("job-0", 1, [("d2", "t2"), ("d1", "t1")])
    released_device = store.release_device("job-0", 1, "d3")
    for _ in range(2):  # a device convicted in every sum of its session is recorded once
        store.convict("job-0", "d2", "its share for device 4 fails under the share key it proved")
    for detail in ("first", "second"):
        store.count_task_report("job-0", 1, "failed", "oom", detail)
    store.count_task_report("job-0", 1, "done", "", "")
    record = CohortSumRecord("s", "update", 3, 32, (0, 1, 2), (5, 2**61 - 1, 7))
    store.add_cohort_sum("job-0", 1, again, record)
    store.add_cohort_sum("job-0", 1, again, record)
    store.commit_round(ModelVersion("job-0", 1, digest, None, None, t + 4), again, {"loss": 0.25}, final=False)
    silos = [store.silo("job-2", device, limit=2) for device in ("x", "y", "x", "z")]
    store.devices.enrol("d1", "pop", b"\x01" * 32, t, t)
    refusals = []
    for args in (("d1", "pop", b"\x01" * 32, t), ("d9", "pop", b"\x01" * 32, t + 1),
                 ("d1", "pop", b"\x02" * 32, t + 1), ("d1", "other", b"\x01" * 32, t + 1)):
        try:
            store.devices.enrol(*args, t + 5)
        except EnrolmentRefused as refused:
            refusals.append(refused.reason)
    store.devices.enrol("d1", "pop", b"\x01" * 32, t + 6, t + 6)
    revoked = (store.devices.revoke("d1", t + 7), store.devices.revoke("nobody", t + 7))
    blob = store.blob(digest, ("model",))
    return {
        "jobs": [(j.job_id, j.state, j.message, j.committed_round, j.created_at) for j in store.jobs()],
        "running": [j.job_id for j in store.jobs(("RUNNING",))],
        "after": [j.job_id for j in store.jobs(after_seq=store.jobs()[0].seq, limit=1)],
        "counts": store.job_counts(),
        "rounds": [(r.round, r.attempt, r.state, r.message, r.metrics, r.sessions) for r in store.rounds("job-0")],
        "released": (released, released_device),
        "seated": sorted(store.seated("job-0", 1)),  # emptied by the commit
        "convicted": sorted(store.convicted("job-0")),  # kept: for the whole job
        "reports": store.task_report_summary("job-0", 1),
        "sums": store.committed_cohort_sums("job-0", 1),
        "version": store.model_version("job-0"),
        "silos": (silos, store.silos("job-2")),
        "refusals": refusals,
        "revoked": (revoked, store.devices.is_revoked("d1")),
        "identities": store.devices.identities(["d1", "d2"]),
        "blob": (blob.size, store.read_blob(digest), store.blob(digest, ("onnx",))),
    }


def test_the_store_over_postgres_answers_as_sqlite_does(tmp_path, postgres_url):
    leadership = Leadership(postgres_url)
    epoch = leadership.try_lead()
    sqlite, postgres = Store(tmp_path / "sqlite"), Store(tmp_path / "pg", postgres_url, epoch)
    try:
        expected, got = _exercise(sqlite), _exercise(postgres)
    finally:
        sqlite.close()
        postgres.close()
        leadership.close()
    assert got == expected
    # Not two empty answers: what the writes should read back as.
    assert expected["refusals"] == ["replay", "key_taken", "id_taken", "population_mismatch"]
    assert expected["released"] == (1, 1) and expected["seated"] == [] and expected["convicted"] == ["d2"]
    assert expected["reports"][("failed", "oom")] == (2, "first")
    assert expected["silos"] == ([0, 1, 0, None], {"x": 0, "y": 1})
    assert expected["sums"][0].fingerprint == (5, 2**61 - 1, 7)
    assert expected["jobs"][0][4] == 1_700_000_000.123456  # a timestamp keeps its microseconds


def test_one_replica_leads_and_a_new_leader_fences_the_old_one(tmp_path, postgres_url):
    first, second = Leadership(postgres_url), Leadership(postgres_url)
    assert first.try_lead() == 1
    assert second.try_lead() is None and not second.holds()
    store = Store(tmp_path / "first", postgres_url, epoch=1)
    digest = store.put_blob(b"round one", "model")
    store.create_job("j", "j", "fedavg", "pop", "spec", 1.0)
    attempt = store.start_attempt("j", 1, 2.0)
    first._db.conn.close()  # its session ends, as a killed process's does, without unlocking
    assert _lead_within(second, 10.0) == 2 and second.holds()
    with pytest.raises(LeadershipLost):  # the old leader, unaware, cannot commit
        store.commit_round(ModelVersion("j", 1, digest, None, None, 3.0), attempt, {}, final=False)
    with pytest.raises(LeadershipLost):
        store.add_seated("j", 2, [("d", "t")])
    store.close()
    successor = Store(tmp_path / "second", postgres_url, epoch=2)  # its own disk: the blob comes from the database
    try:
        assert successor.job("j").committed_round == 0
        assert successor.read_blob(digest) == b"round one"
        successor.commit_round(ModelVersion("j", 1, digest, None, None, 3.0), attempt, {}, final=True)
        assert successor.job("j").state == "SUCCEEDED"
    finally:
        successor.close()
        second.close()


def _lead_within(leadership: Leadership, seconds: float) -> int:
    """Try for the lead as a follower does, until the server has released the old session's lock."""
    deadline = time.monotonic() + seconds
    while (epoch := leadership.try_lead()) is None:
        assert time.monotonic() < deadline, f"no lead within {seconds} s"
        time.sleep(0.05)
    return epoch


def test_a_leader_that_stops_hands_over_at_once(postgres_url):
    first, second = Leadership(postgres_url), Leadership(postgres_url)
    assert first.try_lead() == 1 and second.try_lead() is None
    first.close()  # a graceful stop unlocks before its session ends
    assert second.try_lead() == 2
    second.close()


def test_the_replicas_alive_are_those_with_a_recent_heartbeat(postgres_url):
    first, second = Leadership(postgres_url), Leadership(postgres_url)
    try:
        first.heartbeat("10.0.0.1:7000")
        second.heartbeat("10.0.0.2:7000")
        second.heartbeat("10.0.0.2:7000")  # again: one row per replica
        assert first.replicas_alive(60.0) == {"10.0.0.1:7000", "10.0.0.2:7000"}
        # The second's last heartbeat ages past the window (by the server's clock, as time would).
        second._db.execute("UPDATE replicas SET seen_at = seen_at - 100 WHERE address = ?", ("10.0.0.2:7000",))
        assert first.replicas_alive(60.0) == {"10.0.0.1:7000"}
    finally:
        first.close()
        second.close()


def test_replicas_starting_at_once_create_the_schema_once(tmp_path, postgres_url):
    errors: list[BaseException] = []
    together = threading.Barrier(6)

    def start(i: int) -> None:
        together.wait(30)
        try:
            Leadership(postgres_url).close()
        except BaseException as exc:  # noqa: BLE001 - collected for the assertion
            errors.append(exc)

    threads = [threading.Thread(target=start, args=(i,)) for i in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []


# -- replicas as processes ----------------------------------------------------------------------


def _logged(process: Process, event: str) -> list[dict]:
    """The structured records of ``event`` in a process's log, across its restarts."""
    lines = [line for line in process.log.read_text().splitlines() if line.startswith("{")]
    return [record for record in map(json.loads, lines) if record.get("event") == event]


async def _until(predicate, seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while not await asyncio.to_thread(predicate):
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {seconds} s: {what}")
        await asyncio.sleep(0.1)


def test_a_job_survives_its_leader_killed_mid_round(tmp_path, postgres_url):
    """Two replicas over one database, TLS everywhere; devices reach only the follower, whose
    front forwards the job's calls to the leader. The leader is killed as round 1 commits: the
    follower takes the lead on its own port, resumes the job, and every round commits with every
    cohort sum exact; the killed replica, started again, follows."""
    cluster = ProcessCluster(tmp_path, aggregators=2, replicas=2, database_url=postgres_url)
    first, second = cluster.processes["coordinator"], cluster.processes["coordinator-2"]
    first_port, second_port = cluster.ports["coordinator"], cluster.ports["coordinator-2"]

    async def main() -> None:
        try:
            for name in ("aggregator-1", "aggregator-2", "coordinator"):
                await cluster.restart(name)
            await _until(lambda: _logged(first, "replica leading"), 60, "the first replica leads")
            await cluster.restart("coordinator-2")
            await _until(lambda: _logged(second, "replica following"), 60, "the second replica follows")
            token = (cluster.state / "admin.token").read_text().strip()
            # A follower's directory holds the same token: an operator reads it from any replica.
            assert (tmp_path / "state-2" / "admin.token").read_text().strip() == token
            admin = admin_pb2_grpc.AdminStub(open_channel(f"127.0.0.1:{second_port}", cluster.tls))
            md = bearer_metadata(token)
            # Submitted through the follower: the Admin API is forwarded to the leader.
            job_id = (await asyncio.to_thread(admin.SubmitJob, admin_pb2.SubmitJobRequest(
                spec_yaml=spec("replicas", rounds=3, cohort=10)), metadata=md, timeout=10)).job_id
            devices, _ = trainers(12)
            # The enrolment key made once, shared by both replicas as a Secret would be.
            fleet = Fleet(f"127.0.0.1:{second_port}", cluster.tls, devices, enrolment_key=cluster.enrolment_key,
                          seed=1, audit=True)

            def committed(round_: int):
                return lambda: admin.GetJob(admin_pb2.GetJobRequest(job_id=job_id), metadata=md,
                                            timeout=10).committed_round >= round_

            async def kill_the_leader() -> None:
                await _until(committed(1), TIMEOUT, "round 1 commits")
                await cluster.kill("coordinator")

            try:
                await asyncio.gather(kill_the_leader(), fleet.run(
                    until=fleet.until_job_done(job_id, every_seconds=0.2)))
                await cluster.restart("coordinator")  # as its supervisor would: it follows the new leader now
                await _until(lambda: len(_logged(first, "replica following")) == 1, 60, "the old leader follows")
                job = await asyncio.to_thread(admin.GetJob, admin_pb2.GetJobRequest(job_id=job_id), metadata=md,
                                              timeout=10)
                assert job.state == common_pb2.JOB_STATE_SUCCEEDED, job.message
                assert job.committed_round == 3
                assert [r["epoch"] for r in _logged(second, "replica leading")] == [2]
                # What Prometheus sees: the new leader plans rounds, the restarted replica does not.
                leader = scrape_text(_logged(second, "coordinator serving")[-1]["metrics_port"])
                follower = scrape_text(_logged(first, "device front serving")[-1]["metrics_port"])
                assert "tally_coordinator_leader 1.0" in leader.splitlines()
                assert "tally_coordinator_leader 0.0" in follower.splitlines()
                # It counts both replicas alive (their heartbeats, each second), to pace what the
                # other forwards; the follower does not count.
                leader_port = _logged(second, "coordinator serving")[-1]["metrics_port"]
                await _until(lambda: "tally_coordinator_replicas 2.0" in scrape_text(leader_port).splitlines(),
                             10, "the leader counts two replicas alive")
                assert "tally_coordinator_replicas" not in follower
                checks = await check_committed(admin_pb2_grpc.AdminStub(
                    open_aio_channel(f"127.0.0.1:{first_port}", cluster.tls)), md, SumAudit.of(fleet.inputs))
                assert outcome_counts(checks)[EXACT] == len(checks) >= 3
            finally:
                fleet.close()
        finally:
            await cluster.stop()

    asyncio.run(asyncio.wait_for(main(), TIMEOUT))



@pytest.mark.parametrize("argv, named", [
    (["--database", "mysql://db/tally"], "--database: expected a postgresql:// URL"),
    (["--database-file", "{tmp}/no-such-file"], "--database-file"),
    (["--database", "postgresql://db/tally", "--internal-listen", "0.0.0.0:7010"], "--advertise"),
])
def test_replica_flags_are_checked_before_anything_starts(tmp_path, capsys, argv, named):
    from tally.cli import main as tally

    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    code = tally(["coordinator", "--state-dir", str(tmp_path / "state"), "--insecure", *argv])
    assert code == 2
    assert named in capsys.readouterr().err
    assert not (tmp_path / "state").exists()


def test_a_replica_whose_database_is_unreachable_says_so(tmp_path, capsys):
    from tally.cli import main as tally

    port = free_port()  # nothing listens there
    code = tally(["coordinator", "--state-dir", str(tmp_path / "state"), "--insecure", "--listen",
                  "127.0.0.1:0", "--internal-listen", "127.0.0.1:0",
                  "--database", f"postgresql://tally@127.0.0.1:{port}/tally?connect_timeout=5"])
    assert code == 1
    err = capsys.readouterr().err
    assert err.startswith("tally coordinator: the database:") and "Traceback" not in err


def test_a_leader_paces_what_the_other_replicas_forward(tmp_path):
    """The rate is per replica: the leader paces its own devices at it, and the check-ins other
    replicas' fronts forward (devices of a population with a job) at one replica's rate more
    until it has counted the replicas alive, then at their combined rate."""
    from tally.coordinator.service import CoordinatorService
    from tally.security import TLSConfig

    leader = CoordinatorService("127.0.0.1:0", TLSConfig.plaintext(), tmp_path / "state", [], checkin_rate=100.0,
                                database_url="postgresql://db/tally", internal_listen="127.0.0.1:0")
    assert leader.pacer.rate_per_s == 100.0 and leader.forwarded_pacer.rate_per_s == 100.0
    with_fronts = CoordinatorService("127.0.0.1:0", TLSConfig.plaintext(), tmp_path / "state", [], checkin_rate=100.0,
                                     device_processes=4, database_url="postgresql://db/tally",
                                     internal_listen="127.0.0.1:0")
    assert with_fronts.pacer.rate_per_s == 25.0 and with_fronts.forwarded_pacer.rate_per_s == 175.0
    for others, forwarded in ((3, 300.0), (0, None), (2, 200.0)):
        leader.pace_replicas(others)
        assert leader.forwarded_pacer.rate_per_s == forwarded and leader.pacer.rate_per_s == 100.0
    with_fronts.pace_replicas(2)
    assert with_fronts.forwarded_pacer.rate_per_s == 275.0


def test_a_follower_before_any_leader_announced_tells_devices_to_retry(tmp_path, postgres_url):
    """A leader that has taken the lock but not yet announced its internal port: a follower's
    front answers what it would forward with UNAVAILABLE (devices retry), and serves the rest."""
    from tally.coordinator.service import CoordinatorService
    from tally.security import TLSConfig
    from tally.wire.v1 import coordinator_pb2, coordinator_pb2_grpc

    leadership = Leadership(postgres_url)
    assert leadership.try_lead() == 1  # and nothing announced
    template = CoordinatorService("127.0.0.1:0", TLSConfig.plaintext(), tmp_path / "state", [],
                                  database_url=postgres_url, internal_listen="127.0.0.1:0")

    async def main():
        async with in_process() as services:
            front, port = await services.front(template.front_config(0, "127.0.0.1:0", coordinator=""))
            channel = open_aio_channel(f"127.0.0.1:{port}", TLSConfig.plaintext())
            stub = coordinator_pb2_grpc.CoordinatorStub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as forwarded:
                await stub.RoundStatus(coordinator_pb2.RoundStatusRequest(job_id="j"), timeout=10)
            with pytest.raises(grpc.aio.AioRpcError) as answered:  # its own: a check-in without a token
                await stub.CheckIn(coordinator_pb2.CheckInRequest(), timeout=10)
            await channel.close()
            return forwarded.value, answered.value, front.target

    try:
        forwarded, answered, target = asyncio.run(asyncio.wait_for(main(), 60))
    finally:
        leadership.close()
    assert forwarded.code() == grpc.StatusCode.UNAVAILABLE and "no coordinator replica leads" in forwarded.details()
    assert answered.code() == grpc.StatusCode.UNAUTHENTICATED
    assert target is None
