"""Sybils and differencing against the coordinator (issue 12, attacks 9 and 13).

Cohorts are drawn at random once the selection closes, so identities checking in together do not
land together; and a retry of a round never seats a device seated in an earlier attempt of that
round, so no two sums of a round (whoever computed them) can be subtracted to isolate anyone."""

from __future__ import annotations

import asyncio
import itertools
import random
from collections import defaultdict

from hypothesis import given, settings
from hypothesis import strategies as st

from support.coordinator import (
    STEP,
    SUCCEEDED,
    fedavg_contribution,
    planner_spec,
    run,
    run_devices,
    spec_yaml,
)
from support.stack import in_process, scrape_text
from tally.algorithms.fedavg import FedAvgOptions
from tally.client.input_ledger import LEDGER_FILE, InputLedger
from tally.coordinator.rounds.planner import Failed, FormCohorts, Hold, Phase, Retry, RoundPlanner
from tally.security.files import private_dir
from tally.wire.protocol import from_proto
from tally.wire.v1 import coordinator_pb2


def _formed(
    devices: list[str], aggregators: list[str], cohort_size: int, seed: int | None = None
) -> RoundPlanner:
    """Every device checks in, in list order; the selection closes and cohorts are drawn (with
    the OS CSPRNG unless ``seed`` fixes the draw)."""
    planner = RoundPlanner(
        planner_spec(cohort_size=cohort_size, over_selection=1.0, min_cohort=5), [STEP], 0.0, extensions=0,
        attempt_key="k", cohort_rng=None if seed is None else random.Random(seed),
    )
    for d in devices:
        assert isinstance(planner.check_in(d, 0.0), Hold)
    assert isinstance(planner.tick(0.0), FormCohorts)
    planner.form(aggregators, 0.0)
    return planner


@settings(max_examples=50, deadline=None)
@given(n=st.integers(10, 60), aggregators=st.integers(1, 4), seed=st.integers(0, 2**32 - 1))
def test_cohorts_partition_the_selection(n, aggregators, seed):
    devices = [f"d{i}" for i in range(n)]
    planner = _formed(devices, [f"a{j}" for j in range(aggregators)], cohort_size=n, seed=seed)
    placed = [d for c in planner.cohorts for d in c.devices]
    assert sorted(placed) == sorted(devices)  # each selected device in exactly one cohort
    assert all(len(c.devices) >= 5 for c in planner.cohorts)
    assert {d: (s.cohort, s.index) for d, s in planner.seats.items()} == {
        d: (c, i) for c, plan in enumerate(planner.cohorts) for i, d in enumerate(plan.devices, start=1)
    }


def test_sybils_checking_in_together_do_not_land_together():
    """A victim checks in, four sybils right behind it, then 15 honest devices; two cohorts of
    10. In check-in order the sybils would share the victim's cohort every time. Drawn at random,
    all four do so with probability C(9,4)/C(19,4) = 3.25 %: 13 of 400 draws expected, and the
    fixed seeds must stay below 32 (a check-in-order planner scores 400)."""
    devices = ["victim", *(f"sybil{i}" for i in range(4)), *(f"honest{i}" for i in range(15))]
    together = 0
    for seed in range(400):
        planner = _formed(devices, ["a", "b"], cohort_size=20, seed=seed)
        cohort = next(c.devices for c in planner.cohorts if "victim" in c.devices)
        together += all(f"sybil{i}" in cohort for i in range(4))
    assert 0 < together < 32, together


def test_the_default_draw_is_not_check_in_order():
    """Without an injected seed the draw comes from the OS: 40 devices in two cohorts of 20 are
    split as they checked in with probability 2 / C(40, 20), about 1e-11."""
    devices = [f"d{i}" for i in range(40)]
    planner = _formed(devices, ["a", "b"], cohort_size=40)
    assert {frozenset(c.devices) for c in planner.cohorts} != {frozenset(devices[:20]), frozenset(devices[20:])}


def test_a_device_seated_earlier_in_the_round_is_not_selected_again():
    planner = RoundPlanner(planner_spec(), [STEP], 0.0, extensions=0, attempt_key="k",
                           excluded=frozenset({"seated"}))
    answer = planner.check_in("seated", 0.0)
    assert isinstance(answer, Retry) and answer.reason == "seated in an earlier attempt of this round"
    assert isinstance(planner.check_in("fresh", 0.0), Hold)
    assert list(planner.selection.seated) == ["fresh"]
    plain = RoundPlanner(planner_spec(secure={"plain": True}), [STEP], 0.0, extensions=0, attempt_key="k",
                         excluded=frozenset({"seated"}))
    assert isinstance(plain.check_in("seated", 0.0), Hold)  # no masked input to protect


def test_a_selection_short_of_devices_says_how_many_it_turned_away_as_seated_before():
    """A population used up by the no-reseat rule fails its selection naming the cause: how many
    devices checked in but may not be seated again (each counted once however often it came)."""
    spec = planner_spec()
    window = spec.deadlines["checkin"]
    seated_before = frozenset(f"old{i}" for i in range(3))
    planner = RoundPlanner(spec, [STEP], 0.0, extensions=0, attempt_key="k", excluded=seated_before)
    for device in [*seated_before, "old0", "new"]:
        planner.check_in(device, 0.0)
    planner.readmit("old2")  # its seat was released (it reported no input): seated, not turned away
    assert isinstance(planner.check_in("old2", 0.0), Hold)
    decision = planner.tick(window + 1.0)
    assert isinstance(decision, Failed) and planner.phase is Phase.FAILED
    assert decision.reason.startswith(f"only 2 of the {spec.min_cohort} devices needed")
    assert "; 2 more checked in but were seated in an earlier attempt of this round" in decision.reason
    control = RoundPlanner(spec, [STEP], 0.0, extensions=0, attempt_key="k")
    control.check_in("new", 0.0)
    assert "earlier attempt" not in control.tick(window + 1.0).reason


def test_a_withheld_sum_cannot_be_differenced_with_the_retry(tmp_path):
    """Attack 13 by a malicious aggregator: in attempt 1 of round 1 it unmasks its cohort's sum,
    keeps it and reports an abort, so no sum of that cohort reaches the coordinator. Re-seating
    that cohort in the retry would let the aggregator pretend one device dropped out and
    subtract. Fifteen devices, cohorts of 10: the retry can only take the five never seated, and
    every two sums computed in the round (by any aggregator) are over equal or disjoint devices."""

    async def main():
        async with in_process().coordinator_with_fakes(tmp_path, aggregators=2) as s:
            devices = await s.devices(15)
            s.aggregators[1].withhold_next = True
            job_id = await s.submit(spec_yaml("diff", extra="deadlines: {checkin: 0.5}\n"))
            members: dict[tuple[str, int], str] = {}  # (session id, device index) -> device
            attempts: dict[str, set[str]] = defaultdict(set)
            excluded_during_retry: list[frozenset[str]] = []

            async def before(device, task):
                members[from_proto(task.session).ref.session_id, task.device_index] = device.device_id
                attempt = task.task_id.split("-")[0]
                attempts[attempt].add(device.device_id)
                if attempt == "r1a2":
                    excluded_during_retry.append(s.service.store.seated(job_id, 1))

            events = await run_devices(devices, fedavg_contribution(FedAvgOptions()), s.until_done(job_id), before)
            computed = [
                frozenset(members[session, i] for i in indices)
                for fake in s.aggregators for session, _, indices in fake.computed
            ]
            return (events, s.service.store.rounds(job_id), dict(attempts), computed,
                    excluded_during_retry, s.service.store.seated(job_id, 1))

    events, rows, attempts, computed, excluded_during_retry, after_commit = run(main())
    assert events[-1].state == SUCCEEDED
    assert [(r.attempt, r.state) for r in rows] == [(1, "failed"), (2, "committed")]
    assert "too few survivors (a lie)" in rows[0].message
    first, second = attempts["r1a1"], attempts["r1a2"]
    assert not first & second
    assert len(first) == 10 and len(second) == 5
    assert all(first <= seen for seen in excluded_during_retry)  # recorded before the retry
    assert after_commit == frozenset()  # a committed round keeps no record
    assert len(computed) >= 2  # the withheld sum and the retry's
    for a, b in itertools.combinations(computed, 2):
        assert a == b or not a & b, (sorted(a), sorted(b))


async def _loops_until_done(s, job_id: str, devices, device_loop) -> None:
    """Run ``device_loop(device, done)`` for every device until the job ends."""
    done = asyncio.Event()
    loops = [asyncio.create_task(device_loop(d, done)) for d in devices]
    try:
        await s.until_done(job_id)
    finally:
        done.set()
        await asyncio.gather(*loops)


def test_a_retry_reseats_the_devices_that_report_they_sent_no_input(tmp_path):
    """The retry rule's price was liveness: a population of one selection could not retry a round
    at all once its sessions opened. Ten devices, one cohort of ten; attempt 1 aborts before any
    input is sent (the aggregator reports ShareKeys below threshold) and the devices say so at
    their next check-in. Each report frees only its sender's own seat: dev0 says it did send an
    input, dev1 reports dev2's task instead of its own, and both stay out of the retry, which
    seats the other eight."""
    ABORTED = coordinator_pb2.TaskReport.ABORTED

    async def main():
        async with in_process().coordinator_with_fakes(tmp_path, aggregators=1) as s:
            devices = await s.devices(10)
            s.aggregators[0].aborts = ["share_keys: 4 devices sent shares, below t = 6"]
            job_id = await s.submit(spec_yaml("live", extra="deadlines: {checkin: 0.5}\n"))
            first_tasks: dict[str, str] = {}
            dev2_known = asyncio.Event()
            attempts: dict[str, set[str]] = defaultdict(set)
            contribute = fedavg_contribution(FedAvgOptions())

            async def device_loop(device, done):
                while (task := await device.task(done)) is not None:
                    attempts[task.task_id.split("-")[0]].add(device.device_id)
                    if device.device_id in first_tasks:
                        await device.participate(task, contribute)
                        continue
                    first_tasks[device.device_id] = task.task_id
                    if device.device_id == "dev2":
                        dev2_known.set()
                    if device.device_id == "dev1":
                        await dev2_known.wait()
                    device.reports = [coordinator_pb2.TaskReport(
                        job_id=task.job_id, round=task.round, outcome=ABORTED,
                        reason="session_aborted", detail="aborted in share_keys",
                        task_id=first_tasks["dev2" if device.device_id == "dev1" else device.device_id],
                        sent_input=device.device_id == "dev0")]

            await _loops_until_done(s, job_id, devices, device_loop)
            job = await s.job(job_id)
            return (job, s.service.store.rounds(job_id), dict(attempts),
                    scrape_text(s.service.metrics_port))

    job, rows, attempts, metrics = run(main())
    assert job.state == SUCCEEDED
    assert [(r.attempt, r.state) for r in rows] == [(1, "failed"), (2, "committed")]
    everyone = {f"dev{i}" for i in range(10)}
    assert attempts["r1a1"] == everyone
    assert attempts["r1a2"] == everyone - {"dev0", "dev1"}
    assert 'tally_coordinator_task_reports_total{outcome="aborted",reason="session_aborted"} 9.0' in metrics
    assert 'tally_coordinator_task_reports_total{outcome="unmatched",reason=""} 1.0' in metrics
    assert [(c.outcome, c.reason, c.count) for c in job.task_reports] == [("aborted", "session_aborted", 9)]


async def _lose_ledgers_after_attempt_1(s, job_id: str, devices, keep: int, tmp_path, *, send_first: bool):
    """Run ``devices``, each with the SDK's durable input ledger, until the job ends. After its
    task of attempt 1 (carried out when ``send_first``, else dropped before any input, its report
    lost with a restart), every device but the first ``keep`` to get there loses its state
    directory: it states a new ledger from then on. (attempts: {"r1a1": devices, ...}, the
    devices that kept their ledgers, every sum the aggregators computed as its set of devices)."""
    for device in devices:
        device.ledger = InputLedger(private_dir(tmp_path / "kept" / device.device_id) / LEDGER_FILE)
    contribute = fedavg_contribution(FedAvgOptions())
    members: dict[tuple[str, int], str] = {}  # (session id, device index) -> device
    attempts: dict[str, set[str]] = defaultdict(set)
    kept: set[str] = set()

    async def device_loop(device, done):
        while (task := await device.task(done)) is not None:
            members[from_proto(task.session).ref.session_id, task.device_index] = device.device_id
            attempt = task.task_id.split("-")[0]
            attempts[attempt].add(device.device_id)
            if attempt != "r1a1" or send_first:
                await device.participate(task, contribute)
            if attempt == "r1a1" and len(kept) < keep:
                kept.add(device.device_id)
            elif attempt == "r1a1":
                device.ledger = InputLedger(private_dir(tmp_path / "wiped" / device.device_id) / LEDGER_FILE)

    await _loops_until_done(s, job_id, devices, device_loop)
    computed = [frozenset(members[session, i] for i in indices)
                for fake in s.aggregators for session, _, indices in fake.computed]
    return dict(attempts), kept, computed


def test_lost_ledgers_release_no_seat_so_the_retry_cannot_be_differenced(tmp_path):
    """Issue 38, problem 2. The aggregator unmasks attempt 1's cohort of ten (of fifteen devices)
    after every input, keeps the sum and reports an abort. Nine of the ten then lose their state
    directories; one keeps its ledger, which says it sent round 1's input. A lost ledger used to
    state "no input in any round", so the nine were re-seated and the retry's sum subtracted
    from the kept one was the tenth's input exactly. Their new ledgers are younger than their
    seats and release nothing: the retry seats the five devices never seated, and every two sums
    computed in the round are over equal or disjoint devices (no difference isolates anyone)."""

    async def main():
        async with in_process().coordinator_with_fakes(tmp_path, aggregators=1) as s:
            devices = await s.devices(15)
            s.aggregators[0].withhold_next = True
            job_id = await s.submit(spec_yaml("wiped", extra="deadlines: {checkin: 2}\n"))  # attempt 1 fills at once
            attempts, _, computed = await _lose_ledgers_after_attempt_1(
                s, job_id, devices, 1, tmp_path, send_first=True)
            return (await s.job(job_id), s.service.store.rounds(job_id), attempts, computed,
                    scrape_text(s.service.metrics_port))

    job, rows, attempts, computed, metrics = run(main())
    assert job.state == SUCCEEDED
    assert [(r.attempt, r.state) for r in rows] == [(1, "failed"), (2, "committed")]
    assert len(attempts["r1a1"]) == 10
    assert attempts["r1a2"] == {f"dev{i}" for i in range(15)} - attempts["r1a1"]
    assert 'tally_coordinator_seats_released_total{cause="ledger"} 0.0' in metrics
    assert len(computed) == 2  # the withheld sum and the retry's
    for a, b in itertools.combinations(computed, 2):
        assert a == b or not a & b, (sorted(a), sorted(b))


def test_a_ledger_kept_since_its_seat_releases_it_and_a_new_one_does_not(tmp_path):
    """The other side of the rule: attempt 1 aborts before any input and the devices restart
    without their reports. Five of them kept their ledgers, which were stated when they were
    seated and say nothing was sent in round 1: their seats are released and the retry seats
    them. The other five start new ledgers, which say the same but know nothing of the seats:
    they stay out."""

    async def main():
        async with in_process().coordinator_with_fakes(tmp_path, aggregators=1) as s:
            devices = await s.devices(10)
            s.aggregators[0].aborts = ["share_keys: 4 devices sent shares, below t = 6"]
            job_id = await s.submit(spec_yaml("kept", extra="deadlines: {checkin: 2}\n"))  # attempt 1 fills at once
            attempts, kept, _ = await _lose_ledgers_after_attempt_1(s, job_id, devices, 5, tmp_path,
                                                                     send_first=False)
            return await s.job(job_id), attempts, kept, scrape_text(s.service.metrics_port)

    job, attempts, kept, metrics = run(main())
    assert job.state == SUCCEEDED
    assert attempts["r1a1"] == {f"dev{i}" for i in range(10)} and attempts["r1a2"] == kept
    assert 'tally_coordinator_seats_released_total{cause="ledger"} 5.0' in metrics
