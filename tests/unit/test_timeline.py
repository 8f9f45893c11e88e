"""The fleet report's recorder (issue 8): bounded samples whose percentiles track the exact ones,
timelines that merge across processes and survive JSON, and round spans that cover every phase."""

from __future__ import annotations

import json

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from tally.loadtest.timeline import EPSILON_SERIES, RESERVOIR, FleetTimeline, TimelineMetrics


@settings(max_examples=15, deadline=None)
@given(n=st.integers(1, 3 * RESERVOIR), seed=st.integers(0, 2**32))
def test_a_reservoir_stays_bounded_and_its_percentiles_track_the_exact_ones(n, seed):
    values = np.random.default_rng(seed).lognormal(0.0, 1.0, n)
    timeline = FleetTimeline(seed)
    for v in values:
        timeline.record_rpc("GetStep", float(v))
    kept = timeline.rpc["GetStep"]
    assert kept.seen == n and len(kept.kept) == min(n, RESERVOIR)
    summary = timeline.summary()["rpc_seconds"]["GetStep"]
    exact = np.percentile(values, 50)
    assert summary["count"] == n
    if n <= RESERVOIR:
        assert summary["p50"] == exact
    else:  # a uniform sample of 20,000: the median's rank is off by well under 2 %
        assert abs(np.mean(values <= summary["p50"]) - 0.5) < 0.02


def test_timelines_of_two_processes_merge_and_survive_json():
    a, b = FleetTimeline(1), FleetTimeline(2)
    for i in range(300):
        a.record_rpc("CheckIn", 0.001 * i)
        b.record_rpc("CheckIn", 0.002 * i)
    a.record_phase("job", 1, "share_keys", 0.5)
    b.record_phase("job", 1, "share_keys", 2.0)
    b.record_phase("job", 2, "unmask", 0.1)
    a.record_end("unmask", "dropped")
    b.record_end("unmask", "dropped")
    merged = a.merge(FleetTimeline.from_json(json.loads(json.dumps(b.to_json()))))
    assert merged.rpc["CheckIn"].seen == 600 and sum(merged.checkins.values()) == 600
    assert merged.ended_early == {"unmask/dropped": 2}
    start_a, end_a = a.rounds["job/1"]["share_keys"]
    start_b, end_b = b.rounds["job/1"]["share_keys"]
    assert merged.rounds["job/1"]["share_keys"] == [min(start_a, start_b), max(end_a, end_b)]
    assert set(merged.rounds) == {"job/1", "job/2"}
    assert merged.summary()["phase_seconds"]["share_keys"]["count"] == 2


def test_a_merge_beyond_the_reservoir_keeps_each_side_in_proportion():
    a, b = FleetTimeline(1), FleetTimeline(2)
    for _ in range(RESERVOIR):
        a.record_rpc("CheckIn", 1.0)
    for _ in range(3 * RESERVOIR):
        b.record_rpc("CheckIn", 2.0)
    merged = a.merge(b).rpc["CheckIn"]
    assert merged.seen == 4 * RESERVOIR and len(merged.kept) <= RESERVOIR
    assert abs(merged.kept.count(1.0) / len(merged.kept) - 0.25) < 0.01


@settings(max_examples=30, deadline=None)
@given(updates=st.lists(st.tuples(st.integers(0, 7), st.sampled_from([0.0, 0.5, 1.25, 4.0, float("inf")])),
                       max_size=60))
def test_the_devices_epsilon_quantiles_of_two_processes_merge_to_those_of_every_device(updates):
    """Devices of two processes (shards) report their own epsilon (+Inf included) in any order:
    the merged report's last quantiles are those of every device's latest epsilon, as Prometheus
    gets them from each process, and never NaN."""
    shards = [TimelineMetrics(FleetTimeline(i)) for i in range(2)]
    latest: dict[str, float] = {}
    for device, epsilon in updates:  # device i plays in process i % 2
        shards[device % 2].observe_epsilon(f"d{device}", epsilon)
        latest[f"d{device}"] = epsilon
    a, b = (FleetTimeline.from_json(json.loads(json.dumps(m.timeline.to_json()))) for m in shards)
    spent = a.merge(b).summary()["device_epsilon"]
    if not latest:
        assert spent["devices"] == []
        return
    assert spent["devices"][-1] == len(latest)
    for name, q in EPSILON_SERIES.items():
        assert spent[name][-1] == float(np.percentile(list(latest.values()), q, method="inverted_cdf"))
        assert not any(np.isnan(spent[name]))
    for i, metrics in enumerate(shards):
        mine = [e for d, e in latest.items() if int(d[1:]) % 2 == i]
        exported = metrics.registry.get_sample_value("tally_client_device_epsilon", {"quantile": "1"})
        assert exported == (max(mine) if mine else 0.0)


def test_refusals_by_reason_add_up_across_processes():
    shards = [TimelineMetrics(FleetTimeline(i)) for i in range(2)]
    for reason in ("privacy_budget_spent", "privacy_budget_spent", "policy"):
        shards[0].observe_refusal(reason)
    shards[1].observe_refusal("privacy_budget_spent")
    merged = shards[0].timeline.merge(FleetTimeline.from_json(json.loads(json.dumps(shards[1].timeline.to_json()))))
    refusals = merged.summary()["refusals"]
    assert {reason: series[-1][1] for reason, series in refusals.items()} == {"privacy_budget_spent": 3, "policy": 1}
    assert all(a[0] <= b[0] and a[1] < b[1] for series in refusals.values() for a, b in zip(series, series[1:]))
    assert shards[0].registry.get_sample_value("tally_client_task_refusals_total",
                                               {"reason": "privacy_budget_spent"}) == 2
