"""Device-held privacy budgets through the real services (coordinator, two aggregators, SDK
devices with masking and distributed DP), against the coordinators they exist for: one that
selects the same devices every round, one that runs the differencing attack (the same update
summed over S and over S minus a target device), and one that lies about the noise in its
session configuration. The budget is the device's own (``tally.client.privacy_ledger``)."""

from __future__ import annotations

import asyncio
import json
import re
import time
from dataclasses import replace

import matplotlib.pyplot as plt
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from support.jobs import ShiftDevice, job_text
from support.stack import in_process, run, scrape_text
from tally import modelio
from tally.client.metrics import EPSILON_QUANTILES, ClientMetrics
from tally.client.privacy_ledger import PrivacyBudget, epsilon_of
from tally.coordinator.rounds.come_back import Retry
from tally.coordinator.rounds.runner import JobRunner
from tally.coordinator.spec import catalogue
from tally.coordinator.state.store import Store
from tally.loadtest.fleet import device_ids
from tally.loadtest.report import write_report
from tally.loadtest.timeline import EPSILON_SERIES, FleetTimeline, TimelineMetrics
from tally.privacy.payload import PARAMS
from tally.privacy.server import PrivateServer
from tally.secagg import DevicePolicy
from tally.wire.v1 import common_pb2

PRIVACY = "privacy: {mechanism: distributed, clip: 1.0, noise_multiplier: 1.0}\n"
DIM = 63  # and FedAvg's weight: 64 values in the rotation
DELTA = 1e-5


def _spec(name: str, rounds: int, cohort: int, extra: str = "") -> str:
    # min_cohort 6: ten devices make one cohort (two aggregators could not both get six), so each
    # device's session counts every honest device it verifies.
    return (job_text(name, "fedavg", rounds, cohort, name, {"example_cap": 1, "local_epochs": 1})
            .replace("min_cohort: 5", "min_cohort: 6").replace("checkin: 10", "checkin: 3") + extra)


def _updates(n: int) -> list[ShiftDevice]:
    rng = np.random.default_rng(7)
    return [ShiftDevice(rng.uniform(-0.02, 0.02, DIM)) for _ in range(n)]


def _budget_for(releases: int) -> PrivacyBudget:
    """Room for ``releases`` releases of noise multiplier 1 (what the job's plan verifies, to
    the KLS bound's 1e-3) and not one more."""
    return PrivacyBudget(epsilon_of([1.0] * releases, DELTA) * 1.02, DELTA)


@pytest.fixture
def model_kind(request):
    name = re.sub(r"[^a-z0-9]+", "-", request.node.name)[-40:].strip("-")
    catalogue.register_model(name, lambda _spec: {"w": np.zeros(DIM)})
    yield name
    catalogue.unregister_model(name)


def test_a_coordinator_selecting_the_same_devices_every_round_is_stopped_by_their_budgets(tmp_path, model_kind,
                                                                                          monkeypatch):
    """Cohort = population, every round: each device admits three releases, refuses the fourth
    before training (privacy_budget_spent), states so at check-in, and the job, left without
    min_cohort eligible devices, fails saying so. No ledger passes its budget. What the fleet
    exports and what its report (``tally fleet --report``) plots are the devices' ledgers."""
    n, budget = 10, _budget_for(3)
    timeline = FleetTimeline()
    figures = []
    monkeypatch.setattr(plt, "close", figures.append)  # keep the report's figure to read its panels

    async def main():
        async with in_process().whole_system(tmp_path) as s:
            job_id = await s.submit(_spec(model_kind, 8, n, PRIVACY))
            fleet = s.fleet(_updates(n), seed=1, privacy_budget=budget, state_dir=tmp_path / "devices",
                            metrics=TimelineMetrics(timeline))
            try:
                stats = await fleet.run(until=fleet.until_job_done(job_id, every_seconds=0.2))
            finally:
                fleet.close()
            return await s.job(job_id), fleet, stats

    job, fleet, stats = run(main())
    assert job.state == common_pb2.JOB_STATE_FAILED, job.message
    # Failed as soon as fewer than min_cohort 6 of the 10 remained eligible, not at its deadlines.
    assert re.fullmatch(rf"out of eligible devices: \d+ of the {n} devices .* fewer than min_cohort 6", job.message)
    assert job.committed_round == 3
    for device in fleet.devices:
        ledger = device.privacy
        assert [r.round for r in ledger.releases] == [1, 2, 3]
        assert ledger.epsilon() <= budget.epsilon < ledger.epsilon(extra=[replace(ledger.releases[-1], round=4)])
        assert device.stats.failures[job.job_id]["privacy_budget_spent"] >= 1
        assert ledger.statement() == [job.job_id]
        # Durable: a device restarted on its state directory has the same account.
        assert type(ledger)(ledger.path, budget).releases == ledger.releases
    # What the fleet exports to Prometheus: the devices' own epsilon, and their refusals.
    registry = fleet.metrics.registry
    spent = [d.privacy.epsilon() for d in fleet.devices]
    quantiles = {name: float(np.percentile(spent, q, method="inverted_cdf")) for name, q in EPSILON_SERIES.items()}
    assert quantiles["max"] == max(spent)
    for label, name in zip(EPSILON_QUANTILES, EPSILON_SERIES, strict=True):
        assert registry.get_sample_value("tally_client_device_epsilon", {"quantile": label}) == quantiles[name]
    refusals = sum(d.stats.failures[job.job_id]["privacy_budget_spent"] for d in fleet.devices)
    assert refusals >= n
    assert registry.get_sample_value("tally_client_task_refusals_total", {"reason": "privacy_budget_spent"}) == refusals

    # The report: its JSON and its picture's panels hold the devices' ledgers over the run.
    written = write_report(timeline, stats, tmp_path / "report")
    assert [p.name for p in written] == ["report.json", "timeline.json", "report.png"]
    summary = json.loads((tmp_path / "report" / "report.json").read_text())
    over_time = summary["device_epsilon"]
    assert over_time["devices"][-1] == n and {name: over_time[name][-1] for name in EPSILON_SERIES} == quantiles
    # Every device joined rounds 1 to 3: each figure plotted is what a ledger held after 0 to 3 of them.
    ledger = fleet.devices[0].privacy
    held = [type(ledger)(None, budget) for _ in range(4)]
    for k, prefix in enumerate(held):
        prefix.releases = ledger.releases[:k]
    possible = {prefix.epsilon() for prefix in held}
    assert {e for name in EPSILON_SERIES for e in over_time[name]} <= possible
    assert sorted(set(over_time["max"])) == sorted(possible)  # 0, then each release's step
    assert summary["refusals"]["privacy_budget_spent"][-1][1] == refusals
    (figure,) = figures
    panels = {ax.get_title(): ax for ax in figure.axes}
    epsilon_panel = panels["epsilon each device's own ledger has spent (over the devices)"]
    plotted = {line.get_label(): list(line.get_ydata()) for line in epsilon_panel.get_lines()}
    assert plotted == {name: over_time[name] for name in EPSILON_SERIES}
    refusal_panel = panels["tasks the devices refused, by reason (so far)"]
    plotted = {line.get_label(): list(line.get_ydata()) for line in refusal_panel.get_lines()}
    assert plotted == {reason: [k for _, k in series] for reason, series in summary["refusals"].items()}
    assert plotted["privacy_budget_spent"][-1] == refusals


# The attack's job waits for whom it selects, however loaded the machine: a selection closes when
# its devices are seated (S: all n, S minus the target: n - 1), never at a window's end, and no
# phase deadline drops a slow device (either would change who is in a sum, which is what the
# test asserts).
UNHURRIED = ("deadlines: {checkin: 300, download: 120, advertise_keys: 120, share_keys: 120, masked_input: 120, "
             "consistency_check: 120, unmask: 120}")


def _attack(target: str, n: int):
    """A patched runner: the even rounds select S minus ``target`` (their selection is full at
    n - 1 devices, and turns the target away as seated in an earlier attempt would be). It acts
    where each attempt's selection opens, not in ``JobRunner.offer``: a device that checks in
    between a commit and the next selection is held in the waiting room and seated without
    passing ``offer`` (an attack patched there let the target into round 2 under load)."""
    honest_seat_waiting = JobRunner._seat_waiting

    def seat_waiting(self, planner):  # called on each attempt's planner before any device is seated
        if self.round % 2 == 0:
            planner.selection.target = n - 1
            planner.selection.excluded.add(target)
        honest_seat_waiting(self, planner)

    return seat_waiting


def _sums(store, job_id: str, rounds: int) -> tuple[list[np.ndarray], list[int]]:
    """Each committed round's released sum of updates, rebuilt from the models (the first is
    zeros): FedAvg with one example per device moves the model by the sum over the count."""
    models = [np.zeros(DIM)] + [
        np.asarray(modelio.deserialize(store.read_blob(store.model_version(job_id, r).model_digest))["w"])
        for r in range(1, rounds + 1)]
    committed = sorted((r for r in store.rounds(job_id) if r.state == "committed"), key=lambda r: r.round)
    contributors = [int(r.metrics["update.contributors"]) for r in committed]
    return [c * (b - a) for a, b, c in zip(models[:-1], models[1:], contributors, strict=True)], contributors


@pytest.mark.parametrize("dp", [False, True], ids=["control-without-dp", "device-enforced-dp"])
def test_the_differencing_attack(tmp_path, model_kind, monkeypatch, dp):
    """The same update summed over S (odd rounds) and S minus the target (even rounds). Without
    DP the difference of two committed sums is the target's update. With distributed DP and a
    budget of two releases on the target, its ledger shows the two releases it joined (rounds 1
    and 3) and it refuses the third (round 5), which commits without it."""
    n, rounds, target = 10, 5 if dp else 2, 3
    updates = _updates(n)

    async def main():
        async with in_process().whole_system(tmp_path) as s:
            fleet = s.fleet(updates, seed=1)
            victim = fleet.devices[target]
            monkeypatch.setattr(JobRunner, "_seat_waiting", _attack(victim.device_id, n))
            if dp:
                victim.privacy.budget = _budget_for(2)  # the target's own policy; the others have none
            spec = re.sub(r"deadlines: \{.*\}", UNHURRIED, _spec(model_kind, rounds, n, PRIVACY if dp else ""))
            job_id = await s.submit(spec)
            try:
                await fleet.run(until=fleet.until_job_done(job_id, every_seconds=0.2))
            finally:
                fleet.close()
            return await s.job(job_id), victim, *_sums(s.coordinator.store, job_id, rounds)

    job, victim, sums, contributors = run(main())
    assert job.state == common_pb2.JOB_STATE_SUCCEEDED, job.message
    assert contributors[:2] == [n, n - 1], contributors
    difference, truth = sums[0] - sums[1], updates[target].shift
    if not dp:
        np.testing.assert_allclose(difference, truth, atol=1e-3)  # the target's update, isolated
        return
    assert np.linalg.norm(difference - truth) > 10 * np.linalg.norm(truth)  # buried in the noise
    assert [r.round for r in victim.privacy.releases] == [1, 3], (victim.privacy.releases, victim.stats.failures)
    assert victim.stats.failures[job.job_id]["privacy_budget_spent"] == 1, victim.stats.failures
    assert contributors[4] == n - 1, contributors  # round 5 went on without it


def _lying(scale_share: float, claim_devices: float | None):
    """A patched server: each device's noise share scaled by ``scale_share`` while the declared
    multiplier stays, and the honest devices claimed ``claim_devices`` (None: the field left out)."""
    honest_public = PrivateServer._public

    def public(self, step):
        out = honest_public(self, step)
        params = out[PARAMS].copy()
        params[4] *= scale_share
        if claim_devices is None:
            params = params[:6]
        else:
            params[6] = claim_devices
        return {**out, PARAMS: params}

    return public


@pytest.mark.parametrize("lie", ["cohort_and_noise", "missing_field"])
def test_a_coordinator_lying_about_cohort_or_noise_is_refused_and_never_charged(tmp_path, model_kind,
                                                                                 monkeypatch, lie):
    """The server claims 100 times the cohort's honest devices and hands each a tenth of the
    share (the declared multiplier unchanged), or leaves out the field a device needs to account
    the step. Devices with a floor refuse before training (the floor: share_mismatch), devices
    with a budget alone charge only the noise they verified (a tenth, over at most the cohort),
    never what was declared; a step that cannot be accounted is refused by every device, and
    nothing of it is sent or charged."""
    n, wary = 10, 3
    if lie == "cohort_and_noise":
        monkeypatch.setattr(PrivateServer, "_public", _lying(0.1, 1000.0))
    else:
        monkeypatch.setattr(PrivateServer, "_public", _lying(1.0, None))
    budget = PrivacyBudget(1e6, DELTA)

    async def main():
        async with in_process().whole_system(tmp_path) as s:
            job_id = await s.submit(_spec(model_kind, 1, n + wary, PRIVACY).replace("retries: 3", "retries: 0"))
            metrics = ClientMetrics()
            fleets = [s.fleet(_updates(n), seed=1, privacy_budget=budget),
                      s.fleet(_updates(wary), seed=2, id_prefix="wary", metrics=metrics, privacy_budget=budget,
                              device_policy=DevicePolicy(min_noise_multiplier=0.5))]
            try:
                await asyncio.gather(*(f.run(until=f.until_job_done(job_id, every_seconds=0.2)) for f in fleets))
            finally:
                for fleet in fleets:
                    fleet.close()
            return await s.job(job_id), fleets, metrics

    job, (trusting, wary_fleet), metrics = run(main())
    for device in wary_fleet.devices:
        assert device.privacy.releases == []
        assert device.stats.contributed == []
    if lie == "missing_field":
        for device in trusting.devices:  # (the wary ones refuse it at their floor first)
            assert device.privacy.releases == [] and device.stats.contributed == []
            # Refused by name, unless the others' refusals ended the session before this device
            # (slow under load) reached the step: then it had nothing to refuse.
            assert set(device.stats.failures[job.job_id]) <= {"invalid_task", "session_aborted"}
        assert any("invalid_task" in d.stats.failures[job.job_id] for d in trusting.devices)
        assert job.state == common_pb2.JOB_STATE_FAILED
        return
    assert metrics.registry.get_sample_value("tally_client_privacy_checks_total", {"outcome": "share_mismatch"}) >= 1
    charged = [r for d in trusting.devices for r in d.privacy.releases]
    assert charged and all(r.noise_multiplier < 0.15 for r in charged)  # about 0.1 * sqrt(10 / 10), not 1.0


def _devices_out_of_budget(s, job_id: str) -> float | None:
    """The coordinator's gauge, as Prometheus scrapes it."""
    return next((sample.value for family in text_string_to_metric_families(scrape_text(s.coordinator.metrics_port))
                 for sample in family.samples
                 if sample.name == "tally_coordinator_devices_out_of_budget" and sample.labels["job_id"] == job_id),
                None)


async def _state_spent(s, job_id: str, prefix: str, count: int) -> None:
    """Run devices ``<prefix>-00000``.. whose ledgers refused the job (what they state at each
    check-in) until the coordinator counts them, or the job ends."""
    before = (await s.job(job_id)).devices_out_of_budget
    fleet = s.fleet(_updates(count), seed=1, id_prefix=prefix)
    for device in fleet.devices:
        device.privacy.spent_jobs = [job_id]

    async def counted(_stats) -> bool:
        job = await s.job(job_id)
        return job.state != common_pb2.JOB_STATE_RUNNING or job.devices_out_of_budget >= before + count

    try:
        await fleet.run(until=counted)
    finally:
        fleet.close()


@pytest.mark.parametrize("then", ["a_fifth_device_states_it", "recorded_before_a_crash"])
def test_devices_out_of_budget_outlive_a_coordinator_restart(tmp_path, model_kind, then):
    """Four of ten devices state that their budget is spent for a job of min_cohort 6; the
    coordinator restarts. From its store alone (no device has said it again) it still counts the
    four and turns them away. Then the job is left without enough eligible devices: a fifth
    device says so after the restart, or its statement was recorded just before a crash (the
    coordinator stopped between recording it and failing the job); either way the job fails at
    once, naming the five, rather than waiting out its selection."""
    spent, eligible = 4, 6

    async def main():
        async with in_process().whole_system(tmp_path) as s:
            # A selection of 7 that never closes by itself: what happens below is the devices'
            # statements, never a round.
            job_id = await s.submit(re.sub(r"deadlines: \{.*\}", UNHURRIED, _spec(model_kind, 2, eligible + 1)))
            population = s.coordinator.store.devices.population_size
            enrolled = s.fleet(_updates(eligible), seed=1, id_prefix="ok")  # first: the population is all 10
            try:
                await enrolled.run(until=lambda _stats: population("default") >= eligible)
            finally:
                enrolled.close()
            await _state_spent(s, job_id, "spent", spent)
            await s.restart_coordinator()
            resumed = await s.job(job_id)
            assert resumed.state == common_pb2.JOB_STATE_RUNNING and resumed.devices_out_of_budget == spent
            assert _devices_out_of_budget(s, job_id) == spent
            runner = s.coordinator.jobs.runner(job_id)
            turned_away = [runner.offer(d, time.monotonic()) for d in device_ids("spent", spent)]
            assert all(isinstance(r, Retry) and "privacy budget is spent" in r.reason for r in turned_away), \
                turned_away
            if then == "a_fifth_device_states_it":
                await _state_spent(s, job_id, "ok", 1)
            else:
                def crashed_after_recording_a_fifth() -> None:
                    store = Store(s.state_dir)
                    store.add_out_of_budget(job_id, device_ids("ok", 1)[0])
                    store.close()

                await s.restart_coordinator(crashed_after_recording_a_fifth)
            await s.until_done(job_id)
            return await s.job(job_id)

    job = run(main())
    assert job.state == common_pb2.JOB_STATE_FAILED, job.message
    assert job.message == ("out of eligible devices: 5 of the 10 devices of population 'default' have spent their "
                           "own privacy budget for this job, 5 remain, fewer than min_cohort 6"), job.message
    assert job.committed_round == 0
