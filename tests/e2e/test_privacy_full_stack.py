"""Distributed DP through the real services: coordinator, two aggregators and an SDK fleet with
masking on. Devices add their discrete Gaussian shares in the ring; the coordinator's decoded
total carries the noise, the ledger accounts the survivors' noise in the round metrics and in
``tally_privacy_epsilon``."""

from __future__ import annotations

import asyncio
import re

import numpy as np

from support.jobs import ShiftDevice, job_text, run_job
from support.stack import in_process, run, scrape_text
from tally.coordinator.spec import catalogue
from tally.privacy.accounting import PrivacyLedger
from tally.wire.v1 import common_pb2

PRIVACY = "privacy: {mechanism: distributed, clip: 1.0, noise_multiplier: 0.5}\n"


def test_distributed_dp_fedavg_through_the_services(tmp_path):
    n, rounds, shift = 10, 2, 0.01
    initial = {"w": np.zeros(63)}  # 63 values and FedAvg's weight: 64 in the rotation

    async def probe(stack, job_id):
        return scrape_text(stack.coordinator.metrics_port), stack.coordinator.store.rounds(job_id), job_id

    state, (metrics_text, records, job_id) = run_job(
        tmp_path, "fedavg", {"example_cap": 1, "local_epochs": 1}, "dp-shift", initial,
        [ShiftDevice(shift) for _ in range(n)], rounds,
        extra=PRIVACY, probe=probe,
    )
    w = state.params["w"]
    # Noiseless FedAvg would give exactly rounds * shift everywhere. The sum's noise (std about
    # 0.5 * 1.01 over a total weight of ~10, per round) must be there, and the decoded model must
    # still be that result plus noise of that size (a wrong scale or rotation gives garbage).
    assert 0.01 < w.std() < 0.3
    assert abs(w.mean() - rounds * shift) < 0.05
    replayed, committed = replayed_epsilon(records)
    assert [r.round for r in committed] == list(range(1, rounds + 1))
    for record in committed:
        # Honest survivors: every contributor but the ceil(0.05 * 10) = 1 the threat model lets
        # collude with the server.
        assert record.metrics["privacy.noise_devices"] == record.metrics["update.contributors"] - 1
    final = committed[-1].metrics["privacy.epsilon"]
    assert final == replayed > committed[0].metrics["privacy.epsilon"] > 0
    # This job's gauge: the registry is the process's, other tests' jobs may be on it too.
    gauge = re.search(rf'tally_privacy_epsilon\{{job_id="{re.escape(job_id)}"\}} (\S+)', metrics_text)
    assert gauge is not None and float(gauge.group(1)) == final


def test_a_final_evaluation_round_is_one_more_release_in_the_epsilon(tmp_path):
    """``evaluation: {final: true}`` under distributed DP: the round that only scores the final
    model releases its noisy metric sums, and the accountant counts it like any sum."""
    n, rounds = 10, 2
    initial = {"w": np.zeros(63)}

    async def probe(stack, job_id):
        return stack.coordinator.store.rounds(job_id)

    _, records = run_job(
        tmp_path, "fedavg", {"example_cap": 1, "local_epochs": 1}, "dp-final", initial,
        [ShiftDevice(0.01) for _ in range(n)], rounds, extra=PRIVACY + "evaluation: {final: true}\n", probe=probe,
    )
    replayed, committed = replayed_epsilon(records)
    assert [r.round for r in committed] == [1, 2, 3]
    last = committed[-1].metrics
    assert last["evaluation_only.of_round"] == rounds and "update.contributors" not in last
    assert last["eval.devices"] == last["evaluation.contributors"]  # counted exactly, not noised
    assert "eval.examples" not in last  # an exact count: withheld under DP
    assert last["privacy.epsilon"] == replayed > committed[1].metrics["privacy.epsilon"]


def replayed_epsilon(records) -> tuple[float, list]:
    committed = sorted((r for r in records if r.state == "committed"), key=lambda r: r.round)
    ledger = PrivacyLedger(1e-5)
    for record in committed:
        ledger.replay(record.round, record.metrics)
    return ledger.epsilon, committed


def test_a_restarted_coordinator_keeps_the_epsilon_spent(tmp_path):
    """The ledger is rebuilt from the committed rounds: after a restart the job's epsilon keeps
    growing from what was spent, not from zero."""
    rounds, n = 3, 10
    text = job_text("dp-restart", "fedavg", rounds, n, "dp-restart", {"example_cap": 1}) + PRIVACY
    catalogue.register_model("dp-restart", lambda _spec: {"w": np.zeros(15)})

    async def main():
        async with in_process().whole_system(tmp_path) as s:
            job_id = await s.submit(text)
            fleet = s.fleet([ShiftDevice(0.01) for _ in range(n)], seed=1)
            running = asyncio.create_task(fleet.run(until=fleet.until_job_done(job_id, every_seconds=0.2)))
            await s.committed(job_id, 1)
            await s.restart_coordinator()
            await running
            fleet.close()
            return await s.job(job_id), s.coordinator.store.rounds(job_id)

    try:
        job, records = run(main())
    finally:
        catalogue.unregister_model("dp-restart")
    assert job.state == common_pb2.JOB_STATE_SUCCEEDED, job.message
    total, committed = replayed_epsilon(records)
    after_restart = PrivacyLedger(1e-5)
    for record in committed[1:]:
        after_restart.replay(record.round, record.metrics)
    assert committed[-1].metrics["privacy.epsilon"] == total > after_restart.epsilon


def test_devices_refuse_noise_below_their_floor_through_the_services(tmp_path):
    """Devices started with a noise floor above the job's noise take no part in its sums: they
    refuse each step when its broadcast shows the noise (task report reason privacy_floor,
    tally_client_privacy_checks_total{outcome="below_floor"}), while the others' sums commit."""
    from tally.client.metrics import ClientMetrics
    from tally.secagg import DevicePolicy

    rounds, trusting, wary = 2, 14, 3
    text = job_text("dp-floor", "fedavg", rounds, trusting + wary, "dp-floor", {"example_cap": 1}).replace(
        "dropout_rate: 0.1", "dropout_rate: 0.2").replace("min_cohort: 5", "min_cohort: 12") + PRIVACY  # z 0.5
    catalogue.register_model("dp-floor", lambda _spec: {"w": np.zeros(15)})

    async def main():
        async with in_process().whole_system(tmp_path) as s:
            job_id = await s.submit(text)
            metrics = ClientMetrics()
            fleets = [s.fleet([ShiftDevice(0.01) for _ in range(trusting)], seed=1, id_prefix="trusting"),
                      s.fleet([ShiftDevice(0.01) for _ in range(wary)], seed=2, id_prefix="wary", metrics=metrics,
                              device_policy=DevicePolicy(min_noise_multiplier=1.0))]
            stats = await asyncio.gather(*(f.run(until=f.until_job_done(job_id, every_seconds=0.2)) for f in fleets))
            for fleet in fleets:
                fleet.close()
            return await s.job(job_id), s.coordinator.store.rounds(job_id), stats, metrics

    try:
        job, records, (trusted_stats, wary_stats), metrics = run(main())
    finally:
        catalogue.unregister_model("dp-floor")
    assert job.state == common_pb2.JOB_STATE_SUCCEEDED, job.message
    assert trusted_stats.rounds[job.job_id] == list(range(1, rounds + 1))
    assert wary_stats.rounds.get(job.job_id, []) == []  # not one sum holds a wary device's input
    refused = metrics.registry.get_sample_value("tally_client_privacy_checks_total", {"outcome": "below_floor"})
    assert refused is not None and refused >= rounds
    committed = [r for r in records if r.state == "committed"]
    assert all(r.metrics["update.contributors"] <= trusting for r in committed)
