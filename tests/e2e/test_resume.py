"""Resume after an interruption (issue 25, item 1): the coordinator and the whole fleet stop in the
middle of a round, as `tally demo` does on SIGINT or SIGTERM, and start again from their state.

`tally demo --resume` used to fail every time: the restarted devices' task reports were lost with
them, so the coordinator could not tell which of the interrupted attempt's devices sent no input,
and the rule that a round's retry never reseats a device that may have sent one turned away
almost the whole population. Devices now state what their durable input ledger holds at each
check-in; the coordinator reseats those that provably sent nothing in the round.

Each test stops everything at one secure-aggregation phase (the first device message of that
phase to reach an aggregator is held there until the stop), resumes, and checks that the job
succeeds, every committed sum is exactly the sum of the inputs its contributors sent, and the
restart is logged, in the job's events and in `job status`.
"""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from support.stack import Stack, in_process, run, scrape_text, spec
from tally.aggregator import session as aggregator_session
from tally.cli.job import job_dict, show
from tally.loadtest.fleet import device_ids
from tally.loadtest.sum_audit import EXACT, FOREIGN, MISMATCH, SumAudit, check_committed, outcome_counts
from tally.loadtest.synthetic import SyntheticUpdates
from tally.secagg.messages import AdvertiseKeys, MaskedInputResponse, ShareKeysResponse, UnmaskResponse
from tally.wire.v1 import admin_pb2, admin_pb2_grpc, common_pb2

PHASES = {"advertise_keys": AdvertiseKeys, "share_keys": ShareKeysResponse,
          "masked_input": MaskedInputResponse, "unmask": UnmaskResponse}
COHORT, ROUNDS = 10, 2
SELECTION = 12  # COHORT with the spec's over-selection of 1.2
MIN_COHORT = 5  # test_full_stack.spec's


def _hold_first(monkeypatch, message_type: type) -> tuple[asyncio.Event, asyncio.Event]:
    """(reached, release): ``reached`` is set when the first device message of ``message_type``
    reaches an aggregator, which holds it until ``release`` is set."""
    reached, release = asyncio.Event(), asyncio.Event()
    real_submit = aggregator_session.Session.submit

    async def submit(self, index, message):
        if isinstance(message, message_type) and not reached.is_set():
            reached.set()
            await release.wait()
        return await real_submit(self, index, message)

    monkeypatch.setattr(aggregator_session.Session, "submit", submit)
    return reached, release


async def _until_attempt(s: Stack, job_id: str, attempt: int) -> None:
    """Until the job's round has ``attempt`` attempts (checked at each of its events)."""
    stub, md = s.admin()

    def watch() -> None:
        for _ in stub.WatchJob(admin_pb2.WatchJobRequest(job_id=job_id), metadata=md, timeout=60):
            job = stub.GetJob(admin_pb2.GetJobRequest(job_id=job_id), metadata=md, timeout=10)
            if len(job.attempts) >= attempt:
                return

    await asyncio.to_thread(watch)


def _fleet(s: Stack, devices: int, state_dir: Path):
    return s.fleet([SyntheticUpdates(i, seed=7) for i in device_ids("res", devices)], id_prefix="res", seed=3,
                   audit=True, state_dir=state_dir)


async def _stop_when_reached(s: Stack, job_id: str, devices: int, state_dir: Path, reached: asyncio.Event,
                             release: asyncio.Event):
    """Run the fleet until ``reached``, then stop every device mid-session (their task reports
    lost with them) and let the held message go on; the stopped fleet."""
    fleet = _fleet(s, devices, state_dir)
    running = asyncio.create_task(fleet.run(until=fleet.until_job_done(job_id, every_seconds=0.2)))
    await asyncio.wait_for(reached.wait(), 120)
    running.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await running
    fleet.close()
    release.set()
    return fleet


async def _interrupt_and_resume(s: Stack, tmp_path: Path, reached: asyncio.Event, release: asyncio.Event,
                                devices: int, coordinator_too: bool = True):
    """``devices``: the fleet, before and after. ``coordinator_too``: the coordinator stops and
    restarts with the fleet (else only the fleet restarts under it)."""
    job_id = await s.submit(spec("resume", ROUNDS, cohort=COHORT, over_selection=1.2))
    first = await _stop_when_reached(s, job_id, devices, tmp_path / "devices", reached, release)
    if coordinator_too:
        await s.restart_coordinator()
    second = _fleet(s, devices, tmp_path / "devices")
    try:
        await second.run(until=second.until_job_done(job_id, every_seconds=0.2))
    finally:
        second.close()
    _, md = s.admin()
    async with grpc.aio.insecure_channel(s.target) as channel:
        checks = await check_committed(admin_pb2_grpc.AdminStub(channel), md,
                                       SumAudit.of(first.inputs + second.inputs))
    released = {sample.labels["cause"]: sample.value
                for family in text_string_to_metric_families(scrape_text(s.coordinator.metrics_port))
                for sample in family.samples if sample.name == "tally_coordinator_seats_released_total"}
    events = [e.message for e in s.coordinator.store.events(job_id)]
    store = s.coordinator.store
    return await s.job(job_id), checks, released, events, store.rounds(job_id, 1), store.task_report_counts(job_id, 1)


@pytest.mark.parametrize(("phase", "coordinator_too"), [(phase, True) for phase in PHASES] + [("share_keys", False)])
def test_a_job_interrupted_in_any_phase_resumes_and_its_sums_stay_exact(tmp_path, monkeypatch, phase,
                                                                        coordinator_too):
    """Before MaskedInput no device has sent an input: a population of one selection, every
    device seated in the interrupted attempt, must carry the resumed round. After it, those that
    sent one must stay out of the round, so the population is twice a selection and more."""
    reached, release = _hold_first(monkeypatch, PHASES[phase])
    before_inputs = phase in ("advertise_keys", "share_keys")
    devices = SELECTION if before_inputs else 2 * SELECTION + 2

    async def main():
        async with in_process().whole_system(tmp_path) as s:
            return await _interrupt_and_resume(s, tmp_path, reached, release, devices, coordinator_too)

    job, checks, released, events, attempts, reports = run(main())
    assert job.state == common_pb2.JOB_STATE_SUCCEEDED, job.message
    assert job.committed_round == ROUNDS
    counts = outcome_counts(checks)
    assert counts[MISMATCH] == counts[FOREIGN] == 0 and counts[EXACT] >= ROUNDS
    assert {c.round for c in checks} == set(range(1, ROUNDS + 1))
    if coordinator_too:  # the restart is in the record: the interrupted attempt, and an event
        assert [a.message for a in attempts if a.state == "failed"][:1] == ["interrupted: coordinator stopped"]
        assert any(m.startswith("resumed by a restarted coordinator after round 0; round 1 attempt 1 "
                                "interrupted") for m in events), events
    else:  # the attempt ran on without its devices and failed; the retry seated them again
        assert [a.state for a in attempts][0] == "failed" and attempts[-1].state == "committed"
    if before_inputs:  # the restarted devices' ledgers gave back at least a cohort's seats
        assert released["ledger"] >= MIN_COHORT, released
    # No device was offered a second input in round 1 (it would have refused and reported it).
    assert not any(reason == "already_sent_input" for _, reason in reports), reports


def test_job_status_names_every_attempt_of_the_round_and_why_it_ended(tmp_path, monkeypatch):
    """`job status` while the resumed round runs lists its interrupted attempt."""
    reached, release = _hold_first(monkeypatch, AdvertiseKeys)

    async def main():
        async with in_process().whole_system(tmp_path) as s:
            job_id = await s.submit(spec("status", 1, cohort=COHORT, over_selection=1.2))
            await _stop_when_reached(s, job_id, SELECTION, tmp_path / "devices", reached, release)
            await s.restart_coordinator()
            await _until_attempt(s, job_id, 2)  # no fleet: the resumed round waits in selection
            return await s.job(job_id)

    job = run(main())
    fields = job_dict(job)
    assert fields["round"] == 1 and [a["state"] for a in fields["attempts"]] == ["failed", "running"]
    assert fields["attempts"][0]["message"] == "interrupted: coordinator stopped"
    assert fields["attempts"][0]["finished_at"] and not fields["attempts"][1]["finished_at"]
    assert "earlier attempts of round 1: #1 interrupted: coordinator stopped" in show(fields)
