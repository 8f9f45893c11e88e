"""Smoke size of the secure-sum engine benchmark: it runs, is correct and writes its JSON.

Not a timed test (DESIGN.md section 9): it only checks that timings are measured at all.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "secagg_engine.py"

KEYS = (
    "clients", "dim", "dropout", "k", "t", "bits", "wire_bits", "client_mask_s", "server_unmask_s",
    "limit_client_s", "limit_server_s", "client_ratio", "server_ratio",
    "upload_bytes_per_client", "masked_input_bytes", "plain_bytes_per_client", "upload_ratio",
    "correct", "max_abs_error", "server_phase_s", "client_phase_median_s", "wall_s", "machine",
)


@pytest.mark.parametrize("phase", ["shares", "masked"])
def test_engine_bench_smoke(tmp_path, phase):
    out = tmp_path / f"engine_{phase}.json"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--clients", "12", "--dim", "50", "--dropout", "0.1",
         "--phase", phase, "--repeat", "1", "--limit-repeat", "3", "--json", str(out)],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = json.loads(out.read_text())
    missing = [k for k in KEYS if k not in data]
    assert not missing, missing
    assert data["clients"] == 12 and data["dim"] == 50 and data["dropout"] == 0.1
    assert data["correct"] is True
    assert data["max_abs_error"] <= data["quantisation_bound"]
    assert data["k"] == 11 and 2 <= data["t"] <= data["k"]
    for key in ("client_mask_s", "server_unmask_s", "limit_client_s", "limit_server_s", "wall_s"):
        assert data[key] > 0, key
    assert data["bits"] <= data["wire_bits"] <= 64
    assert data["masked_input_bytes"] == (50 * data["wire_bits"] + 7) // 8
    assert data["plain_bytes_per_client"] == 4 * 50
    assert data["upload_bytes_per_client"] >= data["masked_input_bytes"]
    # One device drops: after ShareKeys (its pairwise masks must be removed) or after sending.
    if phase == "shares":
        assert data["server_pairwise_masks"] == 11 and data["server_self_masks"] == 11
    else:
        assert data["server_pairwise_masks"] == 0 and data["server_self_masks"] == 12


def test_engine_bench_help():
    proc = subprocess.run([sys.executable, str(SCRIPT), "--help"], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0
    assert "--clients" in proc.stdout and "--phase" in proc.stdout


def _grid(out_dir: Path, *extra: str) -> dict:
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--grid", "--grid-clients", "12", "--grid-dims", "50",
         "--repeat", "1", "--limit-repeat", "1", "--out-dir", str(out_dir), *extra],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads((out_dir / "engine_grid.json").read_text())


def test_grid_merge_replaces_only_the_points_run_again(tmp_path):
    first = _grid(tmp_path, "--grid-phases", "shares", "masked")
    assert sorted(p["phase"] for p in first["points"]) == ["masked", "shares"]
    assert all(p["correct"] and p["measured_on"] for p in first["points"])
    assert (tmp_path / "engine_grid.png").stat().st_size > 0

    merged = _grid(tmp_path, "--grid-phases", "masked", "--grid-merge")
    by_phase = {p["phase"]: p for p in merged["points"]}
    assert sorted(by_phase) == ["masked", "shares"]
    kept = next(p for p in first["points"] if p["phase"] == "shares")
    rerun = next(p for p in first["points"] if p["phase"] == "masked")
    assert by_phase["shares"] == kept
    assert by_phase["masked"]["wall_s"] != rerun["wall_s"]  # a new measurement, not the old one
    assert [m["points"] for m in merged["merged"]] == [[[12, 50, "masked"]]]
    assert "--grid-phases masked" in merged["merged"][0]["command"]
