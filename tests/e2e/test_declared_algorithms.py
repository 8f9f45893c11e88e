"""Issue 41: devices declare the algorithms and model kinds they have installed and what their
trainer offers, and the real coordinator seats a device only in jobs it can run: a fleet with
another version of the job's algorithm or model kind, or whose trainer lacks a capability the
algorithm needs, is never selected while one with them completes the job, ``tally job status``
counts the able devices, and a job no device of its population can run fails at its first
selection deadline naming what the devices lack."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from support.stack import in_process, run, trainers
from tally import models
from tally.algorithms import packages
from tally.cli.job import job_dict, show
from tally.wire.v1 import common_pb2, coordinator_pb2
from tally.wire.v1.coordinator_pb2 import Capabilities, InstalledAlgorithm, InstalledModel

SPEC = (
    "name: declared\nalgorithm: fedavg\nrounds: 1\ncohort_size: 5\nmin_cohort: 5\nretries: 3\n"
    "model: {inputs: 64, classes: 10, hidden: 16, seed: 0}\n"
    "options: {local_epochs: 1, local_lr: 0.1, batch_size: 16}\n"
    "deadlines: {checkin: 4, download: 10, advertise_keys: 4, share_keys: 4, masked_input: 8, unmask: 4}\n"
)
OLD = {"fedavg": "0.0.9"}
OLD_MLP = {"mlp": "0.0.9"}
# AgnosticFedAvg needs trainers that answer domain statistics; its model is the toy regression's.
AGNOSTIC_SPEC = (
    "name: needs\nalgorithm: agnostic_fedavg\nrounds: 1\ncohort_size: 5\nmin_cohort: 5\nretries: 3\n"
    "model: {kind: toy-scalar}\n"
    "options: {domains: 3, local_lr: 0.1, batch_size: 20, loss_clip: 1000000.0, loss_frac_bits: 4, delta_clip: 16}\n"
    "deadlines: {checkin: 4, download: 10, advertise_keys: 4, share_keys: 4, masked_input: 8, unmask: 4}\n"
)


@pytest.fixture
def toy_scalar():
    """The toy regression's model, registered in this (the coordinator's) process only."""
    import numpy as np

    from tally.coordinator.spec import catalogue
    from tally.datasets.toy_regression import toy_regression

    catalogue.register_model("toy-scalar", lambda _spec: {"w": np.array([5.0])})
    try:
        yield toy_regression(clients=12, domains=3, samples_per_client=20, seed=0).devices(0)
    finally:
        catalogue.unregister_model("toy-scalar")


def beside(tmp_path, spec: str, able: list, other: list, prefix: str, lacking: dict):
    """Run a job of ``spec`` with a fleet of ``able`` devices beside one of ``other`` devices that
    declare ``lacking``, until it ends: the ended job and both fleets' stats."""

    async def main():
        async with in_process().whole_system(tmp_path) as s:
            job_id = await s.submit(spec)
            with_it = s.fleet(able, seed=1, id_prefix="with")
            without = s.fleet(other, seed=2, id_prefix=prefix, **lacking)
            try:
                stats = await asyncio.gather(
                    with_it.run(until=with_it.until_job_done(job_id, every_seconds=0.2)),
                    without.run(until=without.until_job_done(job_id, every_seconds=0.2)))
            finally:
                with_it.close()
                without.close()
            return await s.job(job_id), stats

    return run(main())


@pytest.mark.parametrize("lacking", [{"algorithms": OLD}, {"model_kinds": OLD_MLP}, {"model_kinds": {}}],
                         ids=["algorithm-version", "model-version", "no-model"])
def test_only_devices_with_the_jobs_algorithm_and_model_versions_are_seated(tmp_path, lacking):
    able, _ = trainers(6)
    other, _ = trainers(6, seed=50)

    job, (with_stats, without_stats) = beside(tmp_path, SPEC, able, other, "old", lacking)
    assert job.state == common_pb2.JOB_STATE_SUCCEEDED, job.message
    assert with_stats.sessions_completed >= 5
    assert without_stats.tasks_done == 0 and without_stats.checkins > 0  # checked in, never seated


def test_a_fleet_whose_trainer_lacks_what_the_algorithm_needs_is_not_selected(tmp_path, toy_scalar):
    """The toy regression's devices answer domain statistics; the same devices declaring no trainer
    capability are never seated in an AgnosticFedAvg job, which the others complete."""

    job, (with_stats, without_stats) = beside(tmp_path, AGNOSTIC_SPEC, toy_scalar[:6], toy_scalar[6:], "plain",
                                              {"trainer_capabilities": ()})
    assert job.state == common_pb2.JOB_STATE_SUCCEEDED, job.message
    assert with_stats.sessions_completed >= 5
    assert without_stats.tasks_done == 0 and without_stats.checkins > 0  # checked in, never seated


def fails_fast(tmp_path, spec: str, devices, **lacking):
    """Run ``devices`` declaring ``lacking`` against a job of ``spec`` until it ends: the ended job,
    and its status once all six devices had checked in, while it still ran."""

    async def main():
        async with in_process().whole_system(tmp_path) as s:
            job_id = await s.submit(spec)
            fleet = s.fleet(devices, seed=1, **lacking)
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

    job, [running] = run(main())
    assert job.state == common_pb2.JOB_STATE_FAILED
    assert len(job.attempts) == 1  # the first selection deadline, no retry spent
    return job, running


def test_a_job_no_device_can_run_fails_fast_naming_algorithm_and_versions(tmp_path):
    version = packages.versions()["fedavg"]
    mlp = models.versions()["mlp"]
    job, running = fails_fast(tmp_path, SPEC, trainers(6)[0], algorithms=OLD)
    assert (f"no device of population 'default' can run algorithm 'fedavg' version '{version}': "
            "6 device(s) checked in (version '0.0.9' on 6)") in job.message, job.message
    assert (running.algorithm_version, running.able_devices, running.declared_devices) == (version, 0, 6)
    assert f"devices able to run fedavg {version} on model mlp {mlp}: 0 of 6 checked in" in show(job_dict(running))


def test_a_job_no_device_has_the_model_of_fails_fast_naming_model_and_versions(tmp_path):
    mlp = models.versions()["mlp"]
    job, running = fails_fast(tmp_path, SPEC, trainers(6)[0], model_kinds=OLD_MLP)
    assert (f"no device of population 'default' can run model kind 'mlp' version '{mlp}': 6 device(s) checked "
            "in (version '0.0.9' on 6)") in job.message, job.message
    assert (running.model_kind, running.model_kind_version, running.able_devices) == ("mlp", mlp, 0)


def test_a_job_whose_algorithm_needs_what_no_trainer_offers_fails_fast_naming_it(tmp_path, toy_scalar):
    job, running = fails_fast(tmp_path, AGNOSTIC_SPEC, toy_scalar[:6], trainer_capabilities=())
    assert ("no device of population 'default' offers trainer capability 'domain_statistics', which algorithm "
            "'agnostic_fedavg' needs: 6 device(s) checked in (none declares it)") in job.message, job.message
    assert list(running.needs) == ["domain_statistics"] and running.able_devices == 0
    assert "with trainer capability domain_statistics: 0 of 6 checked in" in show(job_dict(running))


def test_a_check_in_declaring_too_much_or_a_nameless_algorithm_or_model_is_refused_by_field(tmp_path):
    async def main():
        async with in_process().coordinator_with_fakes(tmp_path) as s:
            [device] = await s.devices(1)
            answers = []
            many = [InstalledAlgorithm(name=f"a{i}", version="1") for i in range(65)]
            for declared in (Capabilities(algorithms=[InstalledAlgorithm(name="", version="1")]),
                             Capabilities(algorithms=many),
                             Capabilities(algorithms=[InstalledAlgorithm(name="fedavg", version="1")],
                                          models=[InstalledModel(name="mlp", version="")])):
                request = coordinator_pb2.CheckInRequest(capabilities=declared)
                try:
                    await device.stub.CheckIn(request, metadata=device.md, timeout=5)
                except grpc.aio.AioRpcError as exc:
                    answers.append((exc.code(), exc.details()))
            return answers

    (empty, many, model) = run(main())
    assert empty[0] == many[0] == model[0] == grpc.StatusCode.INVALID_ARGUMENT
    assert empty[1].startswith("capabilities.algorithms: '' version '1' needs a name and a version")
    assert many[1] == "capabilities.algorithms: 65 declared, at most 64"
    assert model[1].startswith("capabilities.models: 'mlp' version '' needs a name and a version")
