"""Federated evaluation through the real services: a trainer's own metric, declared in the job
spec, reaches the round figures, the coordinator's /metrics and the job's MLflow run (read back with
MLflow's own client, with the spec as params and the final ONNX model as an artifact); a job asking a
metric its devices cannot compute fails at once, naming it; and nothing the servers receive or log
carries one device's metric."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from support.stack import HIDDEN, in_process, run, scrape_text, spec, trainers
from tally.evaluation.summary import EVALUATION_ONLY
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


class CountsTraining(TorchTrainer):
    """Records the model each ``train`` call starts from (views share the list)."""

    def __init__(self, *args, seen: list, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.seen = seen

    def train(self, params, epochs, lr, batch_size):
        self.seen.append(sum(float(np.asarray(v, np.float64).sum()) for v in params.values()))
        return super().train(params, epochs, lr, batch_size)


def test_a_final_evaluation_round_scores_the_final_model_with_no_training(tmp_path):
    """``evaluation: {final: true}``: after the last training round one more round is selected,
    summed and committed in which the devices only score the final model. Its figures are the
    in-process evaluation of that model over the same devices, the model is unchanged, and no
    device trains."""
    from support.jobs import reference_halves
    from tally import modelio

    seen: list[float] = []
    base, _ = trainers(N)
    devices = [CountsTraining(lambda: mlp(64, 10, hidden=HIDDEN, seed=0), d.features.numpy(), d.labels.numpy(),
                              seed=i, seen=seen) for i, d in enumerate(base)]
    final = "evaluation: {final: true}\n"

    async def main():
        async with in_process().whole_system(tmp_path) as s:
            job_id, _ = await s.run_job(spec("final", ROUNDS, cohort=N) + final, devices)
            store = s.coordinator.store
            models = [modelio.deserialize(store.read_blob(store.model_version(job_id, r).model_digest))
                      for r in (ROUNDS, ROUNDS + 1)]
            return await s.job(job_id), await s.round_metrics(job_id), models

    job, figures, (trained, scored) = run(main())
    assert job.state == common_pb2.JOB_STATE_SUCCEEDED, job.message
    assert job.committed_round == ROUNDS + 1 and job.rounds == ROUNDS + 1
    assert sorted(figures) == list(range(1, ROUNDS + 2))
    last = figures[ROUNDS + 1]
    assert last[EVALUATION_ONLY] == ROUNDS and all(EVALUATION_ONLY not in figures[r] for r in range(1, ROUNDS + 1))
    assert "train.loss" not in last and "train.loss" in figures[ROUNDS]
    assert all(np.array_equal(trained[k], scored[k]) for k in trained)  # the model is the final one, unchanged
    # Every device trained once per training round (all N are each round's cohort), never on the final model.
    final_sum = sum(float(np.asarray(v, np.float64).sum()) for v in scored.values())
    assert len(seen) == N * ROUNDS and final_sum not in seen

    # The same devices scoring the same model in process, through the same halves.
    server, client = reference_halves("fedavg", {"local_epochs": 1, "local_lr": 0.1, "batch_size": 16}, extra=final)
    state = server.init(scored)
    server.evaluate_round(True, only=True)
    [step] = server.steps(state)
    broadcast = server.broadcast(state, step.name)
    inputs = [client.contribute(step.name, broadcast, d, None)[0] for d in devices]
    server.apply(state, step.name, {k: sum(i[k] for i in inputs) for k in inputs[0]})
    expected = server.round_quality
    assert last["eval.devices"] == N and last["eval.examples"] == expected["eval.examples"]
    for key in ("eval.loss", "eval.accuracy"):
        assert abs(last[key] - expected[key]) < 1e-3, key
    hist = sorted(k for k in expected if k.startswith("eval.accuracy_hist."))
    assert hist and [last[k] for k in hist] == [expected[k] for k in hist]


def test_separate_evaluation_rounds_follow_every_other_training_round_with_their_own_cohort(tmp_path):
    """``separate: true, every: 2, cohort_size: 6`` over 3 training rounds: rounds 1, 2, 4 train;
    3 and 5 select 6 devices that score the models of training rounds 2 and 3."""
    from tally import modelio

    text = spec("separate", 3, cohort=N) + "evaluation: {separate: true, every: 2, cohort_size: 6}\n"

    async def main():
        async with in_process().whole_system(tmp_path) as s:
            job_id, _ = await s.run_job(text, trainers(N)[0])
            store = s.coordinator.store
            digests = {r: store.model_version(job_id, r).model_digest for r in range(1, 6)}
            models = {r: modelio.deserialize(store.read_blob(d)) for r, d in digests.items()}
            return await s.job(job_id), await s.round_metrics(job_id), models

    job, figures, models = run(main())
    assert job.state == common_pb2.JOB_STATE_SUCCEEDED, job.message
    assert sorted(figures) == [1, 2, 3, 4, 5] and job.rounds == 5
    assert {r: figures[r].get(EVALUATION_ONLY) for r in figures} == {1: None, 2: None, 3: 2.0, 4: None, 5: 3.0}
    for r in (3, 5):
        assert figures[r]["selected"] == figures[r]["eval.devices"] == 6
        assert "train.loss" not in figures[r] and "eval.accuracy" in figures[r]
        assert all(np.array_equal(models[r][k], models[r - 1][k]) for k in models[r])  # scored, not changed
    assert all(figures[r]["selected"] == N for r in (1, 2, 4))
    # every: 2 evaluates training rounds 2 and 3 (the last), which are rounds 2 and 4.
    assert "train.loss" not in figures[1] and all("train.loss" in figures[r] for r in (2, 4))
    assert not all(np.array_equal(models[4][k], models[3][k]) for k in models[4])  # round 4 trained
