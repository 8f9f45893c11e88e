"""``tally demo`` as an operator runs it (issue 9, items 5 and 10): SIGTERM stops its coordinator
and aggregators instead of orphaning them, a re-run starts from a fresh state instead of silently
resuming the interrupted job beside the new one, ``--resume`` continues that job on purpose, and
too few devices are refused with the reason. Real processes throughout."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tally.cli.demo import TOLERANCE_SE
from tally.coordinator.state.store import Store

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").exists(),
                                reason="needs Linux /proc to find child processes")


def _children(pid: int) -> list[int]:
    """Live (not zombie) processes whose parent is ``pid``."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid and fields[0] != "Z":
            found.append(int(entry.name))
    return found


def _alive(pid: int) -> bool:
    try:
        return (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _demo(*argv: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "tally.cli", "demo", "--devices", "60", *argv], cwd=REPO,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, "COLUMNS": "200"},
    )


def _until_logged(log: Path, needle: str, timeout_s: float = 120) -> None:
    """Until a line of ``log`` (written by another process) contains ``needle``."""
    deadline = time.monotonic() + timeout_s
    while not (log.exists() and needle in log.read_text()):
        assert time.monotonic() < deadline, f"{log} never logged {needle!r}"
        time.sleep(0.05)


def _interrupt_once_the_job_runs(out: Path, rounds: int, logged: str | None = None,
                                 *argv: str) -> tuple[str, list[int]]:
    """Start a demo, SIGTERM it once its job was submitted (and, with ``logged``, once the first
    aggregator's log has that text); the job id and the children it had."""
    demo = _demo("--rounds", str(rounds), "--out", str(out), *argv)
    try:
        job_id = None
        for line in demo.stdout:
            if match := re.search(r"job (\S+): fedavg", line):
                job_id = match.group(1)
                break
        assert job_id is not None, demo.stderr.read()
        if logged is not None:
            _until_logged(out / "logs" / "aggregator-1.log", logged)
        children = _children(demo.pid)
        assert len(children) == 3, children  # two aggregators and the coordinator
        demo.send_signal(signal.SIGTERM)
        code = demo.wait(timeout=60)
        assert code == 128 + signal.SIGTERM
        err = demo.stderr.read()
        assert "stopped by SIGTERM; its coordinator and aggregators were stopped" in err
        assert "Traceback" not in err and "never retrieved" not in err, err  # the message, and nothing after it
    finally:
        if demo.poll() is None:
            demo.kill()
    return job_id, children


def _jobs(state: Path) -> list:
    store = Store(state)
    try:
        return store.jobs()
    finally:
        store.close()


def test_sigterm_stops_the_children_and_a_rerun_starts_fresh(tmp_path):
    out = tmp_path / "demo"
    old_job, children = _interrupt_once_the_job_runs(out, rounds=20)
    deadline = time.monotonic() + 30
    while any(_alive(pid) for pid in children) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [pid for pid in children if _alive(pid)], "children outlived the demo"
    assert [j.state in ("PENDING", "RUNNING") for j in _jobs(out / "state")] == [True]  # what a re-run resumed
    assert old_job in (out / "logs" / "coordinator.log").read_text()

    rerun = _demo("--rounds", "1", "--out", str(out))
    stdout, stderr = rerun.communicate(timeout=240)
    assert rerun.returncode in (0, 1), stderr  # 1: one round may not reach 90 % accuracy
    # The last line says whether the run reached 90 % (the quickstart promises it), and why not.
    last = (stdout if rerun.returncode == 0 else stderr).strip().splitlines()[-1]
    assert ("reached 90 %" in last) if rerun.returncode == 0 else ("below 0.9" in last or "job " in last), last
    assert "fresh state: removed the previous run's" in stdout
    jobs = _jobs(out / "state")
    assert len(jobs) == 1 and jobs[0].job_id != old_job and jobs[0].state == "SUCCEEDED"
    # Fresh logs with fresh state (issue 25, item 7): the old job is in none of them.
    assert not any(old_job in log.read_text() for log in (out / "logs").iterdir())


def test_resume_continues_the_job_interrupted_while_devices_send_inputs(tmp_path):
    """Issue 25, item 1: SIGTERM while round 1's devices train and send their masked inputs. The
    resumed round may not seat a device that sent one; it used to fail for lack of devices, as
    every device of the interrupted attempt was turned away, its reports lost with the fleet.
    Without the demo's simulated dropouts: they may fail a cohort of either run (then the round is
    retried), and the test asks that the interruption alone costs exactly one attempt."""
    out = tmp_path / "demo"
    old_job, _ = _interrupt_once_the_job_runs(
        out, 2, '"event": "phase closed", "phase": "share_complaints"', "--dropout", "0")
    resumed = _demo("--resume", "--out", str(out), "--dropout", "0")
    stdout, stderr = resumed.communicate(timeout=240)
    assert resumed.returncode in (0, 1), stderr  # 1: two rounds may not reach 90 % accuracy
    assert f"job {old_job}: resumed after round 0" in stdout
    jobs = _jobs(out / "state")
    assert [(j.job_id, j.state) for j in jobs] == [(old_job, "SUCCEEDED")], jobs
    store = Store(out / "state")
    try:
        attempts = [(r.round, r.state, r.message) for r in store.rounds(old_job)]
    finally:
        store.close()
    # SIGTERM stops the demo's devices and its coordinator together: the interrupted attempt ends
    # either with the coordinator (interrupted) or, when the devices went first, with the
    # aggregator's abort for want of their messages (in whichever phase, too few answered). Either
    # way it failed and round 1 committed after.
    failed = [message for round_, state, message in attempts if (round_, state) == (1, "failed")]
    assert len(failed) == 1 and (failed[0] == "interrupted: coordinator stopped"
                                 or re.search(r"session aborted: \S+: \d+ devices answered, at least \d+ are required",
                                              failed[0])), attempts
    assert (1, "committed", "") in attempts
    assert "job resumed" in (out / "logs" / "coordinator.log").read_text()


def test_demo_argument_mistakes_are_one_line(tmp_path):
    for argv, needle in ((["--devices", "10"], "argument --devices: the demo needs at least 60 devices"),
                         (["--dropout", "1.5"], "argument --dropout: must be a number in [0, 1), got '1.5'"),
                         (["--resume", "--out", str(tmp_path / "none")], "--resume: no earlier demo state in")):
        done = subprocess.run([sys.executable, "-m", "tally.cli", "demo", *argv], cwd=REPO, capture_output=True,
                              text=True, timeout=120)
        assert done.returncode != 0 and needle in done.stderr and "Traceback" not in done.stderr, done.stderr


def test_the_demo_shows_federated_evaluation_agreeing_with_its_central_score(tmp_path):
    """Issue 37, item 7: beside the ONNX score on the bundled test digits, the devices' own
    held-out figures (sums through secure aggregation, from GetJobMetrics) for each model, and
    the two agree within the stated tolerance."""
    out = tmp_path / "demo"
    demo = _demo("--rounds", "3", "--out", str(out))
    stdout, stderr = demo.communicate(timeout=240)
    assert demo.returncode in (0, 1), stderr  # 1: three rounds do not reach 90 % accuracy
    report = json.loads((out / "report.json").read_text())
    federated, agreement = report["federated"], report["agreement"]
    # Round r's devices scored the model of round r - 1: the initial one, then each but the last,
    # which the final evaluation's round 4 scored (evaluation: {final: true}).
    assert [f["model"] for f in federated] == [0, 1, 2, 3] and [f["round"] for f in federated] == [1, 2, 3, 4]
    assert report["rounds"] == 3
    central = [report["initial_accuracy"], *report["accuracy_per_round"]]
    for f in federated:
        assert 0 < f["examples"] and 0 < f["devices"] <= report["devices"]
        assert abs(f["difference"] - (f["accuracy"] - central[f["model"]])) < 1e-12
        assert f["standard_errors"] <= TOLERANCE_SE, f
    assert agreement["models_compared"] == 4 and agreement["within_tolerance"]
    assert agreement["max_abs_difference"] == max(abs(f["difference"]) for f in federated)
    assert "federated (devices' held-out)" in stdout
    assert f"federated evaluation vs the central test score: agree within {TOLERANCE_SE:g} standard errors " \
           "for all 4 models" in stdout, stdout
