"""``tally job`` (issue 9, items 2, 4, 8 and 10): specs written and checked offline, the examples
and the generated reference kept valid, and an operator's commands run as real processes against
real gRPC services: JSON output, the state by name, "round X of N", timestamps, the trained model
as ONNX, a wrongly typed option refused at submission, and a cohort split warning."""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import sys
from datetime import datetime
from pathlib import Path

import numpy as np
import pytest

from support.stack import in_process, run, spec, trainers
from tally import algorithms
from tally.cli import main as tally
from tally.client import OnnxModel
from tally.coordinator.spec.jobspec_docs import reference

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((REPO / "examples").glob("*.yaml"))
DOCS = REPO / "docs" / "job-spec.md"


def test_every_algorithm_has_an_example_and_every_example_validates(capsys):
    named = {path.stem for path in EXAMPLES}
    assert set(algorithms.NAMES) <= named  # one per algorithm the services run
    for path in EXAMPLES:
        assert tally(["job", "validate", str(path), "--aggregators", "2"]) == 0, capsys.readouterr().err
        out, err = capsys.readouterr()
        assert "valid" in out and "warning" not in err, (path, err)  # no split too close to min_cohort


@pytest.mark.parametrize("algorithm", algorithms.NAMES)
def test_job_init_writes_a_commented_spec_that_validates(tmp_path, capsys, algorithm):
    assert tally(["job", "init", algorithm]) == 0
    text = capsys.readouterr().out
    assert text.startswith("#") and f"algorithm: {algorithm}" in text
    # Each option says what it means and what it takes, not only its type (issue 25, item 3).
    from tally.coordinator.spec import jobspec
    from tally.coordinator.spec.jobspec_docs import STARTER_OPTIONS

    lines = dict(line.strip().split(":", 1) for line in text.split("\noptions:", 1)[1].splitlines()[1:] if line.strip())
    for key, info in jobspec.options_model(algorithm).model_fields.items():
        if info.description and key not in STARTER_OPTIONS.get(algorithm, {}):
            assert f"# {info.description}: " in lines[key], (key, lines[key])
    path = tmp_path / "job.yaml"
    path.write_text(text)
    assert tally(["job", "validate", str(path), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["valid"] and report["spec"]["algorithm"] == algorithm


def test_validate_reports_every_problem_offline_and_init_refuses_an_unknown_algorithm(tmp_path, capsys):
    path = tmp_path / "job.yaml"
    path.write_text("name: x\nalgorithm: fedavg\nrounds: -1\noptions: {local_epochs: '5'}\n"
                    "secure: {dropout_rate: high}\n")
    assert tally(["job", "validate", str(path)]) == 1
    err = capsys.readouterr().err
    for needle in ("cohort_size: required", "rounds: must be >= 1", "options.local_epochs: must be an integer",
                   "secure.dropout_rate: must be a number, got 'high' (str)"):
        assert needle in err, err
    assert tally(["job", "validate", str(path), "--json"]) == 1
    assert len(json.loads(capsys.readouterr().out)["errors"]) == 4
    assert tally(["job", "validate", str(tmp_path / "missing.yaml")]) == 2
    assert "missing.yaml: No such file or directory" in capsys.readouterr().err
    assert tally(["job", "init", "nope"]) == 2
    assert "unknown algorithm 'nope'; available: fedavg" in capsys.readouterr().err


def test_validate_warns_of_the_old_name_config_and_refuses_it_beside_options(tmp_path, capsys):
    """Issue 43: ``config:`` is read as ``options:`` for one release, and the operator is told."""
    path = tmp_path / "job.yaml"
    path.write_text("name: x\nalgorithm: fedavg\nrounds: 1\ncohort_size: 10\nconfig: {local_epochs: 2}\n")
    with pytest.warns(DeprecationWarning):
        assert tally(["job", "validate", str(path)]) == 0
    out, err = capsys.readouterr()
    assert "valid" in out and "warning: config: deprecated, renamed options:" in err, err
    with pytest.warns(DeprecationWarning):
        assert tally(["job", "validate", str(path), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["spec"]["options"] == {"local_epochs": 2} and report["warnings"][0].startswith("config: deprecated")
    path.write_text(path.read_text() + "options: {local_epochs: 3}\n")
    assert tally(["job", "validate", str(path)]) == 1
    assert "options: given twice, as options: and as its deprecated name config:" in capsys.readouterr().err


def test_the_field_reference_is_generated_from_the_schema_and_up_to_date(capsys):
    assert DOCS.read_text() == reference(), "regenerate it: tally job schema > docs/job-spec.md"
    for line in ("| `secure.dropout_rate` | number (>= 0, < 1) | `0.1` |", "### `aaggff_d`",
                 "| `options.local_epochs` | integer (>= 1) | `5` | passes over the device's own data per round |"):
        assert line in DOCS.read_text()
    assert tally(["job", "schema", "--json"]) == 0
    schema = json.loads(capsys.readouterr().out)
    assert set(schema["required"]) == {"name", "algorithm", "rounds", "cohort_size"}


async def _tally(*argv: str, env: dict[str, str] | None = None) -> tuple[int, str, str]:
    """``tally ARGV`` as its own process, with ``env`` added to this one's: exit code, stdout, stderr."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "tally.cli", *argv, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})},
    )
    out, err = await proc.communicate()
    return proc.returncode, out.decode(), err.decode()


def _iso(text: str) -> datetime:
    return datetime.fromisoformat(text.replace("Z", "+00:00"))


def test_job_commands_as_processes_against_the_services(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="tally")
    n, rounds = 10, 2
    devices, (test_x, _) = trainers(n)
    good, mistyped, split = tmp_path / "good.yaml", tmp_path / "mistyped.yaml", tmp_path / "split.yaml"
    good.write_text(spec("cli", rounds, cohort=n))
    mistyped.write_text(spec("typo", rounds, cohort=n).replace("local_epochs: 1", "local_epochs: '5'"))
    split.write_text(spec("split", rounds, cohort=20, over_selection=1.3).replace("min_cohort: 5", "min_cohort: 10")
                     .replace("options:", "population: nobody\noptions:"))
    out_dir = tmp_path / "out"

    async def main():
        async with in_process().whole_system(tmp_path) as s:  # two aggregators
            common = ("--coordinator", s.target, "--state-dir", str(s.state_dir), "--insecure")
            results = {"typo": await _tally("job", "submit", str(mistyped), *common),
                       "split": await _tally("job", "submit", str(split), *common),
                       "early": None}
            code, out, err = await _tally("job", "submit", str(good), *common, "--json")
            assert code == 0, err
            job_id = json.loads(out)["job_id"]
            results["early"] = await _tally("job", "model", job_id, "--out", str(out_dir / "v0.onnx"), "--json",
                                            *common)
            fleet = s.fleet(devices, seed=1)
            await fleet.run(until=fleet.until_job_done(job_id, every_seconds=0.2))
            fleet.close()
            for name, argv in {
                "status": ("job", "status", job_id), "status_json": ("job", "status", job_id, "--json"),
                "list_json": ("job", "list", "--json", "--state", "SUCCEEDED"),
                "watch_json": ("job", "watch", job_id, "--json"),
                "model": ("job", "model", job_id, "--out", str(out_dir / "model.onnx"), "--json"),
                "first": ("job", "model", job_id, "--round", "1", "--out", str(out_dir / "v1.onnx")),
                "beyond": ("job", "model", job_id, "--round", "9", "--out", str(out_dir / "v9.onnx")),
                "beyond_json": ("job", "model", job_id, "--round", "9", "--out", str(out_dir / "v9.onnx"), "--json"),
            }.items():
                results[name] = await _tally(*argv, *common)
            version = s.coordinator.store.model_version(job_id)
            return job_id, results, s.coordinator.store.read_blob(version.onnx_digest)

    job_id, r, onnx = run(main())
    code, _, err = r["typo"]
    assert code == 1 and "options.local_epochs: must be an integer, got '5' (str)" in err  # refused at submit
    code, out, err = r["split"]
    assert code == 0 and out.strip().startswith("split-")
    assert "warning: min_cohort: 26 selected devices are split 13/13 over 2 aggregator cohort(s)" in err
    succeeded = [rec for rec in caplog.records if rec.getMessage() == "job succeeded"]
    assert [rec.fields for rec in succeeded] == [{"job_id": job_id, "rounds": rounds}]  # a log event on success
    code, out, err = r["early"]
    assert code == 0 and json.loads(out)["round"] == 0, err  # before training: the initial model

    code, out, _ = r["status"]
    assert code == 0 and f"{job_id}  SUCCEEDED  fedavg  round {rounds} of {rounds}  committed {rounds}" in out
    assert "UNSPECIFIED" not in out and "created 20" in out
    job = json.loads(r["status_json"][1])
    assert job["state"] == "SUCCEEDED" and job["rounds"] == rounds and job["phase"] == ""
    assert _iso(job["created_at"]) <= _iso(job["updated_at"])
    assert [j["job_id"] for j in json.loads(r["list_json"][1])] == [job_id]
    events = [json.loads(line) for line in r["watch_json"][1].splitlines()]
    assert r["watch_json"][0] == 0 and events[-1]["state"] == "SUCCEEDED" and events[-1]["time"]

    code, out, _ = r["model"]
    fetched = json.loads(out)
    assert code == 0 and fetched["round"] == rounds and fetched["sha256"] == hashlib.sha256(onnx).hexdigest()
    assert (tmp_path / "out" / "model.onnx").read_bytes() == onnx
    logits = OnnxModel.from_bytes((tmp_path / "out" / "model.onnx").read_bytes()).logits(test_x[:5].astype(np.float32))
    assert logits.shape == (5, 10)
    assert r["first"][0] == 0 and (tmp_path / "out" / "v1.onnx").read_bytes() != onnx
    assert (tmp_path / "out" / "v0.onnx").read_bytes() not in (onnx, (tmp_path / "out" / "v1.onnx").read_bytes())
    code, _, err = r["beyond"]
    assert code == 1 and "NOT_FOUND" in err and "no committed round 9" in err
    code, out, err = r["beyond_json"]  # with --json the error is the JSON, said once
    assert code == 1 and json.loads(out)["error"] == "NOT_FOUND" and "NOT_FOUND" not in err
    assert not (tmp_path / "out" / "v9.onnx").exists()


def test_the_environment_says_where_the_coordinator_is_and_flags_override_it(tmp_path):
    """Issue 39, item 9: $TALLY_COORDINATOR, $TALLY_STATE_DIR and $TALLY_TLS_DIR stand for the flags
    every ``tally job`` and ``tally device`` call would repeat, over TLS as deployed; a flag wins."""
    async def main():
        async with in_process().whole_system(tmp_path, tls=True) as s:
            env = {"TALLY_COORDINATOR": s.target, "TALLY_STATE_DIR": str(s.state_dir),
                   "TALLY_TLS_DIR": str(tmp_path / "pki" / "device")}
            return (await _tally("job", "list", "--json", env=env),
                    await _tally("device", "revoke", "nobody", env=env),
                    await _tally("job", "list", "--coordinator", "127.0.0.1:1", "--timeout", "2", env=env),
                    await _tally("job", "list", "--insecure", "--timeout", "2", env=env))

    listed, revoked, elsewhere, plaintext = run(main())
    assert listed[0] == 0 and json.loads(listed[1]) == [], listed[2]
    assert revoked[0] == 1 and "NOT_FOUND" in revoked[2], revoked  # reached the coordinator, authenticated
    assert elsewhere[0] == 1 and "UNAVAILABLE" in elsewhere[2] and "127.0.0.1:1" in elsewhere[2], elsewhere
    assert plaintext[0] == 1 and "UNAVAILABLE" in plaintext[2], plaintext  # --insecure beats $TALLY_TLS_DIR


def test_the_default_coordinator_address_is_the_port_every_manifest_uses():
    """Issue 39, item 9: `tally coordinator` listens where `tally job` looks, on the docs' and k8s' 7000."""
    from tally.cli import build_parser
    from tally.cli.job import DEFAULT_ADDRESS

    assert build_parser("coordinator").parse_args(["coordinator", "--state-dir", "s"]).listen == DEFAULT_ADDRESS
    assert DEFAULT_ADDRESS.endswith(":7000")
    assert ":7000" in (REPO / "k8s" / "base" / "coordinator.yaml").read_text()


def test_a_yaml_syntax_error_is_one_problem_naming_its_line(tmp_path, capsys):
    """Issue 25, item 7: PyYAML's message used to count as "8 problem(s)" (one per line) and
    named "<unicode string>" instead of the file."""
    path = tmp_path / "broken.yaml"
    path.write_text("name: x\nalgorithm: fedavg\nrounds: [1\n")
    assert tally(["job", "validate", str(path)]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"{path}: 1 problem(s)\n") and "line 3, column 9" in err, err
    assert "<unicode string>" not in err


def test_ctrl_c_of_job_watch_is_one_line(tmp_path):
    """Issue 39, item 7: Ctrl-C of `tally job watch` (any command without a stop of its own) printed
    a KeyboardInterrupt traceback from inside gRPC."""
    import signal

    good = tmp_path / "job.yaml"
    good.write_text(spec("watched", 2, cohort=10))

    async def main():
        async with in_process().whole_system(tmp_path) as s:
            common = ("--coordinator", s.target, "--state-dir", str(s.state_dir), "--insecure")
            job_id = await s.submit(good.read_text())
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "tally.cli", "job", "watch", job_id, *common, stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
            first = await asyncio.wait_for(proc.stdout.readline(), 120)  # watching: no devices, it waits
            proc.send_signal(signal.SIGINT)
            _, err = await asyncio.wait_for(proc.communicate(), 60)
            return first.decode(), proc.returncode, err.decode()

    first, code, err = run(main())
    assert "RUNNING" in first or "PENDING" in first, first
    assert code == 128 + signal.SIGINT and err.strip() == "tally job: interrupted", err
