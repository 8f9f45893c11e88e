"""Distributed DP through the real services: coordinator, two aggregators and an SDK fleet with
masking on. Devices add their discrete Gaussian shares in the ring; the coordinator's decoded
total carries the noise, the ledger accounts the survivors' noise in the round metrics and in
``tally_privacy_epsilon``."""

from __future__ import annotations

import re

import numpy as np

from test_full_stack import scrape_text
from test_full_stack_algorithms import run_job
from tally.privacy.accounting import PrivacyLedger


class ShiftDevice:
    """Training moves every parameter by ``shift``: the noiseless FedAvg result is known."""

    def __init__(self, shift: float) -> None:
        self.shift = shift

    @property
    def num_examples(self) -> int:
        return 1

    def train(self, params, epochs, lr, batch_size):
        return {k: np.asarray(v) + self.shift for k, v in params.items()}, 0.0

    def evaluate(self, params):
        return 0.0, 0.0


def test_distributed_dp_fedavg_through_the_services(tmp_path):
    n, rounds, shift = 10, 2, 0.01
    initial = {"w": np.zeros(63)}  # 63 values and FedAvg's weight: 64 in the rotation

    async def probe(stack, job_id):
        return scrape_text(stack.coordinator.metrics_port), stack.coordinator.store.rounds(job_id)

    state, (metrics_text, records) = run_job(
        tmp_path, "fedavg", {"example_cap": 1, "local_epochs": 1}, "dp-shift", initial,
        [ShiftDevice(shift) for _ in range(n)], rounds,
        extra="privacy: {mechanism: distributed, clip: 1.0, noise_multiplier: 0.5}\n", probe=probe,
    )
    w = state.params["w"]
    # Noiseless FedAvg would give exactly rounds * shift everywhere. The sum's noise (std about
    # 0.5 * 1.01 over a total weight of ~10, per round) must be there, and the decoded model must
    # still be that result plus noise of that size (a wrong scale or rotation gives garbage).
    assert 0.01 < w.std() < 0.3
    assert abs(w.mean() - rounds * shift) < 0.05
    committed = sorted((r for r in records if r.state == "committed"), key=lambda r: r.round)
    assert [r.round for r in committed] == list(range(1, rounds + 1))
    replayed = PrivacyLedger(1e-5)
    for record in committed:
        m = record.metrics
        # Honest survivors: every contributor but the ceil(0.05 * 10) = 1 the threat model lets
        # collude with the server.
        assert m["privacy.noise_devices"] == m["update.contributors"] - 1
        replayed.replay(record.round, m)
    final = committed[-1].metrics["privacy.epsilon"]
    assert final == replayed.epsilon > committed[0].metrics["privacy.epsilon"] > 0
    gauge = re.search(r'tally_privacy_epsilon\{job_id="[^"]+"\} (\S+)', metrics_text)
    assert gauge is not None and float(gauge.group(1)) == final
