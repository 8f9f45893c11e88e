"""Federated evaluation through the real services: a trainer's own metric, declared in the job
spec, reaches the round figures, the coordinator's /metrics and the job's MLflow run (read back with
MLflow's own client, with the spec as params and the final ONNX model as an artifact); a job asking a
metric its devices cannot compute fails at once, naming it; and nothing the servers receive or log
carries one device's metric."""

from __future__ import annotations

import logging

import pytest

from support.stack import HIDDEN, in_process, run, scrape_text, spec, trainers
from tally.models.mlp import mlp
from tally.training import TorchTrainer
from tally.wire.v1 import common_pb2

N, ROUNDS = 8, 2
CUSTOM = "evaluation: {custom: [{name: confidence, kind: mean, low: 0, high: 1}]}\n"


class Confident(TorchTrainer):
    """Reports its mean top-class probability on the held-out view, as an application could."""

    def metrics(self, params):
        import torch

        from tally.models.params import set_params

        set_params(self.model, params)
        with torch.no_grad():
            top = torch.softmax(self.model(self.features), dim=1).max(dim=1).values
        return {"confidence": float(top.mean())}


def _devices(cls) -> list:
    base, _ = trainers(N)
    return [cls(lambda: mlp(64, 10, hidden=HIDDEN, seed=0), d.features.numpy(), d.labels.numpy(), seed=i)
            for i, d in enumerate(base)]


def test_a_trainer_metric_reaches_the_figures_prometheus_and_mlflow(tmp_path, caplog):
    mlflow = pytest.importorskip("mlflow", reason="experiment tracking needs tally[tracking] (mlflow-skinny)")
    from mlflow.tracking import MlflowClient

    uri = (tmp_path / "mlruns").as_uri()
    caplog.set_level(logging.DEBUG)

    async def main():
        async with in_process().whole_system(tmp_path, tracking_uri=uri) as s:
            job_id, _ = await s.run_job(spec("tracked", ROUNDS, cohort=N) + CUSTOM, _devices(Confident))
            scraped = scrape_text(s.coordinator.metrics_port)
            return await s.job(job_id), await s.round_metrics(job_id), scraped
        # leaving the block stops the coordinator, which finishes the run's last writes

    job, figures, scraped = run(main())
    assert job.state == common_pb2.JOB_STATE_SUCCEEDED, job.message
    assert sorted(figures) == list(range(1, ROUNDS + 1))
    assert all(0.1 <= figures[r]["custom.confidence"] <= 1.0 for r in figures)
    line = f'tally_coordinator_model_quality{{job_id="{job.job_id}",metric="custom.confidence"}}'
    assert line in scraped and 'metric="eval.accuracy"' in scraped
    assert "eval.accuracy_hist" not in scraped  # bins stay out of Prometheus

    client = MlflowClient(tracking_uri=uri)
    [found] = client.search_runs([client.get_experiment_by_name("tally").experiment_id],
                                 filter_string=f"tags.`tally.job_id` = '{job.job_id}'")
    assert found.data.params["algorithm"] == "fedavg" and found.data.params["evaluation.holdout"] == "0.1"
    assert found.data.tags["tally.state"] == "SUCCEEDED" and found.info.status == "FINISHED"
    history = client.get_metric_history(found.info.run_id, "eval.accuracy")
    assert [m.step for m in history] == list(range(1, ROUNDS + 1))
    assert [m.value for m in history] == [figures[r]["eval.accuracy"] for r in range(1, ROUNDS + 1)]
    assert client.get_metric_history(found.info.run_id, "custom.confidence")
    assert [a.path for a in client.list_artifacts(found.info.run_id, "model")] == ["model/model.onnx"]
    del mlflow

    # No log line names a device's metric: figures are logged per round only.
    for record in caplog.records:
        fields = getattr(record, "fields", {}) or {}
        assert not (fields.get("device_id") and any("metric" in str(k) for k in fields)), record.getMessage()


def test_a_job_asking_a_metric_its_devices_cannot_compute_fails_at_once_naming_it(tmp_path):
    async def main():
        async with in_process().whole_system(tmp_path) as s:
            job_id, _ = await s.run_job(spec("unknowable", 3, cohort=N) + CUSTOM, trainers(N)[0])
            return await s.job(job_id)

    job = run(main())
    assert job.state == common_pb2.JOB_STATE_FAILED and job.committed_round == 0
    assert "metric_unavailable" in job.message and "confidence" in job.message
