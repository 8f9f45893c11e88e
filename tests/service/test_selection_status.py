"""A selection you can see (issue 39, item 5): a job for a population with no devices showed only
`RUNNING ... (SELECTION)` for 80 s, then `round 1 failed after 1 attempt(s), retry budget 3 spent:
...`, a message that contradicts itself since each silent extension of the selection window spent
a retry. Now `tally job status` and `watch` say how many devices checked in and how many
extensions are spent, and the failure counts them. Real coordinator, fake aggregators."""

from __future__ import annotations

from support.coordinator import spec_yaml
from support.stack import in_process, run
from tally.cli.job import job_dict, show
from tally.wire.v1 import admin_pb2, common_pb2


def test_status_and_watch_show_the_selection_and_the_failure_counts_its_extensions(tmp_path):
    async def main():
        async with in_process().coordinator_with_fakes(tmp_path, aggregators=1) as s:
            job_id = await s.submit(spec_yaml("lonely", cohort=6, population="hospitals",
                                              extra="retries: 1\ndeadlines: {checkin: 3}\n"))
            stream = s.admin.WatchJob(admin_pb2.WatchJobRequest(job_id=job_id), metadata=s.admin_md)
            events, while_extended = [], None
            async for event in stream:
                events.append(event)
                if "(deadline extended 1 of 1)" in event.message and while_extended is None:
                    while_extended = await s.job(job_id)  # the reopened window lasts 3 s
            return events, while_extended, await s.job(job_id)

    events, while_extended, ended = run(main())
    messages = [e.message for e in events]
    first = "selection: 0/6 devices of population 'hospitals' checked in (deadline extended 0 of 1); at least 5 needed"
    assert any(m.startswith(first) for m in messages), messages
    assert any("the window reopens, spending a retry: selection: 0/6 devices of population 'hospitals' checked in "
               "(deadline extended 1 of 1)" in m for m in messages), messages
    assert while_extended is not None and while_extended.phase == common_pb2.ROUND_PHASE_SELECTION
    line = show(job_dict(while_extended))
    assert "selection: 0/6 devices of population 'hospitals' checked in (deadline extended 1 of 1)" in line
    assert ended.state == common_pb2.JOB_STATE_FAILED and not ended.selection
    assert ended.message.startswith("round 1 failed after 1 attempt(s) and 1 extension(s) of a selection window "
                                    "(retries: 1, each attempt after the first or extension spends one, none left): "
                                    "only 0 of the 5 devices needed checked in within 3 s"), ended.message
