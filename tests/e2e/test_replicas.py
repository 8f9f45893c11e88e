"""Coordinator replicas over PostgreSQL (issue 28): the store on a real PostgreSQL server answers
as the embedded SQLite one does, one replica leads (an advisory lock) and the others follow as
device fronts, a new leader fences the old one's writes, and a job survives its leader killed
mid-round: a follower takes over, resumes it from the store, and every cohort sum stays exact.
Issue 38: a leader paused past its lease (SIGSTOP, its connections open) is replaced, and when it
resumes it commits, seats and opens nothing."""

from __future__ import annotations

import asyncio
import json
import re
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
    store.add_seated("job-0", 1, [("d1", "t1"), ("d2", "t2"), ("d3", "t3")], {"d3": "ledger-3"})
    store.add_seated("job-0", 1, [("d1", "t4")])  # a later attempt's task replaces the seat's
    released = store.release_seats("job-0", 1, [("d2", "t2"), ("d1", "t1")])
    released_device = store.release_device("job-0", 1, "d3", "ledger-3")
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
    assert second.try_lead() is None and not second.renew()
    store = Store(tmp_path / "first", postgres_url, epoch=1)
    digest = store.put_blob(b"round one", "model")
    store.create_job("j", "j", "fedavg", "pop", "spec", 1.0)
    attempt = store.start_attempt("j", 1, 2.0)
    first._db.conn.close()  # its session ends, as a killed process's does, without unlocking
    assert _lead_within(second, 10.0) == 2 and second.renew()
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


def test_a_leader_paused_past_its_lease_is_replaced_and_every_write_it_tries_is_refused(tmp_path, postgres_url):
    """A leader that stops renewing while its connections stay open (a paused process: the kernel
    keeps its sockets alive) keeps the lock, so only its lease lets another take over; then none of
    its store's writes goes through, whatever the write, and each refusal tells the replica."""
    paused, successor = Leadership(postgres_url, lease_s=2.0), Leadership(postgres_url, lease_s=2.0)
    assert paused.try_lead() == 1 and paused.renew()
    lost: list[bool] = []
    store = Store(tmp_path / "paused", postgres_url, epoch=1, on_leadership_lost=lambda: lost.append(True))
    store.create_job("j", "j", "fedavg", "pop", "spec", 1.0)
    attempt = store.start_attempt("j", 1, 2.0)
    store.add_seated("j", 1, [("d", "t")])
    assert successor.try_lead() is None  # the lease still runs: nobody takes over
    assert _lead_within(successor, 10.0) == 2  # it ran out unrenewed: the holder's session was ended
    assert not paused.renew()  # resumed, it finds it lost the lead
    digest = store.put_blob(b"model", "model")  # content-addressed: not fenced, referenced by nothing
    writes = {
        "commit": lambda: store.commit_round(ModelVersion("j", 1, digest, None, None, 3.0), attempt, {}, final=True),
        "seat": lambda: store.add_seated("j", 1, [("e", "u")]),
        "sessions": lambda: store.set_attempt_sessions("j", 1, attempt, [{"aggregator_id": "a", "session_id": "s"}]),
        "attempt": lambda: store.start_attempt("j", 1, 3.0),
        "fail attempt": lambda: store.finish_attempt("j", 1, attempt, 3.0, "stale"),
        "job state": lambda: store.set_job_state("j", "FAILED", 3.0, "stale"),
        "job": lambda: store.create_job("k", "k", "fedavg", "pop", "spec", 3.0),
        "release": lambda: store.release_seats("j", 1, [("d", "t")]),
        "release device": lambda: store.release_device("j", 1, "d", "ledger"),
        "report": lambda: store.count_task_report("j", 1, "failed", "oom"),
        "silo": lambda: store.silo("j", "d", 3),
        "version": lambda: store.add_model_version(ModelVersion("j", 0, digest, None, None, 3.0)),
        "sum": lambda: store.add_cohort_sum("j", 1, attempt, CohortSumRecord("s", "u", 0, 32, (1,), (1,))),
    }
    for what, write in writes.items():
        with pytest.raises(LeadershipLost):
            write()
        assert len(lost) == 1, what
        lost.clear()
    store.close()
    after = Store(tmp_path / "successor", postgres_url, epoch=2)
    try:  # nothing of the paused leader's changed: its attempt runs, its seat holds, no job k
        assert [(r.attempt, r.state) for r in after.rounds("j")] == [(attempt, "running")]
        assert after.seated("j", 1) == {"d"} and after.job("k") is None and after.job("j").state == "PENDING"
        assert after.start_attempt("j", 1, 4.0) == attempt + 1  # the successor writes
        epochs = after._db.execute("SELECT attempt, epoch FROM rounds WHERE job_id = 'j' ORDER BY attempt").fetchall()
        assert [tuple(row) for row in epochs] == [(attempt, 1), (attempt + 1, 2)]
    finally:
        after.close()
        successor.close()
        paused.close()


def test_a_leader_paused_inside_a_write_does_not_hold_up_its_successor(tmp_path, postgres_url):
    """Its open transaction holds the leader row, which the successor's epoch increment must wait
    for: the server ends the idle transaction, so the takeover completes and the write is lost."""
    paused, successor = Leadership(postgres_url, lease_s=2.0), Leadership(postgres_url, lease_s=2.0)
    assert paused.try_lead() == 1
    store = Store(tmp_path / "paused", postgres_url, epoch=1)
    store.create_job("j", "j", "fedavg", "pop", "spec", 1.0)
    with pytest.raises(store._db.errors):
        with store._write():  # paused halfway: the fence passed, the write is not yet committed
            store._db.execute("UPDATE jobs SET state = 'RUNNING' WHERE job_id = 'j'")
            assert _lead_within(successor, 30.0) == 2
    store.close()
    after = Store(tmp_path / "successor", postgres_url, epoch=2)
    try:
        assert after.job("j").state == "PENDING"
    finally:
        after.close()
        successor.close()
        paused.close()


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


LEASE_S = 3.0


def test_a_leader_paused_past_its_lease_commits_seats_and_opens_nothing_when_it_resumes(tmp_path, postgres_url):
    """The leader is SIGSTOPped mid-round (its sessions open, its devices seated, its attempt
    running; a cohort of 5 of 12 devices, so that the round's retry has devices it may seat) with
    its connections left open; the follower takes over once the lease runs out,
    fences the aggregator and commits the round. Then the old leader gets SIGCONT and carries
    on where it stopped: it writes nothing (its attempts, commits and seats are those of before the
    pause, and its log shows no commit), the aggregator opens no session of its epoch, and it
    stops. The job ends with every round committed once and every cohort sum exact."""
    cluster = ProcessCluster(tmp_path, aggregators=1, replicas=2, database_url=postgres_url,
                             coordinator_flags=["--leader-lease", str(LEASE_S)])
    first, second = cluster.processes["coordinator"], cluster.processes["coordinator-2"]
    aggregator = cluster.processes["aggregator-1"]
    second_port = cluster.ports["coordinator-2"]

    def rounds_of(epoch: int) -> list[tuple]:
        with cluster.database() as db:
            return [tuple(row) for row in db.execute(
                "SELECT job_id, round, attempt, state, message FROM rounds WHERE epoch = ? "
                "ORDER BY job_id, round, attempt", (epoch,)).fetchall()]

    def seats_of(attempts: set[tuple]) -> set[tuple]:
        """The seats of these (job, round, attempt)s: a task id starts with its round and attempt."""
        with cluster.database() as db:
            rows = db.execute("SELECT job_id, round, device_id, task_id FROM seated").fetchall()
        return {tuple(row) for row in rows
                if (row[0], *map(int, re.match(r"r(\d+)a(\d+)-", row[3]).groups())) in attempts}

    async def main() -> None:
        try:
            for name in ("aggregator-1", "coordinator"):
                await cluster.restart(name)
            await _until(lambda: _logged(first, "replica leading"), 60, "the first replica leads")
            await cluster.restart("coordinator-2")
            await _until(lambda: _logged(second, "replica following"), 60, "the second replica follows")
            token = (cluster.state / "admin.token").read_text().strip()
            admin = admin_pb2_grpc.AdminStub(open_channel(f"127.0.0.1:{second_port}", cluster.tls))
            md = bearer_metadata(token)
            job_id = (await asyncio.to_thread(admin.SubmitJob, admin_pb2.SubmitJobRequest(
                spec_yaml=spec("paused", rounds=4, cohort=5)), metadata=md, timeout=10)).job_id
            devices, _ = trainers(12)
            fleet = Fleet(f"127.0.0.1:{second_port}", cluster.tls, devices, enrolment_key=cluster.enrolment_key,
                          seed=3, audit=True)

            def job() -> admin_pb2.Job | None:
                try:
                    return admin.GetJob(admin_pb2.GetJobRequest(job_id=job_id), metadata=md, timeout=5)
                except grpc.RpcError:  # forwarded to a paused leader, or none leads yet
                    return None

            def aggregating() -> bool:
                j = job()
                return j is not None and j.committed_round >= 1 and j.phase == common_pb2.ROUND_PHASE_AGGREGATION

            async def pause_the_leader_then_resume_it() -> dict:
                await _until(aggregating, TIMEOUT, "the leader aggregates a round after round 1")
                first.pause()
                seen: dict = {"rounds": rounds_of(1), "commits": len(_logged(first, "round committed"))}
                assert any(state == "running" for *_, state, _ in seen["rounds"])  # caught mid-attempt
                committed = max(r for _, r, _, state, _ in seen["rounds"] if state == "committed")
                await _until(lambda: _logged(second, "replica leading"), 60, "the follower takes over")
                await _until(lambda: (j := job()) is not None and j.committed_round > committed, TIMEOUT,
                             "the new leader commits the paused leader's round")
                # The paused leader's attempt was ended by its successor, before it resumes.
                seen["rounds"] = rounds_of(1)
                assert not any(state == "running" for *_, state, _ in seen["rounds"])
                assert "tally_aggregator_coordinator_leader_epoch 2.0" in cluster.scrape("aggregator-1").splitlines()
                seen["seats"] = seats_of({(j, r, a) for j, r, a, *_ in seen["rounds"]})
                first.resume()
                await _until(lambda: not first.running, 60, "the resumed leader stops")
                return seen

            try:
                seen, _ = await asyncio.gather(pause_the_leader_then_resume_it(), fleet.run(
                    until=fleet.until_job_done(job_id, every_seconds=0.2)))
                # It committed nothing, started and ended no attempt, seated nobody.
                assert first.exit_code() == 1
                assert [r["why"] for r in _logged(first, "replica lost the lead; stopping")] in (
                    ["a write of its store was refused"], ["its lease was not renewed"])
                assert len(_logged(first, "round committed")) == seen["commits"]
                assert rounds_of(1) == seen["rounds"]
                assert seats_of({(j, r, a) for j, r, a, *_ in seen["rounds"]}) <= seen["seats"]
                # The aggregator opened no session of epoch 1 once fenced with epoch 2.
                records = [r for r in map(json.loads, (line for line in aggregator.log.read_text().splitlines()
                                                       if line.startswith("{")))
                           if r.get("event") in ("session opened", "coordinator leader fenced")]
                fenced = next(i for i, r in enumerate(records)
                              if r["event"] == "coordinator leader fenced" and r["leader_epoch"] == 2)
                assert not [r for r in records[fenced:] if r["event"] == "session opened" and r["leader_epoch"] < 2]
                assert any(r["event"] == "session opened" and r["leader_epoch"] == 1 for r in records[:fenced])
                final = job()
                assert final is not None and final.state == common_pb2.JOB_STATE_SUCCEEDED, final
                with cluster.database() as db:
                    committed = db.execute("SELECT round, COUNT(*) FROM rounds WHERE job_id = ? AND state = "
                                           "'committed' GROUP BY round ORDER BY round", (job_id,)).fetchall()
                assert [tuple(row) for row in committed] == [(1, 1), (2, 1), (3, 1), (4, 1)]
                checks = await check_committed(admin_pb2_grpc.AdminStub(
                    open_aio_channel(f"127.0.0.1:{second_port}", cluster.tls)), md, SumAudit.of(fleet.inputs))
                assert outcome_counts(checks)[EXACT] == len(checks) >= 4
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
