"""Experiment tracking: one MLflow run per job (params: the job spec; metrics: each committed
round's figures, model quality included; artifact: the final model as ONNX; tags: the job's
state and, if it failed, why).

MLflow is an optional extra (``tally[tracking]``, ``mlflow-skinny``); the tracking URI is the
coordinator's (``--tracking-uri``; default a file store in its state directory, which needs no
server or database: point it at an MLflow server in production). Calls to the
tracking server are blocking I/O, so they run on one worker thread in event order, never on the
event loop, and a tracking server that fails is logged, never a job's failure. A restarted
coordinator finds a job's run again by its ``tally.job_id`` tag and goes on logging into it.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import tempfile
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import yaml

from tally import logs
from tally.coordinator.state.events import TERMINAL_STATES
from tally.coordinator.state.store import EventRecord, Store

log = logging.getLogger(__name__)
EXPERIMENT = "tally"
JOB_TAG = "tally.job_id"
MAX_PARAM_CHARS = 500
FILE_STORE_OPT_IN = "MLFLOW_ALLOW_FILE_STORE"


class TrackingUnavailable(RuntimeError):
    """A tracking URI was given but MLflow is not installed."""


def default_uri(state_dir: Path) -> str:
    return (Path(state_dir).resolve() / "mlruns").as_uri()


def flat_params(spec: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """A job spec as MLflow params: dotted keys, values as text (at most ``MAX_PARAM_CHARS``)."""
    out: dict[str, str] = {}
    for key, value in spec.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            out.update(flat_params(value, name + "."))
        else:
            out[name] = str(value)[:MAX_PARAM_CHARS]
    return out


class MlflowTracker:
    """An ``EventHub`` listener writing each job's events to its MLflow run."""

    def __init__(self, store: Store, uri: str) -> None:
        if importlib.util.find_spec("mlflow") is None:
            raise TrackingUnavailable(
                "experiment tracking needs MLflow: pip install 'tally[tracking]' (mlflow-skinny), or run the "
                "coordinator with --tracking-uri none")
        if uri.startswith("file:"):
            # The default store needs no server or database; MLflow 3 asks file stores to opt in.
            os.environ.setdefault(FILE_STORE_OPT_IN, "true")
        self.store, self.uri = store, uri
        self._client: Any = None  # imported on the worker thread: MLflow takes a second to import
        self._runs: dict[str, str] = {}
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mlflow")

    def __call__(self, event: EventRecord) -> None:
        if event.phase == "COMMITTED" or event.state in TERMINAL_STATES:
            self._worker.submit(self._record, event)

    def close(self) -> None:
        """Finish what was queued (a coordinator stopping waits for its last events)."""
        self._worker.shutdown(wait=True)

    @property
    def client(self) -> Any:
        if self._client is None:
            from mlflow.tracking import MlflowClient

            self._client = MlflowClient(tracking_uri=self.uri)
        return self._client

    def run_id(self, job_id: str) -> str:
        """The job's run, created with the job spec as params the first time."""
        known = self._runs.get(job_id)
        if known is not None:
            return known
        experiment = self.client.get_experiment_by_name(EXPERIMENT)
        experiment_id = (experiment.experiment_id if experiment is not None
                         else self.client.create_experiment(EXPERIMENT))
        found = self.client.search_runs([experiment_id], filter_string=f"tags.`{JOB_TAG}` = '{job_id}'")
        if found:
            run_id = found[0].info.run_id
        else:
            record = self.store.job(job_id)
            run = self.client.create_run(experiment_id, run_name=job_id, tags={JOB_TAG: job_id})
            run_id = run.info.run_id
            if record is not None:
                for key, value in flat_params(yaml.safe_load(record.spec_yaml)).items():
                    self.client.log_param(run_id, key, value)
        self._runs[job_id] = run_id
        return run_id

    def _record(self, event: EventRecord) -> None:
        try:
            run_id = self.run_id(event.job_id)
            if event.phase == "COMMITTED":
                timestamp = int(event.time * 1000)
                for key, value in event.metrics.items():
                    self.client.log_metric(run_id, key, float(value), timestamp=timestamp, step=event.round)
            if event.state in TERMINAL_STATES:
                self._finish(run_id, event)
        except Exception as exc:  # noqa: BLE001 - a tracking server's failure must not touch the job
            logs.event(log, "experiment tracking failed", logging.WARNING, job_id=event.job_id, uri=self.uri,
                       error=f"{type(exc).__name__}: {exc}")

    def _finish(self, run_id: str, event: EventRecord) -> None:
        self.client.set_tag(run_id, "tally.state", event.state)
        if event.state != "SUCCEEDED":
            self.client.set_tag(run_id, "tally.message", event.message[:MAX_PARAM_CHARS])
        version = self.store.model_version(event.job_id)
        blob = self.store.blob(version.onnx_digest) if version is not None and version.onnx_digest else None
        if blob is not None:
            with tempfile.TemporaryDirectory() as tmp:
                model = Path(tmp) / "model.onnx"
                model.write_bytes(blob.path.read_bytes())
                self.client.log_artifact(run_id, str(model), artifact_path="model")
        self.client.set_terminated(run_id, "FINISHED" if event.state == "SUCCEEDED" else "FAILED")
