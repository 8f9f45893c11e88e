"""The in-process simulator: FedAvg through the real secure sum equals the plain sum up
to quantisation, and learns the bundled digits task."""

from __future__ import annotations

import json

import numpy as np

from tally import algorithms
from tally.algorithms.base import flatten
from tally.cli import main
from tally.datasets.digits import digits
from tally.models.mlp import mlp
from tally.models.params import get_params
from tally.secagg import ThreatModel
from tally.sim.rounds import SecureSum, plain_sum, run_rounds
from tally.training import TorchTrainer, single_threaded


def _devices(clients=12, seed=0):
    single_threaded()
    fed = digits(clients, alpha=0.5, seed=seed)
    factory = lambda: mlp(fed.num_features, fed.num_classes, seed=seed)  # noqa: E731
    devices = [TorchTrainer(factory, X, y, seed=i) for i, (X, y) in enumerate(fed.clients)]
    return devices, get_params(factory())


def test_secure_fedavg_equals_plain_fedavg_up_to_quantisation():
    results = []
    for sum_fn in (plain_sum, SecureSum(ThreatModel(0.0, 0.0, malicious_server=False))):
        devices, initial = _devices()
        server, client = algorithms.make("fedavg", {"local_epochs": 1})
        state, logs = run_rounds(server, client, devices, initial, rounds=2, cohort_size=12, sum_fn=sum_fn)
        results.append(flatten(server.model(state)))
    plain, secure = results
    assert not np.allclose(plain, flatten(_devices()[1])), "training must move the model"
    # Per round: |error of Σ w·Δ| <= n 2^-f and Σ w >= its smallest share; two rounds.
    assert np.max(np.abs(plain - secure)) < 1e-4


def test_simulate_cli_learns_digits_and_reports_fairness(tmp_path):
    out = tmp_path / "sim.json"
    assert main(["simulate", "--clients", "20", "--rounds", "8", "--dropout", "0.1", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["secure"] is True
    assert len(report["per_round"]) == 8
    accuracies = [r["test_accuracy"] for r in report["per_round"]]
    assert accuracies[-1] > 0.8 > accuracies[0]
    final = report["final"]
    assert len(final["per_device_accuracy"]) == 20
    assert 0 <= final["gini"] < 1 and final["worst10_accuracy"] <= final["mean_accuracy"]
    # Dropouts really happened: some rounds summed fewer devices than the cohort.
    assert min(r["contributors"]["update"] for r in report["per_round"]) < 20


def test_simulate_report_compares_against_fedavg_with_plots(tmp_path):
    out, report_dir = tmp_path / "agn.json", tmp_path / "report"
    args = ["simulate", "--algorithm", "agnostic_fedavg", "--dataset", "toy-regression", "--clients", "20",
            "--domains", "5", "--rounds", "40", "--json", str(out), "--report", str(report_dir)]
    assert main(args) == 0
    final = json.loads(out.read_text())["final"]
    assert len(final["per_domain_loss"]) == 5
    assert final["worst_domain_loss"] == max(final["per_domain_loss"])
    summary = json.loads((report_dir / "summary.json").read_text())
    assert summary["agnostic_fedavg"]["worst_domain_loss"] < summary["fedavg"]["worst_domain_loss"]
    rounds = json.loads((report_dir / "rounds.json").read_text())
    lambdas = np.array([r["lambda"] for r in rounds["agnostic_fedavg"]])
    np.testing.assert_allclose(lambdas.sum(axis=1), 1.0, atol=1e-9)
    for name in ("loss.png", "weights.png", "per_domain.png"):
        assert (report_dir / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
