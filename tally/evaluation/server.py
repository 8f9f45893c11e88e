"""Any algorithm's server half with federated evaluation.

The wrapper sits where DP's does (and inside it, so DP clips and noises the metric fields with the
update): the algorithm keeps its state, its steps and its sums; the wrapper appends the metric
fields to the round's last secure step, sends the plan with the first broadcast, and takes the
metric totals off that step's total before the algorithm applies it. What they say is
``round_quality``, which the runner (the coordinator's or the simulator's) reads after the round.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import numpy as np

from tally.algorithms.base import Arrays, ServerAlgorithm, StepSpec
from tally.codec import Kind
from tally.evaluation.plan import EVALUATION_STEP, PLAN, PREFIX, EvaluationPlan, split_total
from tally.evaluation.summary import quality

# Under DP the metrics share the update's L2 ball: together they may take this share of it (each
# field's declared bound is inflated so), leaving the update almost all of the clip.
DP_METRIC_SHARE = 0.25
WITHHELD_UNDER_DP = ("examples", "clipped", "scored")  # reports of exact counts: not released under DP


def broadcast_keys(model: Arrays, broadcast: Arrays) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(model parameter names, the broadcast keys carrying them): a parameter is found under its own
    name, else under the one broadcast tensor equal to it (an algorithm that prefixes its model)."""
    names, keys = [], []
    for name, value in model.items():
        if name in broadcast and np.array_equal(broadcast[name], value):
            key: str | None = name
        else:
            key = next((k for k, v in broadcast.items()
                        if np.shape(v) == np.shape(value) and np.array_equal(v, value)), None)
        if key is not None:
            names.append(name)
            keys.append(key)
    return tuple(names), tuple(keys)


class EvaluatedServer:
    """``inner`` with a round's federated evaluation. ``due``: whether this round evaluates (the
    runner sets it from ``evaluate_every``); devices hold out their examples in every round.
    ``only``: the round only evaluates (one step, ``EVALUATION_STEP``, summing the metric fields
    alone; the algorithm's state is left as it is)."""

    def __init__(self, inner: ServerAlgorithm, plan: EvaluationPlan) -> None:
        self.inner, self.plan = inner, plan
        self.due = True
        self.only = False
        self.round_quality: dict[str, float] = {}

    def __getattr__(self, attr: str) -> Any:  # options, num_clients, broadcast_to ... of the algorithm
        if attr == "inner":
            raise AttributeError(attr)
        return getattr(self.inner, attr)

    @property
    def name(self) -> str:
        return self.inner.name

    def evaluate_round(self, due: bool, only: bool = False) -> None:
        """Whether the coming round carries the metrics, and whether it does nothing else (a
        method, so it reaches this wrapper through DP's, which forwards what it does not have)."""
        self.due, self.only = due or only, only
        self.round_quality = {}

    def init(self, params: Arrays) -> Any:
        return self.inner.init(params)

    def model(self, state: Any) -> Arrays:
        return self.inner.model(state)

    def carrier(self, steps: list[StepSpec]) -> str:
        """The step whose sum carries the metrics: the last secure one (a reveal step is no sum)."""
        return next(s.name for s in reversed(steps) if not s.reveal)

    def steps(self, state: Any) -> list[StepSpec]:
        if self.only:
            return [StepSpec(EVALUATION_STEP, self.plan.evaluation_only().schema())]
        steps = self.inner.steps(state)
        if not self.due:
            return steps
        target = self.carrier(steps)
        return [replace(s, schema=self.plan.extend(s.schema)) if s.name == target else s for s in steps]

    def broadcast(self, state: Any, step: str) -> Arrays:
        steps = self.inner.steps(state)
        if self.only:  # what a training round's devices would receive: the model to score
            out = self.inner.broadcast(state, steps[0].name)
            plan = self.plan.evaluation_only()
        else:
            out = self.inner.broadcast(state, step)
            if step != steps[0].name:
                return out
            plan = replace(self.plan, step=self.carrier(steps) if self.due else "")
        names, keys = broadcast_keys(self.inner.model(state), out)
        return {**out, PLAN: replace(plan, model=keys, model_names=names).tensor()}

    def apply(self, state: Any, step: str, total: Mapping[str, np.ndarray]) -> Any:
        own, metrics = split_total(total)
        if metrics:
            self.round_quality = quality(self.plan, metrics)
        return state if self.only else self.inner.apply(state, step, own)

    def privacy_roles(self) -> dict[str, Any]:
        """How DP treats each metric field: a bound (the field enters the joint clip in its units),
        ``"counted"`` (one per device) or ``"withheld"`` (never released under DP)."""
        counted = ("devices", "weight", "train_weight") if self.plan.device_weighted else ("devices",)
        fields = self.plan.fields()
        released = [f for f in fields if f.name[len(PREFIX):] not in (*WITHHELD_UNDER_DP, *counted)]
        inflate = math.sqrt(len(released)) / DP_METRIC_SHARE
        roles: dict[str, Any] = {PREFIX + name: "counted" for name in counted if PREFIX + name in
                                 {f.name for f in fields}}
        roles.update({PREFIX + name: "withheld" for name in WITHHELD_UNDER_DP})
        for f in released:
            natural = 1.0 if f.kind is Kind.COUNT and f.clip == 1 and f.size > 1 else f.clip * math.sqrt(f.size)
            roles[f.name] = natural * inflate
        return roles
