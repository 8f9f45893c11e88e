"""In-process federated simulation: the algorithm halves, real devices' training, and
either the real secure-sum protocol (masking, dropouts, fixed point) or a plain sum.

It is the research path of ``tally simulate`` and the reference the services are
tested against: the same algorithm through gRPC must give the same model up to the
codec's quantisation error.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tally import logs
from tally.algorithms.base import Arrays, ClientAlgorithm, LocalTrainer, ServerAlgorithm, StepSpec
from tally.codec import to_ring
from tally.secagg import Dropout, SessionRef, ThreatModel, secure_sum
from tally.secagg.phases import Phase

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
        dropouts = {int(v) + 1: Dropout(str(self.rng.choice((Phase.SHARE_KEYS, Phase.MASKED_INPUT, Phase.UNMASK))))
                    for v in victims}
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


class RevealRefused(PermissionError):
    """A step asked for per-device values the job did not opt in to reveal."""


def reveal_values(
    round_: int, step: StepSpec, contributions: Mapping[int, Arrays], allowed: Sequence[str], rng: np.random.Generator
) -> tuple[dict[str, np.ndarray], list[int]]:
    """The one exception to "only sums": each device's payload, in the same fixed point.

    Refused unless the job lists every revealed name; logged and counted so the
    exception is visible wherever it happens.
    """
    missing = set(step.reveal) - set(allowed)
    if missing:
        raise RevealRefused(
            f"step {step.name!r} reveals {sorted(missing)} but the job's reveal list is {list(allowed)}")
    ids = sorted(contributions)
    bits = step.schema.required_bits(1)
    alone = [step.schema.decode_sum(to_ring(step.schema.encode(contributions[d], rng).vector, bits), bits) for d in ids]
    total = {"device_ids": np.array(ids, dtype=np.int64)}
    total.update({f.name: np.stack([a[f.name] for a in alone]) for f in step.schema.fields})
    REVEALED_VALUES[step.name] = REVEALED_VALUES.get(step.name, 0) + len(ids) * len(step.reveal)
    logs.event(_log, "per-device values revealed (job opt-in)", round=round_, step=step.name,
               devices=len(ids), values=list(step.reveal))
    return total, ids


# Revealed values per step name in this process: the simulator's counterpart of the
# coordinator's tally_coordinator_revealed_values_total metric.
REVEALED_VALUES: dict[str, int] = {}
_log = logging.getLogger(__name__)


@dataclass
class RoundLog:
    round: int
    cohort: list[int]
    contributors: dict[str, list[int]]
    test_loss: float | None = None
    test_accuracy: float | None = None
    trace: dict[str, Any] = field(default_factory=dict)


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
    reveal: Sequence[str] = (),
    trace: Callable[[Any, Mapping[int, Any]], dict[str, Any]] | None = None,
    local_states: dict[int, Any] | None = None,
    sample: Callable[[np.random.Generator, int], list[int]] | None = None,
) -> tuple[Any, list[RoundLog]]:
    """``reveal`` lists the per-device values the job opted in to reveal (DESIGN.md section 1);
    ``trace(state, local_states)`` picks what a report plots per round (λ, p). ``local_states``,
    when given, is each device's on-device state, updated in place (a personalised algorithm's
    models are evaluated from it after the run). ``sample(rng, population)`` picks a round's cohort
    (default: ``cohort_size`` devices uniformly without replacement; DP's Poisson amplification
    needs Poisson sampling instead)."""
    rng = np.random.default_rng(seed)
    state = server.init(initial)
    local: dict[int, Any] = {} if local_states is None else local_states
    logs = []
    for r in range(rounds):
        cohort = (sorted(sample(rng, len(devices))) if sample is not None else
                  sorted(rng.choice(len(devices), size=min(cohort_size, len(devices)), replace=False).tolist()))
        log = RoundLog(r, cohort, {})
        for step in server.steps(state):
            broadcast = None if step.personal else server.broadcast(state, step.name)
            contributions, pending = {}, {}
            for d in cohort:
                b = server.broadcast_to(state, step.name, d) if step.personal else broadcast
                contributions[d], pending[d] = client.contribute(step.name, b, devices[d], local.get(d))
            if step.reveal:
                total, contributors = reveal_values(r, step, contributions, reveal, rng)
            else:
                total, contributors = sum_fn(r, step, contributions)
            # Local state advances only where the contribution counted.
            local.update({d: pending[d] for d in contributors})
            log.contributors[step.name] = contributors
            state = server.apply(state, step.name, total)
        if evaluate is not None:
            log.test_loss, log.test_accuracy = evaluate(server.model(state))
        if trace is not None:
            log.trace = trace(state, local)
        logs.append(log)
        if on_round is not None:
            on_round(log)
    return state, logs
