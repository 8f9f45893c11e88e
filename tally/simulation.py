"""In-process federated simulation: the algorithm halves, real devices' training, and
either the real secure-sum protocol (masking, dropouts, fixed point) or a plain sum.

It is the research path of ``tally simulate`` and the reference the services are
tested against: the same algorithm through gRPC must give the same model up to the
codec's quantisation error.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tally.algorithms.base import Arrays, ClientAlgorithm, LocalTrainer, ServerAlgorithm, StepSpec
from tally.secagg import Dropout, SessionRef, ThreatModel, secure_sum

SumFn = Callable[[int, StepSpec, Mapping[int, Arrays]], tuple[dict[str, np.ndarray], list[int]]]


def plain_sum(round_: int, step: StepSpec, contributions: Mapping[int, Arrays]):
    """Exact float sum over every device: the no-privacy baseline."""
    total = {
        f.name: sum(np.asarray(c[f.name], dtype=np.float64) for c in contributions.values())
        for f in step.schema.fields
    }
    return total, sorted(contributions)


@dataclass
class SecureSum:
    """Each step through the real protocol, with a fraction of devices dropping at random phases."""

    threat: ThreatModel = field(default_factory=ThreatModel)
    dropout: float = 0.0
    seed: int = 0
    job_id: str = "simulation"

    def __post_init__(self) -> None:
        self.rng = np.random.default_rng(self.seed)

    def __call__(self, round_: int, step: StepSpec, contributions: Mapping[int, Arrays]):
        devices = sorted(contributions)
        values = {i + 1: {step.name: contributions[d]} for i, d in enumerate(devices)}
        victims = self.rng.choice(len(devices), size=int(self.dropout * len(devices)), replace=False)
        dropouts = {int(v) + 1: Dropout(str(self.rng.choice(("share_keys", "masked_input", "unmask")))) for v in victims}
        decoded, run = secure_sum(
            {step.name: step.schema},
            values,
            threat=self.threat,
            dropouts=dropouts,
            rng=self.rng,
            ref=SessionRef(self.job_id, round_, step.name),
        )
        if run.aborted:
            raise RuntimeError(f"round {round_} step {step.name}: {run.aborted}")
        contributors = [devices[i - 1] for i in run.results[step.name].contributors]
        return decoded[step.name], contributors


@dataclass
class RoundLog:
    round: int
    cohort: list[int]
    contributors: dict[str, list[int]]
    test_loss: float | None = None
    test_accuracy: float | None = None


def run_rounds(
    server: ServerAlgorithm,
    client: ClientAlgorithm,
    devices: list[LocalTrainer],
    initial: Arrays,
    rounds: int,
    cohort_size: int,
    sum_fn: SumFn,
    seed: int = 0,
    evaluate: Callable[[Arrays], tuple[float, float]] | None = None,
    on_round: Callable[[RoundLog], None] | None = None,
) -> tuple[Any, list[RoundLog]]:
    rng = np.random.default_rng(seed)
    state = server.init(initial)
    local: dict[int, Any] = {}
    logs = []
    for r in range(rounds):
        cohort = sorted(rng.choice(len(devices), size=min(cohort_size, len(devices)), replace=False).tolist())
        log = RoundLog(r, cohort, {})
        for step in server.steps(state):
            broadcast = server.broadcast(state, step.name)
            contributions, pending = {}, {}
            for d in cohort:
                contributions[d], pending[d] = client.contribute(step.name, broadcast, devices[d], local.get(d))
            total, contributors = sum_fn(r, step, contributions)
            # Local state advances only where the contribution counted.
            local.update({d: pending[d] for d in contributors})
            log.contributors[step.name] = contributors
            state = server.apply(state, step.name, total)
        if evaluate is not None:
            log.test_loss, log.test_accuracy = evaluate(server.model(state))
        logs.append(log)
        if on_round is not None:
            on_round(log)
    return state, logs
