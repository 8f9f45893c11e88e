"""``tally.cli.quality``: the lines, summaries and warnings of the job commands' model-quality
figures, for the figures the services' tests do not produce (several sums, DP, domains, personal
models, a job that measured nothing)."""

from __future__ import annotations

import argparse
import json
import sys

import grpc
import pytest

from tally.cli import quality
from tally.cli.quality import MissingPackage, RoundFigures
from tally.wire.v1 import admin_pb2, common_pb2


def test_spark_scales_to_the_tallest_bin_and_leaves_empty_bins_blank():
    assert quality.spark([0, 1, 2, 4, 8]) == " ▂▃▅█"
    assert quality.spark([0, 0]) == "" and quality.spark([]) == ""


def test_a_round_line_of_several_sums_dp_domains_personal_and_custom_figures():
    figures = {
        "selected": 40.0, "attempt": 2.0, "losses.contributors": 30.0, "losses.dropped": 0.0,
        "update.contributors": 28.0, "update.dropped": 2.0, "update.weight": 0.5, "privacy.epsilon": 1.234,
        "train.loss": 0.5, "eval.loss": 0.75, "eval.accuracy": 0.8, "eval.accuracy_p10": 0.35,
        "personal.accuracy": 0.9, "eval.domain0.accuracy": 0.7, "eval.domain0.loss": 1.0,
        "eval.accuracy_hist.00": 1.0, "eval.accuracy_hist.01": 3.0, "eval.devices": 28.0, "eval.examples": 300.0,
        "eval.clipped": 2.0, "custom.f1": 0.6, "custom.conf.hist.00": 2.0, "custom.conf.hist.01": 0.0,
    }
    line = quality.round_line(figures)
    assert line.startswith("40 selected, losses 30, update 28 (2 dropped), attempt 2, ε 1.23  train loss 0.500  "
                           "eval loss 0.750  acc 0.800  p10 0.350  personal acc 0.900  domain0.accuracy 0.700  "
                           "domain0.loss 1.000  f1 0.600  clipped 2  "), line
    assert line.endswith("acc spread [▃█]  conf spread [█ ]  over 28 devices"), line
    assert "update.weight" not in line and "examples" not in line


def test_status_summary_names_the_best_round_earliest_on_ties_and_nothing_without_figures():
    rounds = [RoundFigures(1, "", {"eval.accuracy": 0.5, "eval.loss": 2.0, "selected": 9.0}),
              RoundFigures(2, "", {"eval.accuracy": 0.7, "eval.loss": 1.0}),
              RoundFigures(3, "", {"eval.accuracy": 0.7, "eval.loss": 1.5}),
              RoundFigures(4, "", {"selected": 9.0})]  # evaluation: every 3 skipped it
    found = quality.summary(rounds)
    assert found == {"round": 3, "latest": {"eval.accuracy": 0.7, "eval.loss": 1.5},
                     "best": {"eval.accuracy": {"value": 0.7, "round": 2}, "eval.loss": {"value": 1.0, "round": 2}}}
    assert quality.summary_line(found).endswith("; best: acc 0.700 (round 2), eval loss 1.000 (round 2)")
    assert quality.summary([RoundFigures(1, "", {"selected": 9.0})]) is None  # evaluation: {enabled: false}
    assert quality.summary_line(None) == ""


def test_the_model_warning_is_for_personalised_algorithms_only():
    assert quality.model_warning("fedavg", []) == ""
    assert quality.model_warning("feddar_wa", []) == ""
    for name in ("lg_fedavg", "superfed"):
        text = quality.model_warning(name, [])
        assert text.startswith(f"{name} is personalised") and "Judge the job by personal.accuracy, shown" in text


def test_a_missing_optional_package_is_named_with_how_to_install_it(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(MissingPackage, match=r"`tally job plot` needs matplotlib, which is not installed: "
                                             r"pip install matplotlib \(or tally\[all\]\)"):
        quality.plot([RoundFigures(1, "", {"eval.accuracy": 0.5})], tmp_path / "x.png", "x")


class _Unimplemented(grpc.RpcError):
    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNIMPLEMENTED

    def details(self) -> str:
        return "Method not found!"


class _OlderCoordinator:
    """An Admin stub of a coordinator from before GetJobMetrics."""

    def GetJob(self, request, metadata, timeout):
        return admin_pb2.Job(job_id=request.job_id, algorithm="lg_fedavg", state=common_pb2.JOB_STATE_RUNNING)

    def GetJobMetrics(self, request, metadata, timeout):
        raise _Unimplemented()


def test_status_still_works_against_a_coordinator_without_job_metrics(capsys):
    from tally.cli import job

    args = argparse.Namespace(job_id="j", json=True, timeout=5.0)
    assert job._status(_OlderCoordinator(), args, ()) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["job_id"] == "j" and shown["quality"] is None
    with pytest.raises(grpc.RpcError):  # `tally job metrics` has nothing to show: the error is its answer
        job._metrics(_OlderCoordinator(), argparse.Namespace(job_id="j", json=True, csv=False, timeout=5.0), ())


def test_a_round_that_only_evaluated_is_labelled_with_the_round_it_scored(capsys):
    from rich.console import Console

    from tally.evaluation.summary import EVALUATION_ONLY

    rounds = [RoundFigures(2, "", {"train.loss": 0.4, "eval.accuracy": 0.7}),
              RoundFigures(3, "", {"eval.accuracy": 0.8, EVALUATION_ONLY: 2.0})]
    assert [quality.round_label(r) for r in rounds] == ["2", "3 (eval of 2)"]
    Console(width=120).print(quality.table(rounds, "t"))
    out = capsys.readouterr().out
    assert "3 (eval of 2)" in out and EVALUATION_ONLY not in out
    assert quality.summary(rounds)["best"]["eval.accuracy"] == {"value": 0.8, "round": 3}
