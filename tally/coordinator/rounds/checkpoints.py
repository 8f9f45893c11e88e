"""A job's checkpoints: each committed round's model, algorithm state and ONNX export as blobs,
and the state a (restarted) coordinator continues from.

The state blob is what lets a restart resume exactly where the last commit left off; an algorithm
whose state cannot be encoded still checkpoints its model, and a restart then resumes from the
model alone (logged), rather than not at all.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from tally import logs, modelio
from tally.algorithms.base import ServerAlgorithm
from tally.coordinator.rounds.failures import JobFailed
from tally.coordinator.rounds.onnx_export import export_model
from tally.coordinator.spec import catalogue
from tally.coordinator.spec.jobspec import JobSpec
from tally.coordinator.state.state_codec import UnsupportedState, state_from_bytes, state_to_bytes
from tally.coordinator.state.store import ModelVersion, Store

log = logging.getLogger(__name__)


class Checkpoints:
    """Where one job's server half is saved after each round and restored from."""

    def __init__(
        self, job_id: str, spec: JobSpec, server: ServerAlgorithm, store: Store, clock: Callable[[], float]
    ) -> None:
        self.job_id, self.spec, self.server = job_id, spec, server
        self._store, self._clock = store, clock

    async def restore(self, committed: int) -> Any:
        """The state to continue after round ``committed`` from: its checkpoint, or a fresh
        model (checkpointed as round 0) when the job has none yet."""
        store = self._store
        version = store.model_version(self.job_id)
        if version is None:
            state = self.server.init(catalogue.initial_model(self.spec.model))
            store.add_model_version(await self.write(0, state))
            return state
        if version.round != committed:
            raise JobFailed(
                f"store is inconsistent: latest model is round {version.round}, "
                f"committed round {committed}"
            )
        template = self.server.init(modelio.deserialize(store.read_blob(version.model_digest)))
        if version.state_digest is None:
            return template
        return state_from_bytes(store.read_blob(version.state_digest), template)

    async def write(self, round_: int, state: Any) -> ModelVersion:
        """Model, algorithm state and ONNX export as blobs (in a worker thread)."""

        def write() -> ModelVersion:
            store = self._store
            model = self.server.model(state)
            model_digest = store.put_blob(modelio.serialize(model), "model")
            try:
                state_digest: str | None = store.put_blob(state_to_bytes(state), "state")
            except UnsupportedState as exc:
                logs.event(log, "algorithm state not checkpointed; a restart resumes from the model only",
                           logging.WARNING, job_id=self.job_id, reason=str(exc))
                state_digest = None
            try:
                onnx_digest: str | None = store.put_blob(export_model(model, self.spec.model), "onnx")
            except (ValueError, RuntimeError) as exc:
                logs.event(log, "no ONNX export", logging.WARNING, job_id=self.job_id, round=round_,
                           reason=str(exc))
                onnx_digest = None
            return ModelVersion(self.job_id, round_, model_digest, state_digest, onnx_digest, self._clock())

        return await asyncio.to_thread(write)
