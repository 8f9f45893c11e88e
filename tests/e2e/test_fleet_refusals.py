"""A device the coordinator refuses for good (a status retrying cannot fix: no enrolment
credential, a revoked device) stops alone. The rest of its fleet goes on; the fleet's statistics
count the refused devices and keep the first reason; ``tally fleet`` and ``tally client`` say why
in one line and exit 1, never with a traceback."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

from support.stack import in_process, run
from tally.loadtest.fleet import device_ids
from tally.loadtest.synthetic import SyntheticUpdates
from tally.ops.cluster import ProcessCluster
from tally.wire.v1 import admin_pb2, common_pb2

JOB = ("name: refusals\nalgorithm: fedavg\nrounds: 2\ncohort_size: 5\nover_selection: 1.0\nmin_cohort: 5\n"
       "retries: 2\nmodel: {inputs: 8, classes: 2, hidden: 4, seed: 0}\n"
       "deadlines: {checkin: 20, download: 10, advertise_keys: 10, share_keys: 10, masked_input: 10, unmask: 10}\n")


def test_a_revoked_device_stops_alone_and_the_rest_of_its_fleet_finishes_the_job(tmp_path):
    async def main():
        async with in_process().whole_system(tmp_path) as s:
            fleet = s.fleet([SyntheticUpdates(i, 1) for i in device_ids("sim", 6)], seed=1)
            try:
                # Every device enrols and checks in once (no job yet), then the operator revokes one.
                await fleet.run(until=lambda stats: stats.checkins >= 6)
                stub, md = s.admin()
                await asyncio.to_thread(stub.RevokeDevice, admin_pb2.RevokeDeviceRequest(device_id="sim-00000"),
                                        metadata=md, timeout=10)
                job_id = await s.submit(JOB)
                # Asked before the revoked device has learnt it is: the next device answers.
                asked_early = await fleet.until_job_done(job_id)(fleet.stats())
                stats = await fleet.run(until=fleet.until_job_done(job_id, every_seconds=0.2))
                refusals = {d.device_id: d.stats.refusal for d in fleet.devices}
            finally:
                fleet.close()
            return asked_early, stats, refusals, await s.job(job_id)

    asked_early, stats, refusals, job = run(main())
    assert asked_early is False
    assert job.state == common_pb2.JOB_STATE_SUCCEEDED, job
    assert stats.refused == 1 and stats.refusal.startswith("PERMISSION_DENIED") and "revoked" in stats.refusal
    assert refusals.pop("sim-00000") == stats.refusal and not any(refusals.values()), refusals
    assert "refused 1" in stats.summary() and "1 of 6 devices stopped" in stats.refusal_message()


def test_a_fleet_and_a_client_without_their_credentials_say_why_and_exit_1(tmp_path):
    """The coordinator requires enrolment; the operator forgot ``--enrolment-key`` (``tally
    fleet``, in one process and in two) or ``--credential`` (``tally client``)."""

    async def main():
        cluster = ProcessCluster(tmp_path / "cluster", aggregators=1)
        try:
            await cluster.start()
            common = ["--coordinator", cluster.target, "--tls-dir", str(cluster.certs / "device"), "--no-progress"]
            commands = {
                processes: ["fleet", *common, "--devices", "4", "--synthetic", "--stay", "--processes", str(processes),
                            "--json", str(tmp_path / f"fleet-{processes}.json")]
                for processes in (1, 2)
            }
            commands["client"] = ["client", *common, "--device-id", "lone", "--shard", "0", "--shards", "2",
                                  "--state-dir", str(tmp_path / "lone")]
            ended = {}
            for name, argv in commands.items():
                process = await asyncio.create_subprocess_exec(sys.executable, "-m", "tally.cli", *argv,
                                                               stdout=subprocess.PIPE, stderr=subprocess.PIPE)
                _, err = await asyncio.wait_for(process.communicate(), 120)
                ended[name] = process.returncode, err.decode()
            return ended
        finally:
            await cluster.stop()

    ended = asyncio.run(main())
    reason = "UNAUTHENTICATED: RegisterRequest.enrolment_credential is required"
    for name, (code, err) in ended.items():
        assert code == 1 and reason in err and "Traceback" not in err, (name, err)
    for processes in (1, 2):
        assert "4 of 4 devices stopped: the coordinator refused them" in ended[processes][1]
        report = json.loads((tmp_path / f"fleet-{processes}.json").read_text())
        assert report["refused"] == 4 and report["refusal"] == reason, report
    assert "tally client: the coordinator refused the device" in ended["client"][1]
