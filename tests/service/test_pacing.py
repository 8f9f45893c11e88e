"""Pace steering (tally/coordinator/rounds/pacing.py): come-back slots hold a population to the target rate."""

from __future__ import annotations

import asyncio
import logging

import pytest
from hypothesis import given
from hypothesis import strategies as st

from support.coordinator import run, spec_yaml
from support.stack import in_process, scrape_text
from tally.coordinator.rounds.come_back import Retry
from tally.coordinator.rounds.pacing import MAX_PACED_RETRY_S, CheckinPacer

arrivals = st.lists(st.tuples(st.floats(0, 5), st.floats(0.2, 60)), min_size=1, max_size=200)


@given(rate=st.floats(0.5, 5000), checkins=arrivals)
def test_slots_are_spaced_by_the_rate_and_never_before_the_planners_hint(rate, checkins):
    pacer = CheckinPacer(rate)
    now, slots = 0.0, []
    for gap, hint in checkins:
        now += gap
        retry = pacer.steer(Retry(hint, "r"), now)
        assert retry.reason == "r"
        assert hint - 1e-9 <= retry.seconds <= MAX_PACED_RETRY_S + 1e-9
        slots.append(now + retry.seconds)
    ordered = sorted(slots)
    # Every come-back time has the next one at least 1/rate later: the fleet returns at <= rate.
    assert all(b - a >= 1 / rate - 1e-6 for a, b in zip(ordered, ordered[1:]))


@given(n=st.integers(1, 2000), rate=st.floats(1, 500))
def test_a_population_checking_in_at_once_is_spread_over_n_over_rate_seconds(n, rate):
    pacer = CheckinPacer(rate)
    waits = [pacer.steer(Retry(5.0, "idle"), 100.0).seconds for _ in range(n)]
    assert waits[0] == pytest.approx(5.0)
    assert max(waits) == pytest.approx(max(5.0, 5.0 + (n - 1) / rate), rel=1e-9)


def test_without_a_target_the_planners_hint_is_kept_and_a_bad_rate_is_refused():
    assert CheckinPacer(None).steer(Retry(3.0, "x"), 10.0) == Retry(3.0, "x")
    with pytest.raises(ValueError, match="> 0"):
        CheckinPacer(0.0)


def test_a_crowd_beyond_the_horizon_is_told_the_horizon():
    pacer = CheckinPacer(1.0)
    waits = [pacer.steer(Retry(1.0, "x"), 0.0).seconds for _ in range(int(MAX_PACED_RETRY_S) + 10)]
    assert max(waits) == MAX_PACED_RETRY_S


def test_the_coordinator_paces_idle_devices_and_exports_their_come_back_times(tmp_path):
    rate = 4.0

    async def main():
        async with in_process().coordinator_with_fakes(tmp_path, aggregators=1, checkin_rate=rate) as s:
            devices = await s.devices(12, trainers=False)
            replies = await asyncio.gather(*(d.check_in_once() for d in devices))
            waits = sorted(r.retry_after.seconds for r in replies)
            assert all(r.retry_after.population_idle for r in replies)
            # 12 devices at once at 4/s: slots 0.25 s apart over 2.75 s after the idle hint.
            gaps = [b - a for a, b in zip(waits, waits[1:])]
            assert min(gaps) >= 1 / rate - 0.05, waits
            assert waits[-1] - waits[0] >= (len(devices) - 1) / rate - 0.1
            text = scrape_text(s.service.metrics_port)
            assert "tally_coordinator_checkin_retry_after_seconds_count 12.0" in text

    run(main())


@pytest.mark.parametrize("rate, warned", [(1.0, True), (100.0, False)])
def test_a_job_whose_selection_cannot_fill_at_the_paced_rate_is_warned_about(tmp_path, caplog, rate, warned):
    async def main():
        async with in_process().coordinator_with_fakes(tmp_path, aggregators=1, checkin_rate=rate,
                                                       checkin_hold_s=2.0) as s:
            with caplog.at_level(logging.WARNING):
                await s.submit(spec_yaml("paced", cohort=10))

    run(main())
    assert ("selection cannot fill under pace steering" in caplog.text) is warned
