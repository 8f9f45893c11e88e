"""Fleet behaviour profiles (issue 8): a YAML profile is validated with errors that name the
field; every device draws its traits reproducibly from (seed, id) with the profile's
distributions; and a synthetic fleet that is offline part of the time, slow, on a shaped
network, churning, dropping out and misbehaving still gets every round committed with exact
sums, while the aggregators refuse each duplicated and replayed message."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from support.jobs import run_synthetic_job
from tally.loadtest.behaviour import BehaviourProfile, DeviceTraits
from tally.loadtest.fleet import device_ids
from tally.loadtest.sum_audit import EXACT, FOREIGN, MISMATCH, outcome_counts

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "fleet" / "profile.yaml"


def _profile(tmp_path: Path, text: str) -> BehaviourProfile:
    path = tmp_path / "profile.yaml"
    path.write_text(text)
    return BehaviourProfile.load(path)


def test_the_example_profile_loads():
    profile = BehaviourProfile.load(EXAMPLE)
    assert profile.availability.diurnal is not None and profile.misbehaviour.replay > 0


@pytest.mark.parametrize("text, field", [
    ("availability: {online: 1.5}", "availability.online"),
    ("checkin: {period_seconds: -1}", "checkin.period_seconds"),
    ("network: {latency_ms: [200, 20]}", "latency_ms"),
    ("dropout: {unmask: 0.1, download: 0.2}", "unknown phases ['download']"),
    ("misbehaviour: {lat: 0.1}", "misbehaviour.lat"),
    ("compute: [1, 2]", "compute"),
    ("availability: {online: 0.5", "not YAML"),
])
def test_a_bad_profile_is_refused_naming_the_field(tmp_path, text, field):
    with pytest.raises(ValueError, match=field.replace("[", r"\[").replace("]", r"\]")):
        _profile(tmp_path, text)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**32), device=st.integers(0, 10**6), size=st.integers(0, 10**7))
def test_traits_are_reproducible_per_device_and_shape_delays_as_stated(seed, device, size):
    profile = BehaviourProfile.load(EXAMPLE)
    device_id = f"sim-{device:05d}"
    a, b = profile.traits(seed, device_id), profile.traits(seed, device_id)
    assert (a.speed, a.uplink_bps, a.downlink_bps, a.latency_s, a.lifetime_s) == \
           (b.speed, b.uplink_bps, b.downlink_bps, b.latency_s, b.lifetime_s)
    assert [a.session_events() for _ in range(5)] == [b.session_events() for _ in range(5)]
    assert 0.020 <= a.latency_s <= 0.150
    assert math.isclose(a.send_delay(size), a.latency_s + 8 * size / a.uplink_bps)
    assert math.isclose(a.receive_delay(size), a.latency_s + 8 * size / a.downlink_bps)
    wait = a.checkin_wait(0.5)  # the profile's period (2 s) beats the coordinator's 0.5 s
    assert 2.0 <= wait <= 2.0 * 1.3
    assert math.isclose(a.compute_seconds, 0.5 / a.speed)


def test_a_population_draws_the_profiles_distributions(tmp_path):
    profile = _profile(tmp_path, "\n".join([
        "availability: {online: 0.3, spell_seconds: 10}",
        "compute: {seconds: 1.0, speed_sigma: 0.5}",
        "network: {uplink_mbps: 10, bandwidth_sigma: 0.7}",
        "dropout: {share_keys: 0.1, unmask: 0.05}",
        "churn: {leave_per_hour: 3600}",
        "misbehaviour: {duplicate: 0.2, replay: 0.1}",
    ]))
    traits = [profile.traits(7, i) for i in device_ids("sim", 4000)]
    online = np.mean([t.offline_for(t_) == 0.0 for t in traits for t_ in (0.0, 100.0)])
    assert abs(online - 0.3) < 0.03
    speeds = np.array([t.speed for t in traits])
    assert abs(np.median(speeds) - 1.0) < 0.05 and abs(np.std(np.log(speeds)) - 0.5) < 0.03
    assert abs(np.median([t.uplink_bps for t in traits]) / 10e6 - 1.0) < 0.06
    assert abs(np.mean([t.lifetime_s for t in traits]) - 1.0) < 0.06  # 3,600 per hour: 1 s
    events = [t.session_events() for t in traits]
    drops = [e.drop_phase for e in events]
    assert abs(drops.count("share_keys") / len(events) - 0.1) < 0.02
    assert abs(drops.count("unmask") / len(events) - 0.9 * 0.05) < 0.02  # after surviving share_keys
    assert drops.count("masked_input") == drops.count("advertise_keys") == 0
    assert abs(np.mean([e.duplicate for e in events]) - 0.2) < 0.03
    assert abs(np.mean([e.replay for e in events]) - 0.1) < 0.02


# half a minute of a simulated day: `make test` keeps the profile's other tests; CI runs this too
@pytest.mark.full
def test_a_diurnal_population_follows_its_curve(tmp_path):
    profile = _profile(tmp_path,
                       "availability: {diurnal: {trough: 0.1, peak: 0.9, period_seconds: 1000}, spell_seconds: 1}")
    traits = [profile.traits(3, i) for i in device_ids("sim", 3000)]
    at_peak = np.mean([t.offline_for(1000.0) == 0.0 for t in traits])
    at_trough = np.mean([t.offline_for(1500.0) == 0.0 for t in traits])
    assert abs(at_peak - 0.9) < 0.04 and abs(at_trough - 0.1) < 0.04
    offline = [t for t in traits if t.offline_for(2500.0) > 0]
    assert offline and all(t.offline_for(2500.0 + t.offline_for(2500.0)) >= 0 for t in offline)


class _CertainMisbehaviour:
    """A profile whose draws stand, except that the fleet's first ``count`` sessions each send
    their opening twice and the first ``count`` sessions that follow a device's earlier one
    replay its opening: the refusals the test asserts then do not depend on the draws (with 8 %
    duplicates, one CI run in several hundred drew none)."""

    def __init__(self, profile: BehaviourProfile, count: int) -> None:
        self._profile = profile
        self._left = {"duplicate": count, "replay": count}

    def __getattr__(self, name: str) -> Any:
        return getattr(self._profile, name)

    def traits(self, seed: int, device_id: str) -> DeviceTraits:
        traits = self._profile.traits(seed, device_id)
        drawn, sessions = traits.session_events, 0

        def session_events():
            nonlocal sessions
            events, sessions = drawn(), sessions + 1
            kind = "duplicate" if sessions == 1 else "replay"
            if self._left[kind]:
                self._left[kind] -= 1
                return dataclasses.replace(events, drop_phase=None, duplicate=kind == "duplicate",
                                           replay=kind == "replay")
            return events

        traits.session_events = session_events
        return traits


def test_a_misbehaving_churning_shaped_fleet_still_commits_exact_sums(tmp_path):
    profile = _profile(tmp_path, "\n".join([
        "availability: {online: 0.9, spell_seconds: 5}",
        "checkin: {period_seconds: 0.2, jitter: 0.5}",
        "compute: {seconds: 0.2, speed_sigma: 0.5}",
        "network: {uplink_mbps: 50, downlink_mbps: 100, latency_ms: [1, 20]}",
        "dropout: {share_keys: 0.02, unmask: 0.02}",
        "churn: {leave_per_hour: 180}",
        # A refused message ends the sender's stream: each misbehaving device is a dropout.
        "misbehaviour: {duplicate: 0.08, replay: 0.12}",
    ]))
    result = run_synthetic_job(tmp_path, n=40, rounds=3, cohort=20, dropout=0.0,
                                profile=_CertainMisbehaviour(profile, count=2))
    job, stats, checks, refused = result.job, result.stats, result.checks, result.refused
    assert job.committed_round == 3, job.message
    counts = outcome_counts(checks)
    assert counts[EXACT] >= 3 and counts[MISMATCH] == counts[FOREIGN] == 0
    assert refused.get("duplicate_message", 0) >= 1, refused
    # A replayed opening names the old session and the device's old index: refused as another
    # device's message, or as a stale or out-of-phase one, whichever check it fails first.
    assert sum(refused.get(r, 0) for r in ("wrong_sender", "stale_message", "out_of_phase")) >= 1, refused
    assert stats.left >= 1 and stats.devices == 40 + stats.left  # each leaver replaced
    # Every duplicate the devices sent was refused as one (a replay may be refused in its place
    # when both hit one session, so at most as many).
    assert 1 <= refused["duplicate_message"] <= result.misbehaved["duplicate"], (refused, result.misbehaved)


def test_a_ramp_brings_each_device_online_at_its_own_time(tmp_path):
    """No device registers before its arrival time, and the arrivals spread over the ramp (a
    fleet without one registers every device at once)."""
    import sqlite3
    import time

    from support.stack import in_process, run, trainers

    ramp, n = 3.0, 16

    async def main():
        async with in_process().whole_system(tmp_path) as s:
            devices, _ = trainers(n)
            fleet = s.fleet(devices, ramp_s=ramp, seed=7)
            started = time.time()
            try:
                await fleet.run(until=lambda stats: stats.checkins >= n, poll_seconds=0.05)
            finally:
                fleet.close()
            db = sqlite3.connect(f"file:{s.state_dir / 'coordinator.db'}?mode=ro", uri=True)
            enrolled = dict(db.execute("SELECT device_id, enrolled_at FROM devices").fetchall())
            db.close()
            return started, enrolled, {d.device_id: fleet.arrival_s(i) for i, d in enumerate(fleet.devices)}

    started, enrolled, arrivals = run(main())
    assert enrolled.keys() == arrivals.keys()
    for device, arrival in arrivals.items():
        assert enrolled[device] - started >= arrival - 0.05, device
    assert max(arrivals.values()) - min(arrivals.values()) > ramp / 2
    assert all(0 <= a < ramp for a in arrivals.values())


def test_a_negative_ramp_is_refused():
    from tally.loadtest import Fleet
    from tally.security import TLSConfig

    with pytest.raises(ValueError, match="ramp_s"):
        Fleet("127.0.0.1:1", TLSConfig.plaintext(), [object()], ramp_s=-1.0)


def test_devices_whose_unmask_answer_came_after_the_sum_was_complete_report_it_completed(tmp_path):
    """Over-selection seats more devices than the sum needs, and the aggregator closes Unmask at t
    shares of every secret: slower devices' answers arrive after the session ended. Each of them
    sent its masked input, which is in the sum; it must report a completed session with its input
    summed, not an aborted one (a healthy run used to count them as aborts, the job listing
    `session_aborted (e.g. 'stream ended: INTERNAL: Internal error from Core')`: gRPC's words for
    a write to a call the server had already ended, with the SessionDone unread behind it)."""
    # Up to 0.6 s of one-way latency per device: answers spread well past the t-th one.
    profile = _profile(tmp_path, "network: {latency_ms: [0, 600]}\n")
    result = run_synthetic_job(tmp_path, n=24, rounds=2, cohort=20, dropout=0.0, profile=profile)
    job, stats = result.job, result.stats
    assert job.committed_round == 2, job.message
    reports = {(r.outcome, r.reason): r.count for r in job.task_reports}
    assert set(reports) == {("completed", "")}, [(r.outcome, r.reason, r.example) for r in job.task_reports]
    assert stats.sessions_aborted == stats.dropouts == 0, stats.summary()
    assert stats.sessions_completed == 2 * 24, stats.summary()  # every seat of both rounds: input summed
