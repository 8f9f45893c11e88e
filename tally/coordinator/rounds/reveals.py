"""The one documented exception to "only sums" (DESIGN.md section 1): a reveal step, where each
device of the round sends its payload in the clear and the server half receives the rows.

Only a job whose top-level ``reveal:`` lists every value a step reveals gets such a step at all
(``tally.coordinator.spec.jobspec`` builds the server half with that list); ``RevealCollector`` gathers one
step's rows exactly as ``tally.sim.rounds.reveal_values`` builds them: each payload through the
schema's fixed point alone, rows in ascending silo id, so the services and the simulator agree.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Mapping

import numpy as np

from tally.algorithms.base import StepSpec
from tally.codec import CodecError, to_ring


class RevealOutOfPhase(Exception):
    """A reveal for a step that is not being collected now (FAILED_PRECONDITION)."""


class RevealCollector:
    """One reveal step's rows, keyed by task; ``complete`` is set once every task has answered."""

    def __init__(self, step: StepSpec, tasks: Iterable[str]) -> None:
        self.step = step
        self.expected = set(tasks)
        self.rows: dict[int, dict[str, np.ndarray]] = {}  # silo id -> decoded payload
        self._by_task: dict[str, int] = {}
        self.complete = asyncio.Event()
        self._bits = step.schema.required_bits(1)
        self._rng = np.random.default_rng()

    def add(self, task_id: str, silo: int, values: Mapping[str, np.ndarray]) -> None:
        """Record a device's payload (again, idempotently, if it retries); ``ValueError`` when it
        does not fit the step's schema."""
        if task_id not in self.expected:
            raise RevealOutOfPhase(f"task {task_id!r} is not in this reveal")
        schema = self.step.schema
        fields = {f.name: f for f in schema.fields}
        if set(values) != set(fields):
            raise ValueError(f"step {self.step.name!r} reveals fields {sorted(fields)}, got {sorted(values)}")
        for name, field in fields.items():
            if np.shape(values[name]) != tuple(field.shape):
                raise ValueError(f"{name}: shape {np.shape(values[name])}, expected {tuple(field.shape)}")
        try:
            encoded = schema.encode(values, self._rng)
            self.rows[silo] = schema.decode_sum(to_ring(encoded.vector, self._bits), self._bits)
        except CodecError as exc:
            raise ValueError(f"step {self.step.name!r}: {exc}") from None
        self._by_task[task_id] = silo
        if set(self._by_task) == self.expected:
            self.complete.set()

    def revealed(self, task_id: str) -> bool:
        return task_id in self._by_task

    def total(self) -> dict[str, np.ndarray]:
        """What the server half's ``apply`` takes: ``device_ids`` ascending, one row per field."""
        ids = sorted(self.rows)
        total = {"device_ids": np.array(ids, dtype=np.int64)}
        total.update({f.name: np.stack([self.rows[i][f.name] for i in ids]) for f in self.step.schema.fields})
        return total
