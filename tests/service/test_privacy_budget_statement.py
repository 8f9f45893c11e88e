"""What the coordinator does with a device's statement that its own privacy budget is spent for
a job (``CheckInRequest.privacy_budget_spent``, issue 42): it stops selecting the device for that
job, counts it (``tally job status``, ``tally_coordinator_devices_out_of_budget``), fails the job
as soon as fewer than ``min_cohort`` of the population remain eligible, and refuses a malformed
statement. Real coordinator, fake aggregators, devices scripted over the device API."""

from __future__ import annotations

import re

import grpc
import pytest

from support.coordinator import spec_yaml
from support.stack import in_process, run, scrape_text
from tally.cli.job import job_dict, show
from tally.wire.task_reports import MAX_LEDGER_JOBS
from tally.wire.v1 import common_pb2, coordinator_pb2


def _statement(*jobs: str) -> coordinator_pb2.CheckInRequest:
    return coordinator_pb2.CheckInRequest(privacy_budget_spent=list(jobs))


def test_devices_out_of_budget_are_not_selected_are_counted_and_the_job_fails_fast(tmp_path):
    async def main():
        async with in_process().coordinator_with_fakes(tmp_path, aggregators=1) as s:
            devices = await s.devices(6)  # min_cohort 5: one device out leaves 5, two leave 4
            job_id = await s.submit(spec_yaml("budgets", cohort=6, extra="deadlines: {checkin: 30}\n"))
            spent = devices[0]
            answer = await spent.stub.CheckIn(_statement(job_id), metadata=spent.md, timeout=10)
            other_job = await spent.stub.CheckIn(_statement("no-such-job"), metadata=spent.md, timeout=10)
            counted = await s.job(job_id)
            gauge = scrape_text(s.service.metrics_port)
            second = devices[1]
            await second.stub.CheckIn(_statement(job_id), metadata=second.md, timeout=10)
            events = await s.until_done(job_id)
            return answer, other_job, counted, gauge, await s.job(job_id), events

    answer, other_job, counted, gauge, ended, _ = run(main())
    assert answer.WhichOneof("result") == "retry_after"  # an open selection, and no seat for it
    assert "privacy budget" in answer.retry_after.reason
    assert other_job.WhichOneof("result") == "retry_after"
    assert counted.devices_out_of_budget == 1
    assert "1 devices out of privacy budget (no longer selected)" in show(job_dict(counted))
    assert re.search(r'tally_coordinator_devices_out_of_budget\{job_id="budgets-[0-9a-f]+"\} 1\.0', gauge)
    assert ended.state == common_pb2.JOB_STATE_FAILED
    assert ended.message == ("out of eligible devices: 2 of the 6 devices of population 'default' have spent "
                             "their own privacy budget for this job, 4 remain, fewer than min_cohort 5")


@pytest.mark.parametrize("jobs", [[""], ["x" * 257], [f"job-{i}" for i in range(MAX_LEDGER_JOBS + 1)]])
def test_a_malformed_statement_is_refused_naming_the_field(tmp_path, jobs):
    async def main():
        async with in_process().coordinator_with_fakes(tmp_path, aggregators=1) as s:
            (device,) = await s.devices(1)
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await device.stub.CheckIn(_statement(*jobs), metadata=device.md, timeout=10)
            return refused.value

    error = run(main())
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error.details().startswith("privacy_budget_spent: at most")
