"""Any algorithm's server half made differentially private.

The wrapper sits between an algorithm and the secure sum, so the algorithm's halves stay as they
are: the server half still receives a total (now noisy) of the fields it reads; the client half
still returns its payload, which ``payload.PrivateClient`` clips (and for distributed DP rotates,
rounds and noises) on the device.
"""

from __future__ import annotations

import secrets
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from tally.algorithms.base import Arrays, ServerAlgorithm, StepSpec
from tally.codec import PayloadSchema
from tally.privacy import mechanisms
from tally.privacy.accounting import PrivacyLedger, RoundPrivacy, calibrate
from tally.privacy.payload import CENTRAL, COUNTED_PREFIX, FIELD_PREFIX, MECHANISM_CODES, PARAMS, SEED, split
from tally.privacy.planning import (
    DEFAULT_WRAP_PROBABILITY,
    DP_FIELD,
    DistributedPlan,
    corrupt_devices,
    plan_distributed,
)
from tally.privacy.sensitivity import Layout, layout


@dataclass(frozen=True)
class PrivacySettings:
    """A job's resolved DP settings (a target epsilon already calibrated to a noise multiplier)."""

    mechanism: str
    clip: float
    noise_multiplier: float
    delta: float
    cohort_size: int
    dropout_rate: float = 0.0
    corrupt_rate: float = 0.0
    min_survivors: int = 1
    sampling_rate: float = 1.0
    bits: int | None = None
    wrap_probability: float = DEFAULT_WRAP_PROBABILITY
    # Set when noise_multiplier was calibrated to a target: the job's rounds and the sums per
    # round it was calibrated for (every released sum is one event in the accountant).
    target_epsilon: float | None = None
    rounds: int = 0
    sums_per_round: int = 1


@dataclass(frozen=True)
class _Prepared:
    source: PayloadSchema  # the algorithm's schema this was laid out from
    layout: Layout
    plan: DistributedPlan | None

    @property
    def wire(self) -> PayloadSchema:
        return self.plan.wire_schema() if self.plan is not None else self.layout.schema()


class PrivateServer:
    """The algorithm's server half with DP: same state, same model, steps with DP schemas.
    ``account`` records a released sum in the job's ledger; call it once per decoded total,
    before ``apply`` (a counted field's total is the number of contributors it records)."""

    def __init__(self, inner: ServerAlgorithm, algorithm: str, settings: PrivacySettings) -> None:
        self.inner, self.algorithm, self.settings = inner, algorithm, settings
        self.ledger = PrivacyLedger(settings.delta, settings.sampling_rate)
        self._prepared: dict[str, _Prepared] = {}
        self._seeds: dict[str, int] = {}
        self._survivors: dict[str, int] = {}  # per step: contributors of the last accounted sum

    def __getattr__(self, attr: str) -> Any:  # options, num_clients, ... of the algorithm
        if attr == "inner":
            raise AttributeError(attr)
        return getattr(self.inner, attr)

    @property
    def name(self) -> str:
        return self.inner.name

    def init(self, params: Arrays) -> Any:
        state = self.inner.init(params)
        self._calibrate(len(self.inner.steps(state)))
        return state

    def _calibrate(self, sums_per_round: int) -> None:
        """A target epsilon covers every sum the job releases: an algorithm with k sums a round
        (FedDAR 2, AAggFF 3) composes k events a round, so its noise is calibrated for k * rounds."""
        s = self.settings
        if s.target_epsilon is None or sums_per_round == s.sums_per_round:
            return
        z = calibrate(s.target_epsilon, s.delta, s.rounds * sums_per_round, s.sampling_rate)
        self.settings = replace(s, noise_multiplier=z, sums_per_round=sums_per_round)
        self._prepared.clear()

    def model(self, state: Any) -> Arrays:
        return self.inner.model(state)

    def steps(self, state: Any) -> list[StepSpec]:
        return [StepSpec(s.name, self.prepare(s).wire) for s in self.inner.steps(state)]

    def prepare(self, step: StepSpec) -> _Prepared:
        """The step's DP layout and plan; ``PrivacyRefused`` when it cannot be made private."""
        cached = self._prepared.get(step.name)
        if cached is not None and cached.source == step.schema:
            return cached
        fields = layout(self.algorithm, self.inner, step)
        s = self.settings
        plan = None if s.mechanism == CENTRAL else plan_distributed(
            clip=s.clip, dim=fields.dim, noise_multiplier=s.noise_multiplier, cohort_size=s.cohort_size,
            dropout_rate=s.dropout_rate, corrupt_rate=s.corrupt_rate, min_survivors=s.min_survivors,
            bits=s.bits, wrap_probability=s.wrap_probability,
        )
        self._prepared[step.name] = prepared = _Prepared(step.schema, fields, plan)
        return prepared

    def broadcast(self, state: Any, step: str) -> Arrays:
        return {**self.inner.broadcast(state, step), **self._public(step)}

    def _public(self, step: str) -> Arrays:
        """A fresh rotation seed per broadcast (remembered for ``apply``) and the device's share."""
        prepared = self._prepared[step]
        seed = self._seeds[step] = secrets.randbits(63)
        plan = prepared.plan
        share = (0.0, 0.0, 0.0, 0.0) if plan is None else (plan.scale, plan.bound_sq, plan.sigma_device,
                                                              plan.noise_devices)
        # The declared multiplier and the honest devices the share is planned over come after the
        # share, for devices that check them against their own floor (payload.check_noise_floor).
        out: Arrays = {
            SEED: np.array([seed], dtype=np.int64),
            PARAMS: np.array([MECHANISM_CODES[self.settings.mechanism], self.settings.clip, *share[:3],
                              self.settings.noise_multiplier, share[3]]),
        }
        units = prepared.layout.units(self.settings.clip)
        out.update({FIELD_PREFIX + f.name: np.array([i, unit])  # its place in the vector, its unit
                    for i, (f, unit) in enumerate(zip(prepared.layout.clipped, units, strict=True))})
        out.update({COUNTED_PREFIX + f.name: np.ones(1) for f in prepared.layout.counted})
        return out

    def apply(self, state: Any, step: str, total: Mapping[str, np.ndarray]) -> Any:
        prepared = self._prepared[step]
        fields = prepared.layout.clipped
        units = np.repeat(prepared.layout.units(self.settings.clip), [f.size for f in fields])
        if prepared.plan is not None:  # the ring carries the fields in units of the joint clip
            vector = units * mechanisms.decode_distributed(total[DP_FIELD], prepared.plan, self._seeds[step])
        else:
            vector = np.concatenate([np.asarray(total[f.name], dtype=np.float64).ravel() for f in fields])
            noise = mechanisms.central_noise(self.settings.noise_multiplier, self.settings.clip, vector.size)
            vector = vector + units * noise
        released = split(vector, [(f.name, f.shape) for f in fields])
        if prepared.layout.counted:
            if step not in self._survivors:
                raise ValueError(f"sum {step!r} applied before it was accounted: its contributors are unknown")
            released.update({f.name: np.full(f.shape, float(self._survivors[step])) for f in prepared.layout.counted})
        return self.inner.apply(state, step, released)

    def plan_of(self, step: str) -> DistributedPlan | None:
        """The distributed plan of a step laid out by ``steps`` (None for central DP)."""
        return self._prepared[step].plan

    def account(self, round_: int, step: str, survivors: int) -> RoundPrivacy:
        """The sum of ``step`` over ``survivors`` devices was decoded: record what it cost.
        Distributed: only the honest survivors' noise counts (the job's corrupt fraction of the
        cohort may subtract theirs); fewer survivors, less noise, a larger epsilon."""
        self._survivors[step] = survivors
        plan = self.plan_of(step)
        if plan is None:
            return self.ledger.record(round_, self.settings.noise_multiplier)
        honest = survivors - corrupt_devices(self.settings.cohort_size, self.settings.corrupt_rate)
        return self.ledger.record(round_, 1.0 / plan.epsilon_zcdp(honest), honest)
