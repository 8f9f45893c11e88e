"""`tally fleet` and `tally client` end non-zero when the job they served failed or no task ever
came (issue 39, item 1): against a FAILED job the fleet printed its counts and exited 0, and
against a coordinator that seated nobody `tasks 0 · sessions ok 0` and exit 0, so a load test in
CI passed while every device failed. The commands run as processes against the real services."""

from __future__ import annotations

import asyncio
import signal
import sys
from pathlib import Path

import pytest

from support.stack import in_process, run
from tally.cli import build_parser, exit_codes
from tally.datasets.digits import digits
from tally.models.mlp import mlp
from tally.security.enrolment import SharedKeyEnrolment
from tally.training import TorchTrainer

REPO = Path(__file__).resolve().parents[2]


def _spec(cohort: int, checkin_s: float, retries: int) -> str:
    return (f"name: verdict\nalgorithm: fedavg\nrounds: 1\ncohort_size: {cohort}\nover_selection: 1.0\n"
            f"min_cohort: 5\nretries: {retries}\nmodel: {{inputs: 64, classes: 10, hidden: 16, seed: 0}}\n"
            "options: {local_epochs: 1, local_lr: 0.1, batch_size: 16}\n"
            f"deadlines: {{checkin: {checkin_s}, download: 10, advertise_keys: 4, share_keys: 4, "
            "masked_input: 8, unmask: 4}\n")


async def _tally(*argv: str) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        sys.executable, "-m", "tally.cli", *argv, cwd=REPO, stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE)


def test_a_fleet_whose_job_failed_exits_4_naming_the_job_and_reasons(tmp_path):
    """The fleet trains a model of another shape than the job's: every task fails with
    model_mismatch, the coordinator stops the job, and the fleet says so and exits 4."""

    async def main() -> tuple[str, int, str]:
        async with in_process().whole_system(tmp_path) as stack:
            (tmp_path / "enrolment.key").write_bytes(stack.coordinator.enrolment_key)
            job_id = await stack.submit(_spec(cohort=5, checkin_s=10, retries=3))
            fleet = await _tally("fleet", "--coordinator", stack.target, "--insecure", "--devices", "6",
                                 "--hidden", "8", "--no-progress", "--enrolment-key", str(tmp_path / "enrolment.key"))
            _, err = await asyncio.wait_for(fleet.communicate(), 180)
            assert (await stack.job(job_id)).message  # the coordinator's own reason
            return job_id, fleet.returncode, err.decode()

    job_id, code, err = run(main())
    assert code == exit_codes.JOB_FAILED, err
    line = next(line for line in err.splitlines() if f"job {job_id} FAILED" in line)
    assert line.startswith(f"tally fleet: job {job_id} FAILED: model_mismatch x"), err


def test_a_fleet_never_given_a_task_exits_5(tmp_path):
    """A job that needs 5 devices of a fleet of 2: it fails for lack of devices, the fleet sees
    its population idle again with no task done, and exits 5 saying so."""

    async def main() -> tuple[int, str]:
        async with in_process().whole_system(tmp_path) as stack:
            (tmp_path / "enrolment.key").write_bytes(stack.coordinator.enrolment_key)
            await stack.submit(_spec(cohort=5, checkin_s=8, retries=0))
            fleet = await _tally("fleet", "--coordinator", stack.target, "--insecure", "--devices", "2",
                                 "--synthetic", "--no-progress", "--enrolment-key", str(tmp_path / "enrolment.key"))
            _, err = await asyncio.wait_for(fleet.communicate(), 180)
            return fleet.returncode, err.decode()

    code, err = run(main())
    assert code == exit_codes.NO_TASK, err
    assert "tally fleet: no task came before the jobs of population 'default' ended" in err


def _wrong_shape(n: int) -> list[TorchTrainer]:
    """Devices whose model (hidden 8) is not the job's (hidden 16)."""
    fed = digits(n, alpha=0.5, seed=0)
    return [TorchTrainer(lambda: mlp(64, 10, hidden=8, seed=0), X, y, seed=i) for i, (X, y) in enumerate(fed.clients)]


async def _connected(process: asyncio.subprocess.Process) -> None:
    """Until `tally client` says it checked in (its progress lines)."""
    assert process.stderr is not None
    while b"connected:" not in await process.stderr.readline():
        assert not process.stderr.at_eof(), "the client ended before it checked in"


def test_a_client_exits_4_for_a_failed_job_and_5_when_no_task_came(tmp_path):
    """With no job at all and --task-timeout, a client gives up and exits 5. Then one device
    beside a fleet of five, all six of the wrong model shape, fills the job's cohort of six: once
    the job has failed and the client is stopped, it names the job and exits 4."""

    async def main() -> tuple[str, int, str, int, str]:
        async with in_process().whole_system(tmp_path) as stack:
            enrolment = SharedKeyEnrolment(stack.coordinator.enrolment_key)
            device = ["client", "--coordinator", stack.target, "--insecure", "--hidden", "8", "--shards", "6"]

            def provisioned(device_id: str) -> tuple[str, ...]:
                return ("--device-id", device_id, "--state-dir", str(tmp_path / device_id),
                        "--credential", enrolment.credential("default", device_id).hex())

            idle = await _tally(*device, *provisioned("idle"), "--shard", "1", "--connect-timeout", "1",
                                "--task-timeout", "1")
            _, idle_err = await asyncio.wait_for(idle.communicate(), 120)
            job_id = await stack.submit(_spec(cohort=6, checkin_s=20, retries=3))
            client = await _tally(*device, *provisioned("one"), "--shard", "0")
            await asyncio.wait_for(_connected(client), 120)
            fleet = stack.fleet(_wrong_shape(5), seed=1)
            try:
                await fleet.run(until=fleet.until_job_done(job_id, every_seconds=0.2))
            finally:
                fleet.close()
            client.send_signal(signal.SIGINT)
            _, err = await asyncio.wait_for(client.communicate(), 120)
            return job_id, client.returncode, err.decode(), idle.returncode, idle_err.decode()

    job_id, code, err, idle_code, idle_err = run(main())
    assert idle_code == exit_codes.NO_TASK and "tally client: no task came within 1 s" in idle_err, idle_err
    assert code == exit_codes.JOB_FAILED, err
    assert f"tally client: job {job_id} FAILED: model_mismatch x1" in err


def test_every_exit_status_is_in_the_help_of_both_commands(capsys):
    for command in ("client", "fleet"):
        with pytest.raises(SystemExit):
            build_parser(command).parse_args([command, "--help"])
        text = capsys.readouterr().out
        assert "exit status:" in text and "--task-timeout" in text
        for code, meaning in exit_codes.MEANINGS.items():
            assert f"  {code}  {meaning}" in text
