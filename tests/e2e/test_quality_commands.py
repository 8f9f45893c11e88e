"""Issue 37, "where the user sees it": the model-quality figures the coordinator computes from the
devices' metric sums, through ``tally job watch``, ``status``, ``metrics`` (table, JSON, CSV) and
``plot``, each a real process against the real services; a custom trainer metric among them; and
``tally job model`` saying what a personalised job's file is."""

from __future__ import annotations

import asyncio
import csv
import io
import json
import os
import sys
from pathlib import Path

import numpy as np

from support.stack import HIDDEN, in_process, run, spec, trainers
from tally.cli.quality import SPARK
from tally.datasets.digits import digits
from tally.evaluation import is_quality
from tally.models.mlp import mlp
from tally.training import TorchTrainer, single_threaded

REPO = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "250"}
CUSTOM = "evaluation: {custom: [{name: scored, kind: count, high: 1000}]}\n"


class ScoringTrainer(TorchTrainer):
    """A trainer with a custom metric (``LocalTrainer.metrics``): how many examples it scored,
    so the round's total must equal the built-in ``eval.examples``."""

    def metrics(self, params) -> dict[str, float]:
        return {"scored": float(self.num_examples)}


async def _start(*argv: str, python: tuple[str, ...] = ("-m", "tally.cli")) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        sys.executable, *python, *argv, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        cwd=REPO, env=ENV)


async def _tally(*argv: str, python: tuple[str, ...] = ("-m", "tally.cli")) -> tuple[int, str, str]:
    proc = await _start(*argv, python=python)
    out, err = await proc.communicate()
    return proc.returncode, out.decode(), err.decode()


def test_watch_status_metrics_and_plot_show_the_devices_figures(tmp_path):
    n, rounds = 10, 3
    single_threaded()
    factory = lambda: mlp(64, 10, hidden=HIDDEN, seed=0)  # noqa: E731
    devices = [ScoringTrainer(factory, X, y, seed=i) for i, (X, y) in enumerate(digits(n, alpha=0.5, seed=0).clients)]
    plot_path = tmp_path / "curves.png"

    async def main():
        async with in_process().whole_system(tmp_path) as s:
            common = ("--coordinator", s.target, "--state-dir", str(s.state_dir), "--insecure")
            job_id = await s.submit(spec("quality", rounds, cohort=n) + CUSTOM)
            watch = await _start("job", "watch", job_id, *common)
            first = await watch.stdout.readline()  # the job's current state: it is subscribed
            assert b"current state" in first, first
            fleet = s.fleet(devices, seed=1)
            await fleet.run(until=fleet.until_job_done(job_id, every_seconds=0.2))
            fleet.close()
            out, err = await watch.communicate()
            results = {"watch": (watch.returncode, first.decode() + out.decode(), err.decode())}
            for name, argv in {
                "status": ("job", "status", job_id), "status_json": ("job", "status", job_id, "--json"),
                "table": ("job", "metrics", job_id), "json": ("job", "metrics", job_id, "--json"),
                "csv": ("job", "metrics", job_id, "--csv"), "both": ("job", "metrics", job_id, "--json", "--csv"),
                "plot": ("job", "plot", job_id, "--out", str(plot_path)),
                "model": ("job", "model", job_id, "--out", str(tmp_path / "model.onnx")),
            }.items():
                results[name] = await _tally(*argv, *common)
            # Without matplotlib the command names the package to install, and no traceback.
            results["no_matplotlib"] = await _tally("-c", (
                "import sys; sys.modules['matplotlib'] = None; from tally.cli import main; "
                f"sys.exit(main({['job', 'plot', job_id, '--out', str(tmp_path / 'none.png'), *common]!r}))"),
                python=())
            return job_id, results, await s.round_metrics(job_id)

    job_id, r, figures = run(main())
    assert set(figures) == set(range(1, rounds + 1))
    for round_, got in figures.items():  # the custom metric summed like the built-in count
        assert got["custom.scored"] == got["eval.examples"] > 0 and got["eval.devices"] == n, round_

    code, out, err = r["watch"]
    assert code == 0, err
    committed = [line for line in out.splitlines() if "committed" in line and "round " in line]
    assert len(committed) == rounds, out
    for line, round_ in zip(committed, sorted(figures)):
        want = figures[round_]
        for text in (f"train loss {want['train.loss']:.3f}", f"eval loss {want['eval.loss']:.3f}",
                     f"acc {want['eval.accuracy']:.3f}", f"p10 {want['eval.accuracy_p10']:.3f}",
                     f"scored {want['custom.scored']:.0f}", f"over {n} devices", f"update {n:.0f}"):
            assert text in line, (text, line)
        assert "acc spread [" in line and any(c in line for c in SPARK), line
        assert "update.contributors=" not in line and "eval.accuracy_hist" not in line  # no raw dump

    best = max(figures, key=lambda k: (figures[k]["eval.accuracy"], -k))
    last = figures[rounds]
    code, out, err = r["status"]
    assert code == 0 and f"quality at round {rounds}: train loss {last['train.loss']:.3f}" in out, err
    assert f"best: acc {figures[best]['eval.accuracy']:.3f} (round {best})" in out, out
    status = json.loads(r["status_json"][1])
    assert status["state"] == "SUCCEEDED" and status["quality"]["round"] == rounds
    assert status["quality"]["best"]["eval.accuracy"] == {"value": figures[best]["eval.accuracy"], "round": best}
    assert status["quality"]["latest"] == {k: v for k, v in last.items() if is_quality(k)}

    code, out, err = r["table"]
    assert code == 0 and "model quality per round" in out and "acc spread" in out and "scored" in out, err
    assert [json.loads(r["json"][1])["rounds"][i - 1]["metrics"] for i in figures] == list(figures.values())
    rows = list(csv.DictReader(io.StringIO(r["csv"][1])))
    assert [int(row["round"]) for row in rows] == sorted(figures)
    assert all(float(row[k]) == figures[int(row["round"])][k] for row in rows for k in figures[1]), rows[0]
    assert rows[0]["committed_at"].startswith("20")
    code, _, err = r["both"]
    assert code == 2 and "give --json or --csv, not both" in err

    code, out, err = r["plot"]
    assert code == 0 and f"{plot_path}: {rounds} rounds of {job_id}" in out, err
    assert plot_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    code, _, err = r["no_matplotlib"]
    assert code == 2 and "needs matplotlib, which is not installed: pip install matplotlib" in err, err
    assert "Traceback" not in err and not (tmp_path / "none.png").exists()
    code, _, err = r["model"]
    assert code == 0 and "warning" not in err  # FedAvg's devices all use the global model


def test_job_model_of_a_personalised_job_warns_and_status_shows_personal_accuracy(tmp_path):
    n, rounds = 8, 2
    devices, _ = trainers(n)
    lg = spec("lg", rounds, cohort=n).replace("algorithm: fedavg", "algorithm: lg_fedavg").replace(
        "options: {", "options: {global_patterns: ['2.*'], warmup_rounds: 0, ")

    async def main():
        async with in_process().whole_system(tmp_path) as s:
            common = ("--coordinator", s.target, "--state-dir", str(s.state_dir), "--insecure")
            job_id = await s.submit(lg)
            fleet = s.fleet(devices, seed=1)
            await fleet.run(until=fleet.until_job_done(job_id, every_seconds=0.2))
            fleet.close()
            model = await _tally("job", "model", job_id, "--out", str(tmp_path / "lg.onnx"), *common)
            model_json = await _tally("job", "model", job_id, "--out", str(tmp_path / "lg.onnx"), "--json", *common)
            status = await _tally("job", "status", job_id, "--json", *common)
            return model, model_json, status, await s.round_metrics(job_id)

    (code, out, err), model_json, status, figures = run(main())
    personal = figures[rounds]["personal.accuracy"]
    assert code == 0 and "lg.onnx" in out, err
    assert err.startswith("warning: lg_fedavg is personalised: this file is the shared part") and \
        "each device's own layers stay on the device" in err, err
    assert f"Judge the job by personal.accuracy (round {rounds}: personal.accuracy {personal:.3f}" in err, err
    assert json.loads(model_json[1])["warning"] in model_json[2]  # the same words in the JSON
    best = json.loads(status[1])["quality"]["best"]
    assert best["personal.accuracy"]["value"] == max(f["personal.accuracy"] for f in figures.values())
    assert np.isfinite(best["eval.accuracy"]["value"])
