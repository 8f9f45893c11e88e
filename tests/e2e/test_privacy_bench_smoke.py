"""Smoke size of the DP benchmarks: they run, write their JSON and plot, and report what the
README quotes (spent epsilon equal to the target, a chosen ring width, accuracies)."""

import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench"


def run(script: str, *args: str) -> None:
    proc = subprocess.run([sys.executable, str(BENCH / script), *args], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_dp_digits_smoke(tmp_path):
    out, plot = tmp_path / "dp.json", tmp_path / "dp.png"
    run("dp_digits.py", "--clients", "20", "--cohort", "8", "--rounds", "2", "--hidden", "4", "--seeds", "1",
        "--epsilons", "8", "--bits-epsilon", "8", "--bits", "6", "16", "--json", str(out), "--plot", str(plot))
    rows = json.loads(out.read_text())["rows"]
    assert [r["mechanism"] for r in rows] == ["none", "central", "distributed", "distributed", "distributed"]
    refused, forced = rows[3], rows[4]
    assert "bits cannot hold" in refused["refused"]  # 6 bits: the planner says why
    assert abs(rows[1]["epsilon_spent"] - 8) < 0.01  # central: exactly the calibrated noise
    # Distributed: what the honest survivors' noise gave in each Poisson-sampled cohort (more or
    # fewer devices than the 8 planned), not the target.
    for r in (rows[2], forced):
        assert 0 < r["epsilon_spent"] < float("inf")
    for r in rows[:3] + [forced]:
        assert 0 <= r["accuracy"] <= 1
    assert forced["bits"] <= 16 and rows[2]["bits"] >= 2
    assert plot.stat().st_size > 0


def test_dp_ring_bits_smoke(tmp_path):
    out = tmp_path / "bits.json"
    run("dp_ring_bits.py", "--dim", "100", "--cohorts", "10", "100000", "--noise-multipliers", "1", "--json", str(out))
    small, large = json.loads(out.read_text())["rows"]
    assert small["bits"] < large["bits"] and large["beyond_tff_cap"]


def test_dp_digits_through_the_services_smoke(tmp_path):
    """--services: a coordinator, two aggregators (processes, TLS) and a fleet run the job with and
    without distributed DP; each row holds the services' run and the in-process run beside it."""
    out, plot = tmp_path / "services.json", tmp_path / "services.png"
    run("dp_digits.py", "--services", "--clients", "40", "--cohort", "16", "--rounds", "2", "--hidden", "4",
        "--seeds", "1", "--epsilons", "8", "--workdir", str(tmp_path / "work"), "--json", str(out),
        "--plot", str(plot))
    none, private = json.loads(out.read_text())["rows"]
    assert none["target_epsilon"] is None and private["target_epsilon"] == 8
    for row in (none, private):
        assert row["services"]["committed_rounds"] == 2 and 0 <= row["services"]["accuracy"] <= 1
        assert 0 <= row["in_process"]["accuracy"] <= 1
    assert "epsilon_spent" not in none["services"]
    # The ledger's epsilon from the committed rounds' honest survivors: positive and finite, and,
    # with cohorts near the planned 16, near the target.
    assert 0 < private["services"]["epsilon_spent"] < 2 * 8
    assert plot.stat().st_size > 0
