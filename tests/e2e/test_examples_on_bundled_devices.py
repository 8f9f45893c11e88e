"""Every example job spec runs on the bundled devices, the ones `tally client` and `tally fleet`
play, with no flag about the job: each device reads the model off the job's downloaded parameters
and builds the trainer the algorithm needs (AgnosticFedAvg's domain statistics, FedDAR's heads,
FedEvg's energy model, SuPerFed's personal model). Each example runs one round at a small size
through the real coordinator and two aggregators. AgnosticFedAvg used to fail on them with
`training_error x16 (AttributeError: 'TorchTrainer' object has no attribute 'domain_statistics')`."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import yaml

from support.stack import in_process, run
from tally.cli.client_run import _trainers

EXAMPLES = sorted((Path(__file__).resolve().parents[2] / "examples").glob("*.yaml"))
DEVICES = 12


def _small(path: Path) -> str:
    """The example at a test's size: one round over a cohort of every device, on one population;
    its algorithm, options and model as written."""
    spec = yaml.safe_load(path.read_text())
    spec.update(rounds=1, cohort_size=DEVICES, over_selection=1.0, min_cohort=5)
    spec.pop("deadlines", None)
    options = spec.setdefault("options", {})
    if "num_clients" in options:  # AAggFF: the population is the fleet
        options["num_clients"] = DEVICES
        options.pop("cohort_size", None)
    if spec["algorithm"] == "fedevg":
        options["local_iterations"] = 2
    return yaml.safe_dump(spec)


def _devices(hidden: int | None = None, model: str | None = None):
    args = argparse.Namespace(model_plugin=[], model=model, hidden=hidden, alpha=0.5, seed=0)
    return _trainers(args, DEVICES)


@pytest.mark.parametrize("example", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_every_example_runs_on_the_bundled_devices(tmp_path, example):
    async def main():
        async with in_process().whole_system(tmp_path) as s:
            job_id, stats = await s.run_job(_small(example), _devices())
            return await s.job(job_id), stats

    job, stats = run(main())
    failures = [(r.outcome, r.reason, r.count, r.example) for r in job.task_reports if r.outcome != "completed"]
    assert job.committed_round == 1, (job.message, failures)
    assert stats.sessions_completed == DEVICES and stats.sessions_aborted == 0, (stats.summary(), failures)


def test_the_command_line_overrides_the_model_read_from_the_job(tmp_path):
    """--hidden says what the device trains: a width other than the job's is refused by name."""
    async def main():
        async with in_process().whole_system(tmp_path) as s:
            job_id, _ = await s.run_job(_small(EXAMPLES[[p.stem for p in EXAMPLES].index("fedavg")]).replace(
                "retries: 3", "retries: 0"), _devices(hidden=7))
            return await s.job(job_id)

    job = run(main())
    reasons = {r.reason for r in job.task_reports}
    assert job.committed_round == 0 and "model_mismatch" in reasons, (job.message, reasons)
