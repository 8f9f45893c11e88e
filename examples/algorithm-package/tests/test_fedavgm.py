"""fedavgm's tests, with Tally's test kit (tally.testing): rounds in process through the real secure
sum with dropouts, and a job through real services with a fleet of devices that have the package
installed; in both the server half must receive exactly the sums of what the devices sent. Run
them with the package installed (`pip install -e .`), so its entry point is what is tested."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from tally.algorithms import packages
from tally.testing import OtherFleet, assert_exact, digits_devices, run_in_process, run_job

JOB = (Path(__file__).parents[1] / "job.yaml").read_text()


def test_the_package_is_installed_and_accepted():
    assert "fedavgm" in packages.names(), [str(p) for p in packages.problems()]
    assert not [p for p in packages.problems() if p.package == "tally-fedavgm"]


def test_rounds_through_the_secure_sum_with_dropouts_hand_the_server_exact_sums():
    devices, initial = digits_devices(8)
    run = run_in_process("fedavgm", devices, initial, rounds=2, dropout=0.25, options={"server_momentum": 0.5})
    assert_exact(run.sums)
    assert all(len(s.contributors) < len(devices) for s in run.sums)  # someone dropped out each time
    moved = max(float(np.max(np.abs(run.state.params[k] - initial[k]))) for k in initial)
    assert moved > 0


def test_a_job_through_the_services_commits_exact_sums_and_seats_only_devices_with_the_package():
    devices, _ = digits_devices(6)
    without, _ = digits_devices(6, seed=1)
    other_version, _ = digits_devices(6, seed=2)
    no_model, _ = digits_devices(6, seed=3)
    version = packages.get("fedavgm").version
    result = run_job(JOB, devices, others=[
        OtherFleet(without, {}, id_prefix="without"),
        OtherFleet(other_version, {"fedavgm": version + "-other"}, id_prefix="other-version"),
        # The package installed, but not the job's model kind.
        OtherFleet(no_model, {"fedavgm": version}, id_prefix="no-model", model_kinds={}),
    ])
    result.assert_exact()
    assert result.job.committed_round == 2
    assert [s.tasks_done for s in result.others] == [0, 0, 0]  # checked in, never seated
    assert all(s.checkins > 0 for s in result.others)
