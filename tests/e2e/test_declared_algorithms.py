"""Issue 41: devices declare the algorithms they have installed, and the real coordinator seats a
device only in jobs it can run: a fleet with another version of the job's algorithm is never
selected while one with it completes the job, ``tally job status`` counts the able devices, and a
job no device of its population can run fails at its first selection deadline naming the
algorithm, its version and what the devices have."""

from __future__ import annotations

import asyncio

import grpc

from support.stack import in_process, run, trainers
from tally.algorithms import packages
from tally.cli.job import job_dict, show
from tally.wire.v1 import common_pb2, coordinator_pb2
from tally.wire.v1.coordinator_pb2 import InstalledAlgorithm

SPEC = (
    "name: declared\nalgorithm: fedavg\nrounds: 1\ncohort_size: 5\nmin_cohort: 5\nretries: 3\n"
    "model: {inputs: 64, classes: 10, hidden: 16, seed: 0}\n"
    "options: {local_epochs: 1, local_lr: 0.1, batch_size: 16}\n"
    "deadlines: {checkin: 4, download: 10, advertise_keys: 4, share_keys: 4, masked_input: 8, unmask: 4}\n"
)
OLD = {"fedavg": "0.0.9"}


def test_only_devices_with_the_jobs_algorithm_version_are_seated(tmp_path):
    able, _ = trainers(6)
    other, _ = trainers(6, seed=50)

    async def main():
        async with in_process().whole_system(tmp_path) as s:
            job_id = await s.submit(SPEC)
            with_it = s.fleet(able, seed=1, id_prefix="with")
            without = s.fleet(other, seed=2, id_prefix="old", algorithms=OLD)
            try:
                stats = await asyncio.gather(
                    with_it.run(until=with_it.until_job_done(job_id, every_seconds=0.2)),
                    without.run(until=without.until_job_done(job_id, every_seconds=0.2)))
            finally:
                with_it.close()
                without.close()
            return await s.job(job_id), stats

    job, (with_stats, without_stats) = run(main())
    assert job.state == common_pb2.JOB_STATE_SUCCEEDED, job.message
    assert with_stats.sessions_completed >= 5
    assert without_stats.tasks_done == 0 and without_stats.checkins > 0  # checked in, never seated


def test_a_job_no_device_can_run_fails_fast_naming_algorithm_and_versions(tmp_path):
    old, _ = trainers(6)
    version = packages.versions()["fedavg"]

    async def main():
        async with in_process().whole_system(tmp_path) as s:
            job_id = await s.submit(SPEC)
            fleet = s.fleet(old, seed=1, algorithms=OLD)
            seen: list = []

            async def counted(stats) -> bool:
                job = await s.job(job_id)
                if job.declared_devices == 6 and not seen:
                    seen.append(job)
                return job.state in (common_pb2.JOB_STATE_FAILED, common_pb2.JOB_STATE_SUCCEEDED)

            try:
                await fleet.run(until=counted)
            finally:
                fleet.close()
            return await s.job(job_id), seen

    job, seen = run(main())
    assert job.state == common_pb2.JOB_STATE_FAILED
    assert (f"no device of population 'default' can run algorithm 'fedavg' version '{version}': "
            "6 device(s) checked in (version '0.0.9' on 6)") in job.message, job.message
    assert len(job.attempts) == 1  # the first selection deadline, no retry spent
    [running] = seen
    assert (running.algorithm_version, running.able_devices, running.declared_devices) == (version, 0, 6)
    assert f"devices able to run fedavg {version}: 0 of 6 checked in" in show(job_dict(running))


def test_a_check_in_declaring_too_much_or_a_nameless_algorithm_is_refused_by_field(tmp_path):
    async def main():
        async with in_process().coordinator_with_fakes(tmp_path) as s:
            [device] = await s.devices(1)
            answers = []
            for declared in ([InstalledAlgorithm(name="", version="1")],
                             [InstalledAlgorithm(name=f"a{i}", version="1") for i in range(65)]):
                request = coordinator_pb2.CheckInRequest(capabilities=coordinator_pb2.Capabilities(algorithms=declared))
                try:
                    await device.stub.CheckIn(request, metadata=device.md, timeout=5)
                except grpc.aio.AioRpcError as exc:
                    answers.append((exc.code(), exc.details()))
            return answers

    (empty, many) = run(main())
    assert empty[0] == many[0] == grpc.StatusCode.INVALID_ARGUMENT
    assert empty[1].startswith("capabilities.algorithms: '' version '1' needs a name and a version")
    assert many[1] == "capabilities.algorithms: 65 declared, at most 64"
