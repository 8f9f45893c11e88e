"""Sybils and differencing against the coordinator (issue 12, attacks 9 and 13).

Cohorts are drawn at random once the selection closes, so identities checking in together do not
land together; and a retry of a round never seats a device whose input is already in a cohort sum
the coordinator received for that round, so no two sums of a round can be subtracted to isolate
anyone."""

from __future__ import annotations

import random
from collections import defaultdict

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from coordinator.planner import FormCohorts, Hold, Retry, RoundPlanner
from test_coordinator import (  # noqa: F401  (twostep is a fixture)
    SUCCEEDED,
    STEP,
    _spec,
    run,
    run_devices,
    stack,
    twostep,
)


def _formed(devices: list[str], aggregators: list[str], seed: int, cohort_size: int) -> RoundPlanner:
    planner = RoundPlanner(
        _spec(cohort_size=cohort_size, over_selection=1.0, min_cohort=5), [STEP], 0.0, extensions=0,
        attempt_key="k", cohort_rng=random.Random(seed),
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
    planner = _formed(devices, [f"a{j}" for j in range(aggregators)], seed, cohort_size=n)
    placed = [d for c in planner.cohorts for d in c.devices]
    assert len(placed) == len(set(placed)) and set(placed) <= set(devices)
    assert all(len(c.devices) >= 5 for c in planner.cohorts)


def test_sybils_checking_in_together_do_not_land_together():
    """A victim checks in, four sybils right behind it, then 15 honest devices; two cohorts of
    10. In check-in order the sybils would share the victim's cohort every time. Drawn at random,
    all four do so with probability C(9,4)/C(19,4) = 3.3 %; over 400 draws the observed rate stays
    far below one in five."""
    devices = ["victim", *(f"sybil{i}" for i in range(4)), *(f"honest{i}" for i in range(15))]
    together = 0
    for seed in range(400):
        planner = _formed(devices, ["a", "b"], seed, cohort_size=20)
        cohort = next(c.devices for c in planner.cohorts if "victim" in c.devices)
        together += all(f"sybil{i}" in cohort for i in range(4))
    assert together / 400 < 0.2, together


def test_a_device_already_summed_in_the_round_is_not_selected_again():
    planner = RoundPlanner(_spec(), [STEP], 0.0, extensions=0, attempt_key="k",
                           excluded=frozenset({"summed"}))
    answer = planner.check_in("summed", 0.0)
    assert isinstance(answer, Retry) and answer.reason == "already summed in this round"
    assert isinstance(planner.check_in("fresh", 0.0), Hold)
    assert list(planner.selection.seated) == ["fresh"]


def test_a_retried_round_sums_no_device_of_the_failed_attempts_sums(tmp_path, twostep):
    """Attack 13: attempt 1 of round 1 fails after every cohort's first sum (the losses) reached
    the coordinator. The retry's cohorts share no device with those sums: subtracting one
    round's sums from another's isolates nobody. Twenty devices, so the retry can still form."""

    def contribute(device, step, broadcast):
        if step == "stats":
            return {"loss": 0.5, "count": 1}
        return {"delta": np.zeros(64 * 4 + 4 + 4 * 10 + 10), "weight": 1}

    async def main():
        async with stack(tmp_path, aggregators=2) as s:
            devices = await s.devices(20, trainers=False)
            s.aggregators[1].abort_sum = "update"  # the second sum of cohort 2 aborts, once
            job_id = await s.submit(
                "name: diff\nalgorithm: twostep\nrounds: 1\ncohort_size: 10\nover_selection: 1.0\n"
                "min_cohort: 5\nmodel: {inputs: 64, classes: 10, hidden: 4}\n"
            )
            seated: dict[str, set[str]] = defaultdict(set)

            async def before(device, task):
                seated[task.task_id.split("-")[0]].add(device.device_id)

            events = await run_devices(devices, contribute, s.until_done(job_id), before)
            rows = s.service.store.rounds(job_id)
            return events, rows, dict(seated), s.service.store.summed(job_id, 1)

    events, rows, seated, summed = run(main())
    assert events[-1].state == SUCCEEDED
    assert [(r.attempt, r.state) for r in rows] == [(1, "failed"), (2, "committed")]
    first, second = seated["r1a1"], seated["r1a2"]
    assert len(first) == len(second) == 10
    assert first <= summed  # the failed attempt's first sums did reach the coordinator
    assert not first & second
